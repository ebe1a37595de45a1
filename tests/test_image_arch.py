"""The image per architecture (GB200/GB300 Grace nodes are arm64), checked without an engine.

`make image-smoke PLATFORM=linux/arm64` builds and checks the arm64 image for real
(docker/README.md); these tests check the pieces it relies on: the base image archive that
names its architecture (docker/rootfs_image.py), the Makefile's one build per platform, and
build.sh's refusal of a foreign platform that the local engine cannot run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"


def _layer(tmp_path: Path) -> Path:
    """A small root file system as a tar, as smoke.sh makes it from debootstrap's tree."""
    tree = tmp_path / "rootfs"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "os-release").write_text('ID=debian\nVERSION_CODENAME="bookworm"\n')
    (tree / "bin").mkdir()
    (tree / "bin" / "true").write_bytes(b"\x7fELF" + bytes(60))
    layer = tmp_path / "rootfs.tar"
    subprocess.run(["tar", "--numeric-owner", "-C", str(tree), "-cf", str(layer), "."], check=True)
    return layer


def _archive(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, str(DOCKER / "rootfs_image.py"), *args],
        capture_output=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("arch", "variant"), [("arm64", "v8"), ("amd64", None)])
def test_the_base_archive_names_its_architecture(
    tmp_path: Path, arch: str, variant: str | None
) -> None:
    """`docker load` keeps an archive's configuration: the architecture is the one asked for,
    not the engine's (which is what `docker import --platform` gave on Docker 20.10)."""
    layer = _layer(tmp_path)
    done = _archive(tmp_path, "--layer", str(layer), "--arch", arch, "--tag", "smoke/debian:t")
    assert done.returncode == 0, done.stderr
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert len(manifest) == 1 and manifest[0]["RepoTags"] == ["smoke/debian:t"]
        config_blob = archive.extractfile(manifest[0]["Config"]).read()  # type: ignore[union-attr]
        layer_blob = archive.extractfile(manifest[0]["Layers"][0]).read()  # type: ignore[union-attr]
    config = json.loads(config_blob)
    assert config["architecture"] == arch and config["os"] == "linux"
    assert config.get("variant") == variant
    # The engine checks these two: the image ID is the configuration's digest, and the layer's
    # diff ID is the digest of the uncompressed layer it loads.
    assert manifest[0]["Config"] == hashlib.sha256(config_blob).hexdigest() + ".json"
    assert layer_blob == layer.read_bytes()
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": ["sha256:" + hashlib.sha256(layer_blob).hexdigest()],
    }
    assert config["config"]["Cmd"] == ["/bin/bash"]
    assert f"({arch})" in done.stderr.decode()


def test_the_base_archive_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    layer = _layer(tmp_path)
    for args, message in (
        (["--layer", str(layer), "--arch", "s390x", "--tag", "t:1"], "must be amd64 or arm64"),
        (["--layer", str(tmp_path / "none.tar"), "--arch", "arm64", "--tag", "t:1"], "no layer"),
    ):
        done = _archive(tmp_path, *args)
        err = done.stderr.decode()
        assert done.returncode == 2 and done.stdout == b"", err
        assert err.count("\n") == 1 and message in err


_SHOW = """sh -c 'echo "%s"'"""  # in place of build.sh: what it would be run with


