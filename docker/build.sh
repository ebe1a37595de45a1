#!/usr/bin/env bash
# Build the image from this checkout: `make image` runs it, and so does `make image-smoke`.
#
#   IMAGE          tag to build (default mla-serve:<mla-serve version>-vllm<VLLM_VERSION>)
#   VLLM_VERSION   vLLM release (default: the catalog's, `default` in patches/catalog.toml)
#   BASE_IMAGE     default vllm/vllm-openai:v<VLLM_VERSION>; a tag or a digest (name@sha256:...).
#                  A tag is resolved to its digest (the local image's repository digest, else
#                  the registry's through `docker buildx imagetools`), and the build then uses
#                  name:tag@sha256:..., so the image is built on, and labelled with, exactly
#                  that base (org.opencontainers.image.base.name / base.digest).
#   BASE_DIGEST_LOOKUP  registry (default: local image, then registry), local (local image
#                  only), none (no lookup); a base that cannot be resolved is built by tag,
#                  with a warning, and base.digest is left empty.
#   VLLM_SOURCE    base (BASE_IMAGE ships vLLM) or index (install vLLM from the package index)
#   PYTHON         a Python that can import this checkout's `mla_serve` (default .venv/bin/python)
#   PLATFORM       linux/amd64 or linux/arm64 (GB200/GB300 Grace nodes): `docker build
#                  --platform`, and the default tag gets -amd64/-arm64; unset: the build
#                  host's architecture, untagged (an arm64 build on x86 needs binfmt/qemu)
#   DOCKER_BUILD_FLAGS  extra `docker build` flags (e.g. --network host, --target vllm)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_CERT, PIP_DEFAULT_TIMEOUT
#                  passed to the build's pip when set
#
# The build context is only what the image needs (pyproject.toml, README.md, mla_serve/,
# patches/, docker/; tracked or not ignored), streamed as a tar: never .cache/ or .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
VLLM_VERSION="${VLLM_VERSION:-$(PYTHONPATH="$PWD" "$PYTHON" -m mla_serve.patching.catalog default)}"
BASE_IMAGE="${BASE_IMAGE:-vllm/vllm-openai:v${VLLM_VERSION}}"
VLLM_SOURCE="${VLLM_SOURCE:-base}"

# `registry/name:tag` -> `registry/name`, library/ dropped as RepoDigests has it. A reference
# that spells out the default registry does not match its RepoDigests (which omit it): the
# registry lookup below answers for it instead.
repository_of() {
    local ref="${1%@*}" last
    last="${ref##*/}"
    if [[ "$last" == *:* ]]; then ref="${ref%:*}"; fi
    printf '%s\n' "${ref#library/}"
}

# The manifest digest of a tagged image, or nothing when it cannot be told.
resolve_digest() {
    local ref="$1" repo line lookup="${BASE_DIGEST_LOOKUP:-registry}"
    [ "$lookup" != none ] || return 0
    repo="$(repository_of "$ref")"
    while IFS= read -r line; do
        if [ -n "$line" ] && [ "$(repository_of "${line%@*}")" = "$repo" ]; then
            printf '%s\n' "${line##*@}"
            return 0
        fi
    done < <(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' \
                 "$ref" 2>/dev/null || true)
    if [ "$lookup" = registry ] && docker buildx version >/dev/null 2>&1; then
        timeout 60 docker buildx imagetools inspect --format '{{json .Manifest}}' "$ref" \
                2>/dev/null |
            grep -o '"digest": *"sha256:[0-9a-f]\{64\}"' | head -n 1 | grep -o 'sha256:[0-9a-f]*' ||
            true
    fi
}

# Bad input first, before any lookup.
PLATFORM="${PLATFORM:-}"
suffix=""
case "$PLATFORM" in
    "") ;;
    linux/amd64 | linux/arm64) suffix="-${PLATFORM#linux/}" ;;
    *) echo "docker/build.sh: PLATFORM must be linux/amd64 or linux/arm64, not '$PLATFORM'" >&2; exit 2 ;;
esac

