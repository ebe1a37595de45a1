#!/usr/bin/env bash
# `make e2e`, on the GPU machine (no network), in two steps, each one carry of 64 MiB:
#   run.sh deps [build/e2e-deps]                   unpack the CuTe DSL's compiled part
#   run.sh [build/e2e-pack] [vllm serve flags...]  the rest, then the tests
# The second step unpacks what `make e2e-pack` made, installs the wheels beside the
# machine's torch, records the fix manifest with mla-serve itself (`patches apply`, as
# the image build does), starts the sidecar and vLLM (tests/e2e/stack.py), runs
# tests/e2e against them, and writes the results (summary.json, junit.xml, logs,
# /status) to $OUT or tests/e2e/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEPS=${TMPDIR:-/tmp}/mla-serve-e2e-deps  # outlives the main step's work directory
if [ "${1:-}" = deps ]; then
  rm -rf "$DEPS" && mkdir -p "$DEPS/site"
  tar -xJf "${2:-build/e2e-deps}/cute-dsl-libs.tar.xz" -C "$DEPS/site" || exit 2
  echo "unpacked into $DEPS/site: $(du -sh "$DEPS/site" | cut -f1)"
  exit 0
fi
PACK=${1:-build/e2e-pack}
[ "$#" -eq 0 ] || shift  # the rest: more `vllm serve` flags
RESULTS=${OUT:-tests/e2e/results}
WORK=${TMPDIR:-/tmp}/mla-serve-e2e
PYTHON=${PYTHON:-python3}
[ -f "$PACK/vllm.tar.xz" ] || { echo "no pack at $PACK: run 'make e2e-pack' first" >&2; exit 2; }
rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/vllm" "$WORK/bin" "$RESULTS"
echo "== install: $(ls "$PACK"/wheels/*.whl | wc -l) wheels, vLLM tree"
$PYTHON -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$PACK"/wheels/*.whl || exit 2
tar -xJf "$PACK/vllm.tar.xz" -C "$WORK/vllm" || exit 2
[ -d "$DEPS/site" ] || echo "warning: no $DEPS/site: run 'run.sh deps' first" >&2
mkdir -p "$DEPS/site" && tar -xJf "$PACK/cute-dsl.tar.xz" -C "$DEPS/site" || exit 2
# The CuTe DSL's wheel puts its packages on sys.path with a .pth file, which only site
# directories read: name that path here.
export PYTHONPATH="$PWD:$WORK/vllm:$WORK/site:$DEPS/site:$DEPS/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1 MLA_SERVE_E2E_RESULTS="$RESULTS"
# The commands the image puts on PATH, for the image's own entrypoint.
printf '#!/bin/sh\nexec %s -m vllm.entrypoints.cli.main "$@"\n' "$PYTHON" > "$WORK/bin/vllm"
printf '#!/bin/sh\nexec %s -m server.cli "$@"\n' "$PYTHON" > "$WORK/bin/mla-serve"
chmod +x "$WORK/bin/"*
export PATH="$WORK/bin:$PATH"
# Caches a fresh machine starts without; VLLM_DEBUG_WORKSPACE logs the locked workspace;
# FlashInfer (a vLLM image has it) is not carried, so sampling takes vLLM's own top-k/top-p.
export HOME="$WORK/home" VLLM_DEBUG_WORKSPACE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$HOME"
# DeepGEMM compiles its kernels at run time with the machine's nvcc.
if [ -z "${CUDA_HOME:-}" ]; then
  for dir in /usr/local/cuda /usr/local/cuda-*; do
    [ -x "$dir/bin/nvcc" ] && { export CUDA_HOME="$dir"; break; }
  done
fi
echo "== extension modules under torch $($PYTHON -c 'import torch; print(torch.__version__)'), CUDA_HOME=${CUDA_HOME:-unset}"
$PYTHON - <<'PY'
import importlib
for name in ("vllm._C_stable_libtorch", "vllm._flashmla_C", "vllm._flashmla_extension_C",
             "vllm.vllm_flash_attn._vllm_fa3_C", "vllm.third_party.deep_gemm", "cutlass.cute"):
    try:
        importlib.import_module(name)
        print(f"  {name}: loads")
    except Exception as error:  # reported; vLLM's own start shows what it costs
        print(f"  {name}: {type(error).__name__}: {error}")
PY
echo "== patches apply (vLLM $(tar -xJOf "$PACK/vllm.tar.xz" --wildcards 'vllm-*.dist-info/METADATA' | sed -n 's/^Version: //p'))"
mla-serve patches apply --target "$WORK/vllm" || exit 1
echo "== stack and tests"
$PYTHON tests/e2e/stack.py --vllm-tree "$WORK/vllm" --model "$PACK/model" --work "$WORK" \
  --results "$RESULTS" -- "$@"
status=$?
$PYTHON tests/e2e/report.py --work "$WORK" --pack "$PACK" --results "$RESULTS" || status=1
exit $status