def _make_n(*args: str) -> str:
    """`make -n` as from a shell, also when pytest itself runs under make (`make test`)."""
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MAKELEVEL", "MFLAGS"}}
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_make_image_builds_one_image_per_platform() -> None:
    """`make image` (dry run) runs build.sh once for linux/amd64 and once for linux/arm64, each
    tagged with its architecture; PLATFORMS= builds the host's only, untagged."""
    script = _make_n("image", "IMAGE=reg/mla-serve:1")
    traced = subprocess.run(
        ["bash", "-c", script.replace("docker/build.sh", _SHOW % "$PLATFORM $IMAGE")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert traced.stdout.splitlines() == [
        "linux/amd64 reg/mla-serve:1-amd64",
        "linux/arm64 reg/mla-serve:1-arm64",
    ]
    script = _make_n("image", "PLATFORMS=")
    traced = subprocess.run(
        ["bash", "-c", script.replace("docker/build.sh", _SHOW % "[$PLATFORM] [$IMAGE]")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert traced.stdout.splitlines() == ["[] []"]


def _image_tags(make_args: list[str]) -> list[str]:
    """The tags `make image ARGS` builds (build.sh's IMAGE, one per platform)."""
    script = _make_n("image", *make_args)
    traced = subprocess.run(
        ["bash", "-c", script.replace("docker/build.sh", _SHOW % "$IMAGE")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return traced.stdout.splitlines()


_SHELL_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*)=")


def _shell_value(line: str, name: str) -> str:
    """What `line` (an assignment in a README's example) sets `name` to, run from the root."""
    done = subprocess.run(
        ["bash", "-c", f'{line}\nprintf %s "${name}"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout, f"{line}: sets {name} to nothing"
    return done.stdout


@pytest.mark.parametrize("readme", ["README.md", "docker/README.md"])
def test_the_readmes_push_only_tags_make_image_builds(readme: str) -> None:
    """Every `docker push TAG` and `make image-manifest IMAGE=T` in the README's examples pushes
    what the `make image` before it in the same block really tagged (its dry run): `make
    image` tags `<tag>-amd64` and `<tag>-arm64`, never `<tag>` itself."""
    text = (ROOT / readme).read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)
    pushes = 0
    shell: dict[str, str] = {}  # variables the examples set (TAG=…), as a reader's shell keeps them
    for block in blocks:
        built: set[str] = set()
        for line in block.replace("\\\n", " ").splitlines():
            if assigned := _ASSIGNMENT.match(line):
                shell[assigned[1]] = _shell_value(line, assigned[1])
                continue
            line = _SHELL_VAR.sub(lambda m: shell.get(m[1] or m[2], m[0]), line)
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["make", "image"]:  # without IMAGE=: build.sh's local default tag
                built.update(tag for tag in _image_tags(argv[2:]) if tag)
            elif argv[:2] == ["make", "image-manifest"]:
                script = _make_n(*argv[1:])
                pushed = re.findall(r"^docker push '([^']+)'$", script, re.M)
                assert len(pushed) == 2, script
                missing = set(pushed) - built
                assert not missing, f"{readme}: {line}: pushes {missing}, built {built or 'none'}"
                pushes += 1
            elif argv[:2] == ["docker", "push"]:
                assert argv[2] in built, f"{readme}: {line}: built only {built or 'nothing'}"
                pushes += 1
    assert pushes, f"{readme} shows no push"


def _build_sh(tmp_path: Path, binfmt: Path, platform: str, engine: str) -> tuple[int, str, str]:
    """docker/build.sh with a `docker` that names its engine's architecture and logs builds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  version) echo "$STUB_ENGINE_ARCH" ;;\n'
        '  build) printf "%s\\n" "$@" >> "$STUB_LOG"; cat > /dev/null ;;\n'
        "  *) exit 1 ;;\n"
        "esac\n"
    )
    (bin_dir / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    log.write_text("")
    done = subprocess.run(
        ["bash", str(DOCKER / "build.sh")],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PYTHON": sys.executable,
            "BASE_IMAGE": "vllm/vllm-openai:v0.33.0",
            "BASE_DIGEST_LOOKUP": "none",
            "PLATFORM": platform,
            "BINFMT_DIR": str(binfmt),
            "STUB_ENGINE_ARCH": engine,
            "STUB_LOG": str(log),
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, log.read_text(), done.stderr


def test_a_foreign_platform_needs_emulation_on_the_local_engine(tmp_path: Path) -> None:
    """An arm64 build on an amd64 engine without qemu's binfmt_misc entry would fail at its
    first RUN step ("exec format error") after the base is fetched: build.sh says so first."""
    binfmt = tmp_path / "binfmt_misc"
    binfmt.mkdir()
    code, log, err = _build_sh(tmp_path, binfmt, "linux/arm64", engine="amd64")
    assert code == 2 and log == "", err
    assert err.count("\n") == 1 and "no binfmt_misc entry qemu-aarch64" in err
    (binfmt / "qemu-aarch64").write_text("disabled\ninterpreter /usr/bin/qemu-aarch64-static\n")
    code, log, err = _build_sh(tmp_path, binfmt, "linux/arm64", engine="amd64")
    assert code == 2 and log == "", err
    (binfmt / "qemu-aarch64").write_text("enabled\ninterpreter /usr/bin/qemu-aarch64-static\n")
    code, log, err = _build_sh(tmp_path, binfmt, "linux/arm64", engine="amd64")
    assert code == 0, err
    args = log.splitlines()
    assert args[args.index("--platform") + 1] == "linux/arm64"
    # The engine's own architecture, or an arm64 engine (a Grace build host): no emulation.
    (binfmt / "qemu-aarch64").unlink()
    for platform, engine in (("linux/amd64", "amd64"), ("linux/arm64", "arm64")):
        code, log, err = _build_sh(tmp_path, binfmt, platform, engine=engine)
        assert code == 0 and f"--platform\n{platform}\n" in log, err
    code, log, err = _build_sh(tmp_path, binfmt, "linux/amd64", engine="arm64")
    assert code == 2 and "no binfmt_misc entry qemu-x86_64" in err


def _engine() -> dict[str, str]:
    """The Docker engine for the opt-in test: MLA_SERVE_DOCKER_TESTS=1 (and DOCKER_HOST as
    needed; `make image-smoke` leaves its private engine's socket at
    /run/mla-serve-docker.sock while it runs)."""
    if os.environ.get("MLA_SERVE_DOCKER_TESTS") != "1":
        pytest.skip("needs a Docker engine: MLA_SERVE_DOCKER_TESTS=1 (opt-in, like image-smoke)")
    if shutil.which("docker") is None:
        pytest.fail("MLA_SERVE_DOCKER_TESTS=1 but no docker client on PATH")
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the builder make image-smoke uses
    done = subprocess.run(["docker", "version"], env=env, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    return env


def test_an_engine_builds_arm64_on_the_loaded_base(tmp_path: Path) -> None:
    """On a real engine: the archive's base is arm64 and `docker build --platform linux/arm64`
    runs through ENV, SHELL and COPY on it (no RUN: nothing is emulated). Where the engine
    ignores `docker import --platform` (Docker 20.10 without experimental mode), the same
    build on the imported base fails the way the first arm64 smoke did."""
    env = _engine()
    layer = _layer(tmp_path)
    tag = f"mla-serve-test/arch:{os.getpid()}"
    context = tmp_path / "context"
    context.mkdir()
    (context / "hello.txt").write_text("hello\n")
    tags = [f"{tag}-loaded", f"{tag}-imported", f"{tag}-built"]

    def docker(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", *args],
            env=env,
            input=stdin.decode("latin-1") if stdin is not None else None,
            capture_output=True,
            text=True,
            encoding="latin-1",
            timeout=300,
            check=False,
        )

    def build(base: str) -> subprocess.CompletedProcess[str]:
        (context / "Dockerfile").write_text(
            f"FROM {base}\nENV PATH=/opt/venv/bin:$PATH\n"
            'SHELL ["/bin/bash", "-c"]\nCOPY hello.txt /tmp/\n'
        )
        return docker("build", "--platform", "linux/arm64", "-t", tags[2], str(context))

    try:
        archive = _archive(tmp_path, "--layer", str(layer), "--arch", "arm64", "--tag", tags[0])
        assert archive.returncode == 0, archive.stderr
        loaded = docker("load", stdin=archive.stdout)
        assert loaded.returncode == 0, loaded.stderr
        arch = docker("image", "inspect", "-f", "{{.Architecture}}", tags[0]).stdout.strip()
        assert arch == "arm64"
        built = build(tags[0])
        assert built.returncode == 0, built.stdout + built.stderr
        arch = docker("image", "inspect", "-f", "{{.Architecture}}", tags[2]).stdout.strip()
        assert arch == "arm64"

        imported = docker("import", "--platform", "linux/arm64", str(layer), tags[1])
        assert imported.returncode == 0, imported.stderr
        arch = docker("image", "inspect", "-f", "{{.Architecture}}", tags[1]).stdout.strip()
        if arch != "arm64":  # the engine ignored --platform: the first smoke's failure
            built = build(tags[1])
            assert built.returncode != 0
            assert "does not match the specified platform" in built.stdout + built.stderr
    finally:
        docker("rmi", "-f", *tags)
