#!/bin/sh
# The image's entrypoint.
#   serve [vLLM args]    check the fix manifest, then `vllm serve` with the arguments the
#                        profile (Helm chart) renders, e.g. `serve MODEL --tensor-parallel-size 4`
#   sidecar [args]       `mla-serve sidecar`; manifest and state dir come from the
#                        image's MLA_SERVE_MANIFEST / MLA_SERVE_STATE_DIR
#   patches ...          `mla-serve patches ...` (list, status, verify)
#   anything else        run as given (`mla-serve ...`, `bash`, ...)
# MLA_SERVE_ALLOW_DRIFT=1 starts vLLM even when the patched files no longer match the
# manifest (the mismatch is still printed, and the plugin reports it to the sidecar).
# `serve` also refuses when a separately installed deep_gemm would shadow the DeepGEMM vLLM
# vendors (`mla-serve patches deep-gemm`); MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM=1 overrides.
set -eu

# Caches (Hugging Face, Triton, torch, vLLM) default to $HOME/.cache; an arbitrary UID
# that has no passwd entry gets HOME=/ which is not writable.
if [ -z "${HOME:-}" ] || [ ! -w "${HOME}" ]; then
    if [ -w /home/vllm ]; then
        HOME=/home/vllm
    else
        HOME="${TMPDIR:-/tmp}/mla-serve-home"
        mkdir -p "${HOME}"
    fi
    export HOME
fi
if [ ! -w . ]; then
    cd "${HOME}"
fi

command="${1:-serve}"
[ "$#" -eq 0 ] || shift

case "${command}" in
    serve)
        if ! mla-serve patches verify --manifest "${MLA_SERVE_MANIFEST}"; then
            if [ "${MLA_SERVE_ALLOW_DRIFT:-0}" != 1 ]; then
                echo "mla-serve: the patched vLLM does not match ${MLA_SERVE_MANIFEST};" \
                     "refusing to start (MLA_SERVE_ALLOW_DRIFT=1 overrides)" >&2
                exit 1
            fi
            echo "mla-serve: starting anyway (MLA_SERVE_ALLOW_DRIFT=1)" >&2
        fi
        if ! mla-serve patches deep-gemm; then
            if [ "${MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM:-0}" != 1 ]; then
                echo "mla-serve: refusing to start with another DeepGEMM than vLLM's own" \
                     "(MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM=1 overrides)" >&2
                exit 1
            fi
            echo "mla-serve: starting anyway (MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM=1)" >&2
        fi
        exec vllm serve "$@"
        ;;
    sidecar)
        exec mla-serve sidecar "$@"
        ;;
    patches)
        exec mla-serve patches "$@"
        ;;
    *)
        exec "${command}" "$@"
        ;;
esac
