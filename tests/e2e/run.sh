#!/usr/bin/env bash
# `make e2e`, on the GPU machine (no network). Three verbs:
#   run.sh unpack DIR [DIR ...]    lay out carries of `make e2e-pack` (build/e2e/*) in the store,
#                                  in any order (their .tar.xz read by Python's lzma:
#                                  tests/e2e/archive.py)
#   run.sh serve SPEC [SPEC ...]   start and test stacks (tests/e2e/matrix.py), SPEC being
#                                  release:layout:state, e.g. 0.29.0:b200-tp1-pcp4-dcp4:pristine
#   run.sh bench [ARGS ...]        the live benchmark (tests/e2e/bench.py): one stack, direct vs
#                                  sidecar vs Envoy; results $OUT/e2e-bench.tar.gz, bench.json/md
#   run.sh backends [ARGS ...]     GLM-5.3's sparse-MLA attention backends side by side
#                                  (tests/e2e/backends.py); results $OUT/e2e-backends.tar.gz,
#                                  backends.json/md
# The store (default $TMPDIR/mla-serve-e2e-store) outlives a run while the machine stays
# warm, so carries of 64 MiB can travel in back-to-back runs. Results go to $OUT (one
# archive and matrix.json, as a device run brings back at most 8 files) or
# build/e2e-results/ (the runs of record are in results/e2e/ and results/bench/). The scripts run as modules of the package `tests`
# (`python -m tests.…`) from the repository root, this script's working directory.
set -uo pipefail
cd "$(dirname "$0")/../.."
STORE=${MLA_SERVE_E2E_STORE:-${TMPDIR:-/tmp}/mla-serve-e2e-store}
PYTHON=${PYTHON:-python3}
verb=${1:-}
[ "$#" -eq 0 ] || shift
case "$verb" in
  unpack)
    for dir in "$@"; do
      name=$(basename "$dir")
      dest="$STORE/$name"
      if [ "$name" = envoy ]; then  # checked before the store's copy is replaced
        (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || { echo "run.sh: $dir: sha256 mismatch" >&2; exit 2; }
      fi
      case "$name" in deps-*) ;; *) rm -rf "$dest" && mkdir -p "$dest" ;; esac
      case "$name" in
        common)
          $PYTHON -m pip install -q --no-index --no-deps --no-compile --target "$dest/site" \
            "$dir"/wheels/*.whl || exit 2
          cp -r "$dir"/model* "$dir/layouts.json" "$dest/" || exit 2 ;;
        vllm-*)
          # The CuTe DSL's Python part and quack go beside its libraries (one package dir).
          dsl=$($PYTHON -c 'import json,sys; print(json.load(open(sys.argv[1]))["cute_dsl_version"])' "$dir/pack.json")
          $PYTHON -m tests.e2e.archive extract "$dir/vllm.tar.xz" "$dest/tree" || exit 2
          $PYTHON -m tests.e2e.archive extract "$dir/site.tar.xz" "$STORE/deps-$dsl/site" || exit 2
          cp "$dir/pack.json" "$dest/" || exit 2 ;;
        ext-*)  # the release's MoE and KDA modules, laid over its tree per stack (matrix.py)
          $PYTHON -m tests.e2e.archive extract "$dir/ext.tar.xz" "$dest/tree" || exit 2 ;;
        flashinfer-*)  # the image's FlashInfer: Python package and the CUDA sources its JIT reads
          $PYTHON -m tests.e2e.archive extract "$dir/flashinfer.tar.xz" "$dest/site" || exit 2 ;;
        envoy)  # the live benchmark's proxies: Envoy's and py-spy's wheels (checked above)
          $PYTHON -m pip install -q --no-index --no-deps --no-compile --target "$dest/site" \
            "$dir"/*.whl || exit 2 ;;
        deps-*-part*)  # one part of the compiled packages (CuTe DSL, TileLang, z3): joined
                       # and unpacked once all are here
          deps="$STORE/${name%-part*}"
          mkdir -p "$deps/parts" "$deps/site"
          cp "$dir"/cute-dsl-libs.tar.xz.* "$dir/parts.json" "$deps/parts/" || exit 2
          $PYTHON -m tests.e2e.parts join "$deps/parts" "$deps/cute-dsl-libs.tar.xz"
          case $? in
            0) $PYTHON -m tests.e2e.archive extract "$deps/cute-dsl-libs.tar.xz" "$deps/site" \
                 && rm "$deps/cute-dsl-libs.tar.xz" || exit 2 ;;
            3) ;;
            *) exit 2 ;;
          esac ;;
        *) echo "run.sh: $dir is no carry of 'make e2e-pack'" >&2; exit 2 ;;
      esac
      case "$name" in deps-*) dest="$STORE/${name%-part*}" ;; esac
      echo "unpacked $name into $dest: $(du -sh "$dest" | cut -f1)"
    done
    exit 0 ;;
  serve|bench|backends) ;;
  *) echo "usage: run.sh unpack DIR... | run.sh serve release:layout:state... | run.sh bench [ARGS] | run.sh backends [ARGS]" >&2; exit 2 ;;
esac
[ -d "$STORE/common" ] || { echo "no $STORE/common: run 'run.sh unpack build/e2e/common' first" >&2; exit 2; }
# The sidecar runs from this checkout; its C lane (built into the carried mla-serve wheel by
# `make e2e-pack`) goes beside it, as the image installs it.
LANE=mla_serve/sidecar/passthrough/_lane.abi3.so
if [ -f "$STORE/common/site/$LANE" ]; then
  cp "$STORE/common/site/$LANE" "$LANE" || exit 2
else
  echo "run.sh: the carried mla-serve wheel has no C lane: the sidecar reads in Python" >&2
fi
RESULTS=build/e2e-results/run
[ "$verb" = serve ] || RESULTS=build/e2e-results/$verb
[ -n "${OUT:-}" ] && RESULTS="${TMPDIR:-/tmp}/mla-serve-e2e-$verb"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
export PYTHONPATH="$PWD:$STORE/common/site"
export PYTHONUNBUFFERED=1
ulimit -n "$(ulimit -Hn)" 2>/dev/null  # vLLM asks for more descriptors than the default
# The commands the image puts on PATH, for the image's own entrypoint.
BIN="$STORE/bin" && mkdir -p "$BIN"
printf '#!/bin/sh\nexec %s -m vllm.entrypoints.cli.main "$@"\n' "$PYTHON" > "$BIN/vllm"
printf '#!/bin/sh\nexec %s -m mla_serve.cli "$@"\n' "$PYTHON" > "$BIN/mla-serve"
chmod +x "$BIN/"*
export PATH="$BIN:$PATH"
# VLLM_DEBUG_WORKSPACE logs the locked workspace. FlashInfer (the image's, carried) compiles
# its kernels at first use with nvcc and ninja: its JIT writes them under the store, so each
# kernel is built once while the machine stays warm, for every stack (FlashInfer locks them).
export VLLM_DEBUG_WORKSPACE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export FLASHINFER_WORKSPACE_BASE="$STORE/flashinfer-jit" && mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ -z "${CUDA_HOME:-}" ]; then  # DeepGEMM compiles its kernels at run time with nvcc
  for dir in /usr/local/cuda /usr/local/cuda-*; do
    [ -x "$dir/bin/nvcc" ] && { export CUDA_HOME="$dir"; break; }
  done
fi
if [ "$verb" = bench ]; then
  [ -d "$STORE/envoy" ] || { echo "no $STORE/envoy: run 'run.sh unpack build/e2e/envoy' first" >&2; exit 2; }
  $PYTHON -m tests.e2e.bench --store "$STORE" --results "$RESULTS" "$@"
  status=$?
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/e2e-bench.tar.gz" -C "$RESULTS" . && cp "$RESULTS"/bench.json "$RESULTS"/bench.md "$OUT/" 2>/dev/null
  fi
  exit $status
fi
if [ "$verb" = backends ]; then
  $PYTHON -m tests.e2e.backends --store "$STORE" --results "$RESULTS" "$@"
  status=$?
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/e2e-backends.tar.gz" -C "$RESULTS" . && cp "$RESULTS"/backends.json "$RESULTS"/backends.md "$OUT/" 2>/dev/null
  fi
  exit $status
fi
$PYTHON -m tests.e2e.matrix --store "$STORE" --results "$RESULTS" ${MLA_SERVE_E2E_ARGS:-} "$@"
status=$?
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/e2e-results.tar.gz" -C "$RESULTS" . && cp "$RESULTS/matrix.json" "$OUT/" 2>/dev/null
fi
exit $status
