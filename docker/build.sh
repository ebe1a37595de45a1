#!/usr/bin/env bash
# Build the image from this checkout: `make image` runs it, and so does `make image-smoke`.
#
#   IMAGE          tag to build (default mla-serve:<mla-serve version>-vllm<VLLM_VERSION>)
#   VLLM_VERSION   vLLM release (default 0.33.0)
#   BASE_IMAGE     default vllm/vllm-openai:v<VLLM_VERSION>
#   VLLM_SOURCE    base (BASE_IMAGE ships vLLM) or index (install vLLM from the package index)
#   PYTHON         a Python that can import this checkout's `server` (default .venv/bin/python)
#   PLATFORM       linux/amd64 or linux/arm64 (GB200/GB300 Grace nodes): `docker build
#                  --platform`, and the default tag gets -amd64/-arm64; unset: the build
#                  host's architecture, untagged (an arm64 build on x86 needs binfmt/qemu)
#   DOCKER_BUILD_FLAGS  extra `docker build` flags (e.g. --network host, --target vllm)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_CERT, PIP_DEFAULT_TIMEOUT
#                  passed to the build's pip when set
#
# The build context is only what the image needs (pyproject.toml, README.md, server/,
# patches/, docker/; tracked or not ignored), streamed as a tar: never .cache/ or .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
BASE_IMAGE="${BASE_IMAGE:-vllm/vllm-openai:v${VLLM_VERSION}}"
VLLM_SOURCE="${VLLM_SOURCE:-base}"
PYTHON="${PYTHON:-.venv/bin/python}"

# The labels' facts, from the catalog the wheel will carry (fails on an unsupported release).
mapfile -t facts < <(PYTHONPATH="$PWD" "$PYTHON" docker/labels.py build-args "$VLLM_VERSION")
[ "${#facts[@]}" -eq 3 ] || { echo "docker/build.sh: cannot read the catalog" >&2; exit 2; }
version="$(printf '%s\n' "${facts[@]}" | sed -n 's/^MLA_SERVE_VERSION=//p')"
PLATFORM="${PLATFORM:-}"
suffix=""
case "$PLATFORM" in
    "") ;;
    linux/amd64 | linux/arm64) suffix="-${PLATFORM#linux/}" ;;
    *) echo "docker/build.sh: PLATFORM must be linux/amd64 or linux/arm64, not '$PLATFORM'" >&2; exit 2 ;;
esac
IMAGE="${IMAGE:-mla-serve:${version}-vllm${VLLM_VERSION}${suffix}}"

args=(
    --file docker/Dockerfile
    --tag "$IMAGE"
    --build-arg "VLLM_VERSION=${VLLM_VERSION}"
    --build-arg "BASE_IMAGE=${BASE_IMAGE}"
    --build-arg "VLLM_SOURCE=${VLLM_SOURCE}"
    --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
)
if [ -n "$PLATFORM" ]; then
    args+=(--platform "$PLATFORM")
fi
for fact in "${facts[@]}"; do
    args+=(--build-arg "$fact")
done
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CERT PIP_DEFAULT_TIMEOUT; do
    if [ -n "${!name:-}" ]; then
        args+=(--build-arg "${name}=${!name}")
    fi
done
# shellcheck disable=SC2206 # word splitting of the extra flags is intended
extra=(${DOCKER_BUILD_FLAGS:-})

echo "docker build: $IMAGE (vLLM ${VLLM_VERSION} from ${VLLM_SOURCE}, base ${BASE_IMAGE}${PLATFORM:+, $PLATFORM})"
git ls-files -z --cached --others --exclude-standard -- \
        pyproject.toml README.md server patches docker |
    while IFS= read -r -d '' path; do
        if [ -f "$path" ]; then printf '%s\0' "$path"; fi
    done |
    tar --null --files-from=- --create --file=- |
    docker build "${args[@]}" "${extra[@]}" -
