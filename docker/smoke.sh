#!/usr/bin/env bash
# `make image-smoke`: build the image without any container registry and check it.
#
#  1. Tools: Debian's docker.io and debootstrap (installed with apt-get when missing).
#  2. A Docker engine: the running one if `docker version` reaches it, else a private
#     dockerd that leaves the host network alone (--bridge=none --iptables=false
#     --ip6tables=false --ip-forward=false --ip-masq=false), state in .cache/docker/,
#     stopped again on exit. Builds use the legacy builder (DOCKER_BUILDKIT=0) and reach
#     PyPI and Debian through `--network host`; every check runs with `--network none`.
#  3. A base image from no registry: debootstrap a minimal Debian bookworm, trusting
#     what this host trusts (its extra CA certificates), then `docker load` of a one-layer
#     image archive labelled with its architecture (docker/rootfs_image.py).
#  4. docker/build.sh with VLLM_SOURCE=index: Python from apt, vllm==VLLM_VERSION from
#     the package index, then mla-serve's stages (wheel, patch layer, manifest, labels).
#  5. Inside the image: non-root user, `mla-serve patches verify`, `mla-serve sidecar
#     --help`, labels == manifest == catalog, vLLM imports and loads the plugin, `serve
#     --help`, and the HEALTHCHECK turns healthy on a running sidecar.
#  6. Sizes: the image, the vLLM it is built on, and the layers mla-serve adds (at most
#     MLA_SERVE_LAYER_LIMIT bytes, default 50 MB).
# PLATFORM=linux/arm64 builds and checks the arm64 image (GB200/GB300 Grace nodes) on an x86
# host under emulation: qemu-user-static registered through binfmt_misc (installed with
# apt-get and mounted when missing; the script stops with one line where the kernel or the
# container does not allow it). Expect it to take many times longer than a native run. Checks
# that import vLLM (torch) are bounded; under emulation one that times out or crashes is
# reported NOT CHECKED and the smoke exits 3 (torch cannot start under qemu-user here).
# Images stay in .cache/docker/ so a second run is fast; `rm -rf .cache/docker` reclaims
# the space (after the run: the private engine is stopped by then).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
VLLM_VERSION="${VLLM_VERSION:-$(PYTHONPATH="$PWD" "$PYTHON" -m mla_serve.patching.catalog default)}"
CACHE="${MLA_SERVE_CACHE:-$PWD/.cache}"
STATE="$CACHE/docker"
SUITE="${DEBIAN_SUITE:-bookworm}"
# The Debian mirror: DEBIAN_MIRROR, else the one this machine's apt uses for the suite's
# main component (deb822 .sources or one-line .list files); none found is an error.
apt_mirror() {
    local file
    local etc="${APT_ETC:-/etc/apt}"
    for file in "$etc"/sources.list.d/*.sources; do
        [ -f "$file" ] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*$/ { if (uris != "" && suites ~ "(^| )" suite "( |$)" && comps ~ /main/) { print uris; exit }
                               uris = suites = comps = "" ; next }
            tolower($1) == "uris:" { uris = $2 }
            tolower($1) == "suites:" { $1 = ""; suites = $0 " " }
            tolower($1) == "components:" { $1 = ""; comps = $0 }
            END { if (uris != "" && suites ~ "(^| )" suite "( |$)" && comps ~ /main/) print uris }
        ' "$file" | head -n 1
    done
    for file in "$etc"/sources.list "$etc"/sources.list.d/*.list; do
        [ -f "$file" ] || continue
        awk -v suite="$SUITE" '$1 == "deb" && $0 !~ /^#/ {
            i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
            if ($(i + 1) == suite) { print $i; exit } }' "$file"
    done
}
MIRROR="${DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}"
if [ -z "$MIRROR" ]; then
    echo "docker/smoke.sh: no Debian mirror for $SUITE in this machine's apt sources; set DEBIAN_MIRROR" >&2
    exit 2
fi
PLATFORM="${PLATFORM:-}"
arch=""
case "$PLATFORM" in
    "") ;;
    linux/amd64) arch=amd64 ;;
    linux/arm64) arch=arm64 ;;
    *) echo "docker/smoke.sh: PLATFORM must be linux/amd64 or linux/arm64, not '$PLATFORM'" >&2; exit 2 ;;
esac
image_arch="${arch:-$(dpkg --print-architecture)}"  # what every image here must be labelled
BASE="mla-serve-smoke/debian:${SUITE}${arch:+-$arch}"
VLLM_IMAGE="mla-serve-smoke:vllm${VLLM_VERSION}${arch:+-$arch}-base"
IMAGE="mla-serve-smoke:vllm${VLLM_VERSION}${arch:+-$arch}"
LIMIT="${MLA_SERVE_LAYER_LIMIT:-50000000}"
MANIFEST=/opt/mla-serve/manifest.json
export DOCKER_BUILDKIT=0

started=$SECONDS
step() { printf '\n== [%s, %ds] %s\n' "$1" "$((SECONDS - started))" "$2"; }
mb() { awk -v b="$1" 'BEGIN { if (b < 1000000) printf "%.1f kB", b / 1000; else printf "%.1f MB", b / 1000000 }'; }

mkdir -p "$STATE"
exec 9>"$STATE/smoke.lock"
flock 9  # one smoke run at a time: they share the engine and its state

step 1/6 "tools"
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]} (apt-get)"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
docker --version
host_arch="$(dpkg --print-architecture)"
if [ -n "$arch" ] && [ "$arch" != "$host_arch" ]; then
    # Foreign architecture: its binaries run through qemu-user-static via binfmt_misc.
    command -v qemu-aarch64-static >/dev/null || {
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static binfmt-support
    }
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || {
            echo "docker/smoke.sh: binfmt_misc cannot be mounted here; $PLATFORM needs a host that can run its binaries" >&2
            exit 2
        }
    fi
    update-binfmts --enable "qemu-${arch/arm64/aarch64}" >/dev/null 2>&1 || true
    [ -e "/proc/sys/fs/binfmt_misc/qemu-${arch/arm64/aarch64}" ] || {
        echo "docker/smoke.sh: no binfmt_misc entry for qemu-${arch/arm64/aarch64}; $PLATFORM cannot be emulated here" >&2
        exit 2
    }
    echo "emulating $PLATFORM with $(qemu-aarch64-static --version | head -1)"
fi

step 2/6 "Docker engine"
dockerd_pid=""
cleanup() {
    if [ -n "$dockerd_pid" ]; then
        echo "stopping the private dockerd (pid $dockerd_pid)"
        kill "$dockerd_pid" 2>/dev/null || true
        wait "$dockerd_pid" 2>/dev/null || true
        # what a stopped dockerd leaves in its exec-root: the default netns mount
        umount /run/mla-serve-docker/netns/default 2>/dev/null || true
        rm -rf /run/mla-serve-docker
    fi
}
trap cleanup EXIT
if docker version >/dev/null 2>&1; then
    echo "using the running engine (${DOCKER_HOST:-default socket})"
else
    socket=/run/mla-serve-docker.sock
    mkdir -p "$STATE/data"
    dockerd --data-root "$STATE/data" --exec-root /run/mla-serve-docker \
        --pidfile /run/mla-serve-docker.pid --host "unix://$socket" \
        --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
        >"$STATE/dockerd.log" 2>&1 &
    dockerd_pid=$!
    export DOCKER_HOST="unix://$socket"
    for _ in $(seq 60); do
        docker version >/dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 "$STATE/dockerd.log"; exit 1; }
        sleep 1
    done
    docker version --format 'started dockerd {{.Server.Version}} (pid '"$dockerd_pid"'), state in '"$STATE"
fi

step 3/6 "base image $BASE (debootstrap + docker load)"
# A base from an earlier run is reused when it is labelled with the architecture asked for
# (`docker import --platform` left arm64 bases labelled amd64 on Docker 20.10).
base_arch="$(docker image inspect -f '{{.Architecture}}' "$BASE" 2>/dev/null || true)"
if [ "$base_arch" = "$image_arch" ]; then
    echo "already built ($base_arch)"
else
    [ -z "$base_arch" ] || echo "rebuilding: $BASE is labelled $base_arch, not $image_arch"
    rootfs="$CACHE/image/rootfs-$SUITE-$image_arch"
    rm -rf "$rootfs"
    mkdir -p "$(dirname "$rootfs")"
    echo "debootstrap --variant=minbase $SUITE ($MIRROR), log in $STATE/debootstrap.log"
    debootstrap --variant=minbase --include=ca-certificates ${arch:+--arch="$arch"} \
        "$SUITE" "$rootfs" "$MIRROR" \
        >"$STATE/debootstrap.log" 2>&1 || { tail -20 "$STATE/debootstrap.log"; exit 1; }
    tail -1 "$STATE/debootstrap.log"
    # Trust what this host trusts: a build behind a TLS-inspecting proxy needs its CA.
    python3 - "$rootfs" <<'EOF'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
pem = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
def certs(path):
    return pem.findall(path.read_text()) if path.is_file() else []
have = set(certs(root / "etc/ssl/certs/ca-certificates.crt"))
extra = [c for c in certs(pathlib.Path("/etc/ssl/certs/ca-certificates.crt")) if c not in have]
folder = root / "usr/local/share/ca-certificates"
folder.mkdir(parents=True, exist_ok=True)
for index, cert in enumerate(extra):
    (folder / f"build-host-{index}.crt").write_text(cert + "\n")
print(f"{len(extra)} CA certificate(s) of this host added")
EOF
    chroot "$rootfs" update-ca-certificates >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    # One layer, and an image configuration that names its architecture (docker/rootfs_image.py).
    tar --numeric-owner -C "$rootfs" -cf "$rootfs.tar" .
    rm -rf "$rootfs"
    python3 docker/rootfs_image.py --layer "$rootfs.tar" --arch "$image_arch" --tag "$BASE" \
        --comment "debootstrap $SUITE minbase" | docker load
    rm -f "$rootfs.tar"
fi
echo "$BASE: $(mb "$(docker image inspect -f '{{.Size}}' "$BASE")")"

step 4/6 "build: vLLM $VLLM_VERSION from the package index, then mla-serve"
# The base was imported here (no registry has it): no digest to look up.
export VLLM_VERSION PYTHON BASE_IMAGE="$BASE" VLLM_SOURCE=index BASE_DIGEST_LOOKUP=local
export PIP_CERT=/etc/ssl/certs/ca-certificates.crt  # the image's bundle, host CAs included
export PLATFORM
IMAGE="$IMAGE" DOCKER_BUILD_FLAGS="--network host" docker/build.sh
# The stage the image is built on, tagged from the same build cache (nothing rebuilds):
# everything above it in `docker history` is mla-serve's.
IMAGE="$VLLM_IMAGE" DOCKER_BUILD_FLAGS="--network host --target vllm" docker/build.sh |
    grep -E '^(docker build|Successfully)'

step 5/6 "inside $IMAGE (--network none)"
run() { docker run --rm --network none "$@"; }
label() { docker image inspect -f "{{ index .Config.Labels \"$1\" }}" "$IMAGE"; }
user="$(run "$IMAGE" id -u):$(run "$IMAGE" id -g)"
[ "$user" = 2000:0 ] || { echo "runs as $user, not 2000:0" >&2; exit 1; }
echo "user: $user ($(run "$IMAGE" id -un))"

echo "-- architecture: the image's label, the kernel it sees, vLLM's compiled code"
labelled="$(docker image inspect -f '{{.Architecture}}' "$IMAGE")"
machine="$(run "$IMAGE" uname -m)"
# e_machine of vLLM's extension module (ELF header offset 18): 62 x86-64, 183 AArch64.
elf="$(run "$IMAGE" python3 -c '
import importlib.util as u, pathlib, struct
folder = pathlib.Path(u.find_spec("vllm").origin).parent
so = sorted(folder.glob("_C*.so"))[0]
head = so.open("rb").read(20)
assert head[:4] == b"\x7fELF", so
print(so.name, {62: "x86_64", 183: "aarch64"}.get(struct.unpack_from("<H", head, 18)[0], "other"))
')"
expected_machine="$([ "$image_arch" = arm64 ] && echo aarch64 || echo x86_64)"
echo "label $labelled, uname -m $machine, vllm/$elf"
if [ "$labelled" != "$image_arch" ] || [ "$machine" != "$expected_machine" ] ||
    [ "${elf##* }" != "$expected_machine" ]; then
    echo "the image is not $image_arch ($expected_machine) throughout" >&2
    exit 1
fi

echo "-- mla-serve patches verify --manifest $MANIFEST"
run "$IMAGE" mla-serve patches verify --manifest "$MANIFEST"
echo "-- patches verify (the default manifest path links to $MANIFEST)"
run "$IMAGE" patches verify
echo "-- mla-serve patches deep-gemm (vLLM's vendored DeepGEMM is the one it loads)"
run "$IMAGE" mla-serve patches deep-gemm
echo "-- mla-serve sidecar --help"
run "$IMAGE" mla-serve sidecar --help >"$STATE/sidecar-help.txt"
head -2 "$STATE/sidecar-help.txt"
echo "  ... ($(wc -l <"$STATE/sidecar-help.txt") lines; in $STATE/sidecar-help.txt)"

echo "-- labels"
docker image inspect -f '{{ range $k, $v := .Config.Labels }}{{ $k }}={{ $v }}{{ "\n" }}{{ end }}' "$IMAGE" |
    grep -E '^(org.opencontainers|io.mla-serve)'
expected="$(PYTHONPATH="$PWD" "$PYTHON" docker/labels.py build-args "$VLLM_VERSION" | sed -n 's/^FIXES=//p')"
[ "$(label io.mla-serve.fixes)" = "$expected" ] || {
    echo "label io.mla-serve.fixes differs from the catalog: $expected" >&2
    exit 1
}
echo "-- the manifest inside the image (checked against the labels and the catalog)"
run "$IMAGE" python3 /opt/mla-serve/labels.py check --manifest "$MANIFEST" \
    --vllm-version "$VLLM_VERSION" --series-digest "$(label io.mla-serve.series.digest)" \
    --fixes "$(label io.mla-serve.fixes)"

# The checks that import vLLM (and torch) are bounded: CHECK_TIMEOUT seconds each, timed on
# this host (coreutils' `timeout` inside an emulated container can miss its child's end under
# qemu-user). Natively a timeout or a crash fails the smoke; under emulation it is reported as
# NOT CHECKED (exit 3 at the end): torch's aarch64 build cannot start under qemu-user 7.2 on an
# x86 kernel (oneDNN reads MIDR_EL1 from sysfs, which is not there, and crashes; docker/README.md).
unchecked=()
bounded() {  # NAME OUTPUT_FILE IMAGE ARGS...: 0 passed, 1 failed, 2 not checked (emulation)
    local name="$1" out="$2" code=0 container="mla-serve-smoke-check-$$"
    shift 2
    timeout "$CHECK_TIMEOUT" docker run --rm --name "$container" --network none "$@" \
        >"$out" 2>&1 || code=$?
    docker rm -f "$container" >/dev/null 2>&1 || true
    if [ "$code" = 124 ] || [ "$code" -gt 128 ]; then
        local what="crashed (exit $code)"
        [ "$code" != 124 ] || what="did not finish in ${CHECK_TIMEOUT}s"
        if [ -n "$emulated" ]; then
            echo "NOT CHECKED: $name $what under qemu (output: $out)"
            unchecked+=("$name")
            return 2
        fi
        echo "$name $what" >&2
        return 1
    fi
    [ "$code" = 0 ] || return 1
}
emulated=""
[ -z "$arch" ] || [ "$arch" = "$host_arch" ] || emulated=1
CHECK_TIMEOUT="${MLA_SERVE_SMOKE_CHECK_TIMEOUT:-$([ -n "$emulated" ] && echo 1200 || echo 300)}"

echo "-- vLLM finds mla-serve's engine plugin and runs it (at most ${CHECK_TIMEOUT}s)"
code=0
bounded "importing vLLM and loading its plugins" "$STATE/plugin.txt" \
    "$IMAGE" python3 -c '
import vllm
from vllm.plugins import load_general_plugins, load_plugins_by_group
found = sorted(load_plugins_by_group("vllm.general_plugins"))
assert "mla_serve" in found, found
load_general_plugins()
import vllm.v1.worker.gpu_worker as worker
assert getattr(worker.Worker.compile_or_warm_up_model, "__mla_serve_wrapped__", False)
print("vLLM", vllm.__version__, "general plugins:", ", ".join(found), "- mla_serve hooked the worker")
' || code=$?
if [ "$code" = 0 ]; then
    grep -E '^vLLM ' "$STATE/plugin.txt"
elif [ "$code" = 1 ]; then
    tail -20 "$STATE/plugin.txt"
    exit 1
fi
echo "-- serve: manifest check, then vllm serve (at most ${CHECK_TIMEOUT}s)"
code=0
bounded "serve --help" "$STATE/serve.txt" \
    "$IMAGE" serve --help || code=$?
if [ "$code" = 0 ]; then
    echo "vllm serve --help: $(grep -m1 -i usage "$STATE/serve.txt")"
elif [ "$code" = 2 ]; then
    :
elif grep -q "Failed to infer device type" "$STATE/serve.txt"; then
    echo "vllm serve reached (without a GPU it stops at device detection, as expected here)"
else
    tail -20 "$STATE/serve.txt"
    exit 1
fi
grep "matches $MANIFEST" "$STATE/serve.txt"

echo "-- HEALTHCHECK on a running sidecar"
cid="$(docker run -d --network none --health-interval 2s "$IMAGE" sidecar)"
health=starting
tries=60  # seconds, about; under emulation Python starts many times slower
[ -z "$emulated" ] || tries=300
for _ in $(seq "$tries"); do
    health="$(docker inspect -f '{{.State.Health.Status}}' "$cid")"
    [ "$health" = starting ] || break
    sleep 1
done
docker inspect -f '{{ range .State.Health.Log }}{{ .Output }}{{ end }}' "$cid" | tail -2
if [ "$health" != healthy ]; then
    docker logs "$cid" 2>&1 | tail -20
    docker rm -f "$cid" >/dev/null
    echo "sidecar container is $health, not healthy" >&2
    exit 1
fi
docker rm -f "$cid" >/dev/null
echo "sidecar: $health"

step 6/6 "sizes"
size="$(docker image inspect -f '{{.Size}}' "$IMAGE")"
base_size="$(docker image inspect -f '{{.Size}}' "$BASE")"
vllm_size="$(docker image inspect -f '{{.Size}}' "$VLLM_IMAGE")"
vllm_id="$(docker image inspect -f '{{.Id}}' "$VLLM_IMAGE")"
echo "layers mla-serve adds on top of vLLM (docker history):"
added=0
reached=0
while IFS=$'\t' read -r id bytes created; do
    if [ "$id" = "$vllm_id" ]; then
        reached=1
        break
    fi
    added=$((added + bytes))
    if [ "$bytes" -gt 0 ]; then
        created="${created#*pipefail -c }"  # drop the build args and the shell
        created="${created#\#(nop) }"
        printf '  %10s  %s\n' "$(mb "$bytes")" "${created:0:100}"
    fi
done < <(docker history --no-trunc --human=false --format '{{.ID}}\t{{.Size}}\t{{.CreatedBy}}' "$IMAGE")
[ "$reached" = 1 ] || { echo "$VLLM_IMAGE is not in the history of $IMAGE" >&2; exit 1; }
echo "image $IMAGE: $(mb "$size")"
echo "  base $BASE: $(mb "$base_size")"
echo "  vLLM $VLLM_VERSION with Python and its dependencies: $(mb "$((vllm_size - base_size))")"
echo "  mla-serve's layers: $(mb "$added") (limit $(mb "$LIMIT"))"
if [ "$added" -gt "$LIMIT" ]; then
    echo "mla-serve's layers exceed the limit" >&2
    exit 1
fi
echo
if [ "${#unchecked[@]}" -gt 0 ]; then
    echo "image-smoke: every check that ran passed for vLLM $VLLM_VERSION in $((SECONDS - started)) s:" \
         "$IMAGE; NOT CHECKED under emulation: ${unchecked[*]}"
    exit 3
fi
echo "image-smoke passed for vLLM $VLLM_VERSION in $((SECONDS - started)) s: $IMAGE"
