"""`mla-serve patches deep-gemm`: which DeepGEMM a vLLM tree loads (vLLM issues 51970, 53320).

On vLLM 0.33.0's real tree with its real vendored DeepGEMM package file (from the release's
wheel), with and without a DeepGEMM installed by pip (a real wheel, installed with pip),
through the real CLI in a child process whose import path is the one vLLM would run with.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mla_serve.patching import deep_gemm, tree, wheel
from tests import trees

RELEASE = trees.DEFAULT_RELEASE


@pytest.fixture(scope="module")
def vllm_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's tree with its vendored DeepGEMM package (left out of the Python-only
    trees) put back from the release's own wheel."""
    target = trees.clone(RELEASE, tmp_path_factory.mktemp("tree") / "site")
    with zipfile.ZipFile(wheel.fetch(RELEASE, trees.CACHE / "wheels")) as archive:
        for name in ("vllm/third_party/__init__.py", deep_gemm.VENDORED):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(archive.read(name))
    return target


def deep_gemm_wheel(directory: Path, version: str) -> Path:
    """A DeepGEMM wheel as pip installs one: the package and its dist-info."""
    files = {
        "deep_gemm/__init__.py": f'__version__ = "{version}"\n',
        f"deep_gemm-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: deep_gemm\nVersion: {version}\n"
        ),
        f"deep_gemm-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [
        f"{name},sha256="
        + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip("=")
        + f",{len(text.encode())}"
        for name, text in files.items()
    ]
    files[f"deep_gemm-{version}.dist-info/RECORD"] = "\n".join(
        [*record, f"deep_gemm-{version}.dist-info/RECORD,,"]
    )
    path = directory / f"deep_gemm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def check(target: Path, *path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`mla-serve patches deep-gemm --target TREE` with `path` on PYTHONPATH, as vLLM runs."""
    environment = dict(os.environ, **env)
    environment["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return subprocess.run(
        [sys.executable, "-m", "mla_serve.cli", "patches", "deep-gemm", "--target", str(target)],
        env=environment, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_release_loads_its_vendored_deep_gemm(vllm_tree: Path):
    result = check(vllm_tree)
    assert result.returncode == 0, result.stderr
    vendored = vllm_tree / "vllm" / "third_party" / "deep_gemm"
    assert result.stdout.splitlines() == [
        f"vLLM {RELEASE} loads DeepGEMM from {vendored} (vLLM {RELEASE}'s vendored copy)"
    ]


def test_a_pip_installed_deep_gemm_that_shadows_it_is_refused(vllm_tree: Path, tmp_path: Path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(site), str(deep_gemm_wheel(tmp_path, "2.0.0"))],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    result = check(vllm_tree, site)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"loads DeepGEMM from {site / 'deep_gemm'} (deep_gemm 2.0.0)" in result.stdout
    assert "REFUSED" in result.stderr and "51970" in result.stderr
    assert "pip uninstall deep_gemm" in result.stderr and deep_gemm.ALLOW_ENV in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unpackaged_deep_gemm_on_the_path_is_named_as_such(vllm_tree: Path, tmp_path: Path):
    """A package on PYTHONPATH without pip's metadata (a checkout, a stand-in) shadows it too."""
    (tmp_path / "deep_gemm").mkdir()
    (tmp_path / "deep_gemm" / "__init__.py").write_text("")
    result = check(vllm_tree, tmp_path)
    assert result.returncode == 1
    assert f"{tmp_path / 'deep_gemm'} (no installed distribution)" in result.stdout


def test_a_wrapper_that_prefers_its_own_copy_is_not_refused(vllm_tree: Path, tmp_path: Path):
    """Where vLLM imports its vendored copy first, another DeepGEMM beside it is harmless."""
    target = trees.clone(RELEASE, tmp_path / "tree")
    for name in ("vllm/third_party/__init__.py", deep_gemm.VENDORED):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes((vllm_tree / name).read_bytes())
    wrapper = target / deep_gemm.WRAPPER
    source = wrapper.read_text()
    own, other = 'import_module("vllm.third_party.deep_gemm")', 'import_module("deep_gemm")'
    assert source.count(own) == 1 and source.count(other) == 1
    swapped = source.replace(own, "\0").replace(other, own).replace("\0", other)
    trees.edit(wrapper, swapped)
    (tmp_path / "extra" / "deep_gemm").mkdir(parents=True)
    (tmp_path / "extra" / "deep_gemm" / "__init__.py").write_text("")
    resolution = deep_gemm.resolve(tree.locate(target), [str(target), str(tmp_path / "extra")])
    assert not resolution.external_first and not resolution.shadowed
    assert deep_gemm.report(resolution)[1].startswith("note: ")


@pytest.mark.parametrize("release", trees.RELEASES)
def test_every_release_imports_a_separate_deep_gemm_first(release: str):
    """What the guard is for: every supported release prefers a separately installed one."""
    resolution = deep_gemm.resolve(tree.locate(trees.pristine(release)), [])
    assert resolution.external_first


SCHEDULER = "vllm/third_party/deep_gemm/include/deep_gemm/scheduler/sm90_paged_mqa_logits.cuh"


@pytest.mark.parametrize("release", trees.RELEASES)
def test_the_vendored_deep_gemm_schedules_all_zero_lengths_without_reading_past_them(
    release: str,
):
    """Why vLLM's own DeepGEMM is the one to serve with: the SM90 paged-MQA metadata
    kernel it JIT-compiles from these headers returns early when every context length is
    zero (the FULL-capture crash of vLLM issues 51970 and 53320) from vLLM 0.28.0 on;
    0.27.1's reads prefix_sum[batch_size]. A DeepGEMM installed beside vLLM may be older."""
    with zipfile.ZipFile(wheel.fetch(release, trees.CACHE / "wheels")) as archive:
        header = archive.read(SCHEDULER).decode()
    fixed = tuple(int(part) for part in release.split(".")) >= (0, 28, 0)
    assert ("if (total == 0)" in header and "min(lo, batch_size - 1)" in header) is fixed
