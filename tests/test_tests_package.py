"""tests/ is one package, `tests`: each helper imports under one name, no file edits sys.path,
and every script (benchmarks, packers, the GPU machine's) starts as `python -m tests.…`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# Folders of Python files that are not modules of `tests`: a stand-in package that the e2e
# harness puts on the path as `deep_gemm` itself, and the recipe of a recorded fixture (run by
# path against an old checkout, see its docstring).
NOT_PACKAGES = {TESTS / "e2e" / "standins", TESTS / "fixtures"}
# The two sys.path edits that stay: each puts the vLLM tree under test first (--vllm-tree).
VLLM_TREE_EDITS = {"tests/conftest.py": 1, "tests/gpu/bench_gpu.py": 1}
SCRIPTS = [
    "tests.e2e.bench", "tests.e2e.matrix", "tests.e2e.pack", "tests.e2e.layouts",
    "tests.e2e.parts", "tests.gpu.bench_gpu", "tests.gpu.pack", "tests.upstream",
    "tests.bench.bench_patches", "tests.bench.bench_sidecar", "tests.bench.bench_passthrough",
    "tests.bench.bench_loops", "tests.bench.bench_replay", "tests.bench.passthrough.replay",
    "tests.bench.passthrough.upstream", "tests.bench.passthrough.floor",
    "tests.bench.bench_hot_path", "tests.gpu.dsv4_prefill", "tests.e2e.kv_suggestion",
    "tests.e2e.timeline",
]  # fmt: skip


def _python_files() -> list[Path]:
    return [
        path
        for path in sorted(TESTS.rglob("*.py"))
        if not any(path.is_relative_to(skip) for skip in NOT_PACKAGES)
    ]


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder without __init__.py would make pytest import its files by their bare names
    (a second name beside `tests.…` for any module also imported as a package member)."""
    folders = {path.parent for path in _python_files()}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == []


def test_no_file_edits_sys_path_but_the_vllm_tree_selection() -> None:
    found: dict[str, int] = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                name = str(path.relative_to(ROOT))
                found[name] = found.get(name, 0) + 1
    assert found == VLLM_TREE_EDITS


@pytest.mark.parametrize("module", SCRIPTS)
def test_the_script_starts_as_a_module_of_the_package(module: str, tmp_path: Path) -> None:
    """From anywhere, with the repository root on PYTHONPATH (the GPU machine's run.sh), or
    from the root itself (make)."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "usage:" in done.stdout + done.stderr


def test_every_module_of_tests_loaded_here_has_its_package_name() -> None:
    """In this process (after collection: in `make test`, every test module and helper),
    each module loaded from tests/ is `tests.…`: none twice under a bare name."""
    loaded = {
        name: Path(module.__file__).resolve()
        for name, module in list(sys.modules.items())
        if getattr(module, "__file__", None)
    }
    ours = {name: path for name, path in loaded.items() if path.is_relative_to(TESTS)}
    assert "tests.test_tests_package" in ours
    assert sorted(n for n in ours if n != "tests" and not n.startswith("tests.")) == []
    by_path: dict[Path, list[str]] = {}
    for name, path in ours.items():
        by_path.setdefault(path, []).append(name)
    assert {str(p): names for p, names in by_path.items() if len(names) > 1} == {}
