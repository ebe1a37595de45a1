#!/usr/bin/env bash
# `make e2e`, on the GPU machine (no network): unpack what `make e2e-pack` made,
# install the wheels beside the machine's torch, record the fix manifest with
# mla-serve itself (`patches apply`, as the image build does), start the sidecar
# and vLLM (tests/e2e/stack.py), run tests/e2e against them, and write the
# results (summary.json, junit.xml, logs, /status) to $OUT or tests/e2e/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
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
export PYTHONPATH="$PWD:$WORK/vllm:$WORK/site" PYTHONUNBUFFERED=1 MLA_SERVE_E2E_RESULTS="$RESULTS"
# The commands the image puts on PATH, for the image's own entrypoint.
printf '#!/bin/sh\nexec %s -m vllm.entrypoints.cli.main "$@"\n' "$PYTHON" > "$WORK/bin/vllm"
printf '#!/bin/sh\nexec %s -m server.cli "$@"\n' "$PYTHON" > "$WORK/bin/mla-serve"
chmod +x "$WORK/bin/"*
export PATH="$WORK/bin:$PATH"
# Caches a fresh machine starts without; VLLM_DEBUG_WORKSPACE logs the locked workspace.
export HOME="$WORK/home" VLLM_DEBUG_WORKSPACE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
mkdir -p "$HOME"
echo "== patches apply (vLLM $(tar -xJOf "$PACK/vllm.tar.xz" --wildcards 'vllm-*.dist-info/METADATA' | sed -n 's/^Version: //p'))"
mla-serve patches apply --target "$WORK/vllm" || exit 1
echo "== stack and tests"
$PYTHON tests/e2e/stack.py --vllm-tree "$WORK/vllm" --model "$PACK/model" --work "$WORK" \
  --results "$RESULTS" -- "$@"
status=$?
$PYTHON tests/e2e/report.py --work "$WORK" --pack "$PACK" --results "$RESULTS" || status=1
exit $status
