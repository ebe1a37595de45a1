#!/usr/bin/env bash
# `make gpu-test`, on the GPU machine (no network): unpack the trees that
# `make gpu-pack` made, patch copies with mla-serve itself, run the GPU suite and
# upstream's own CUDA tests for the fixes and the GPU benchmarks on every tree, and write
# the results (JUnit XML, upstream verdicts and bench JSON per tree, one summary JSON) to
# $OUT or build/gpu-results/ (the runs of record are in results/gpu/). The scripts run as
# modules of the package `tests` (`python -m tests.…`) from the repository root, this
# script's working directory.
set -uo pipefail
cd "$(dirname "$0")/../.."
PACK=${1:-build/gpu-pack}
RESULTS=${OUT:-build/gpu-results}
WORK=${TMPDIR:-/tmp}/mla-serve-gpu
PYTHON=${PYTHON:-python3}
[ -d "$PACK/trees" ] || { echo "no pack at $PACK: run 'make gpu-pack' first" >&2; exit 2; }
rm -rf "$WORK" && mkdir -p "$WORK/site" "$RESULTS/runs"
$PYTHON -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$PACK"/wheels/*.whl || exit 2
export PYTHONPATH="$WORK/site" PYTHONUNBUFFERED=1
status=0
for archive in "$PACK"/trees/vllm-*.tar.xz; do
  release=$(basename "$archive" .tar.xz); release=${release#vllm-}
  mkdir -p "$WORK/$release/pristine" && tar -xJf "$archive" -C "$WORK/$release/pristine"
  states=(pristine)
  # A patched copy where mla-serve carries backports for the release (patches/catalog.toml:
  # the series is the release's backport files; there are no series files any more).
  $PYTHON -m tests.gpu.series "$release"; carried=$?
  [ "$carried" -le 1 ] || exit 2  # a tree of a release the catalog does not know
  if [ "$carried" -eq 0 ]; then
    cp -al "$WORK/$release/pristine" "$WORK/$release/patched"  # the engine replaces files
    $PYTHON -m mla_serve.cli patches apply --target "$WORK/$release/patched" || exit 1
    states+=(patched)
  fi
  for state in "${states[@]}"; do
    echo "== vLLM $release $state"
    $PYTHON -m pytest -q -rs -p no:cacheprovider tests/gpu \
      --vllm-tree "$WORK/$release/$state" --vllm-state "$state" \
      --junitxml "$RESULTS/runs/junit-$release-$state.xml" || status=1
    # upstream's own CUDA tests for the fixes (catalog [fix.upstream_tests] gpu), unchanged
    HF_HUB_OFFLINE=1 MLA_SERVE_CACHE="$PACK" $PYTHON -m tests.upstream gpu --tree "$WORK/$release/$state" \
      --release "$release" --state "$state" \
      --out "$RESULTS/runs/upstream-$release-$state.json" || status=1
    $PYTHON -m tests.gpu.bench_gpu --release "$release" --state "$state" \
      --vllm-tree "$WORK/$release/$state" \
      --out "$RESULTS/runs/bench-$release-$state.json" || status=1
  done
done
$PYTHON -m tests.gpu.report "$RESULTS" || status=1
exit $status