# A foreign architecture's RUN steps need the engine's kernel to run its binaries: on a local
# engine that is qemu-user-static registered through binfmt_misc (docker/README.md). A remote
# engine or builder (DOCKER_HOST=tcp://..., a buildx node of that architecture) is not checked.
if [ -n "$PLATFORM" ] && [[ "${DOCKER_HOST:-unix://}" == unix://* ]]; then
    engine_arch="$(docker version --format '{{.Server.Arch}}' 2>/dev/null || true)"
    machine="${PLATFORM#linux/}"
    machine="${machine/arm64/aarch64}"
    machine="${machine/amd64/x86_64}"
    binfmt="${BINFMT_DIR:-/proc/sys/fs/binfmt_misc}"
    if [ -n "$engine_arch" ] && [ "$engine_arch" != "${PLATFORM#linux/}" ] &&
        ! grep -qsx enabled "$binfmt"/qemu-"$machine"*; then
        echo "docker/build.sh: the engine is $engine_arch and cannot run $PLATFORM binaries: no" \
             "binfmt_misc entry qemu-$machine (install qemu-user-static, or build on a $PLATFORM host)" >&2
        exit 2
    fi
fi

case "$BASE_IMAGE" in
    *@sha256:*) BASE_IMAGE_DIGEST="${BASE_IMAGE##*@}" ;;
    *@*) echo "docker/build.sh: BASE_IMAGE digest must be sha256: $BASE_IMAGE" >&2; exit 2 ;;
    *) BASE_IMAGE_DIGEST="$(resolve_digest "$BASE_IMAGE")" ;;
esac
if [[ -n "$BASE_IMAGE_DIGEST" && ! "$BASE_IMAGE_DIGEST" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "docker/build.sh: not a sha256 digest: $BASE_IMAGE_DIGEST" >&2
    exit 2
fi
if [ -z "$BASE_IMAGE_DIGEST" ]; then
    echo "docker/build.sh: warning: cannot resolve $BASE_IMAGE to a digest; building on" \
         "the tag, and the labels record no base digest" >&2
elif [[ "$BASE_IMAGE" != *@* ]]; then
    BASE_IMAGE="${BASE_IMAGE}@${BASE_IMAGE_DIGEST}"
fi

# VLLM_SOURCE=index installs from the release's hash lock; the labels record which lock.
VLLM_LOCK_SHA256=""
if [ "$VLLM_SOURCE" = index ]; then
    lock="docker/locks/vllm-${VLLM_VERSION}.txt"
    if [ ! -f "$lock" ]; then
        echo "docker/build.sh: no hash lock $lock: run docker/lock.sh ${VLLM_VERSION}" >&2
        exit 2
    fi
    VLLM_LOCK_SHA256="$(sha256sum "$lock" | cut -d' ' -f1)"
fi

# The labels' facts, from the catalog the wheel will carry (fails on an unsupported release).
mapfile -t facts < <(PYTHONPATH="$PWD" "$PYTHON" docker/labels.py build-args "$VLLM_VERSION")
[ "${#facts[@]}" -eq 3 ] || { echo "docker/build.sh: cannot read the catalog" >&2; exit 2; }
version="$(printf '%s\n' "${facts[@]}" | sed -n 's/^MLA_SERVE_VERSION=//p')"
IMAGE="${IMAGE:-mla-serve:${version}-vllm${VLLM_VERSION}${suffix}}"

args=(
    --file docker/Dockerfile
    --tag "$IMAGE"
    --build-arg "VLLM_VERSION=${VLLM_VERSION}"
    --build-arg "BASE_IMAGE=${BASE_IMAGE}"
    --build-arg "BASE_IMAGE_DIGEST=${BASE_IMAGE_DIGEST}"
    --build-arg "VLLM_LOCK_SHA256=${VLLM_LOCK_SHA256}"
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
        pyproject.toml README.md hatch_build.py mla_serve patches docker |
    while IFS= read -r -d '' path; do
        if [ -f "$path" ]; then printf '%s\0' "$path"; fi
    done |
    tar --null --files-from=- --create --file=- |
    docker build "${args[@]}" "${extra[@]}" -
