"""Upstream's own tests for each fix, unchanged, on every release tree (CPU ones here;
the CUDA ones run in the GPU suite). The catalog says which: pristine trees of affected
releases must fail them (the bug is there), patched trees and releases that carry the fix
must pass them. See tests/upstream.py for where the tests come from."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from mla_serve import cli
from mla_serve.patching import catalog
from tests import trees, upstream

CATALOG = catalog.load()
RUNS = [
    (release, state)
    for release in CATALOG.releases
    for state in ("pristine", "patched")
    if upstream.cases(CATALOG, release, state, "cpu")
    and (state == "pristine" or CATALOG.series(release).patches)
]


def _files() -> dict[str, Path]:
    """Each sdist's extracted tests, fetched once (cached under .cache)."""
    roots = {}
    for fix in CATALOG.fixes:
        if fix.upstream_tests:
            sdist = fix.upstream_tests.sdist
            needed = tuple(
                f.upstream_tests.files()
                for f in CATALOG.fixes
                if f.upstream_tests and f.upstream_tests.sdist == sdist
            )
            roots[sdist] = upstream.extract(sdist, tuple(sorted({n for g in needed for n in g})))
    return roots


@pytest.fixture(scope="module")
def sdist_roots() -> dict[str, Path]:
    return _files()


@pytest.mark.parametrize(("release", "state"), RUNS)
def test_upstream_tests_fail_on_the_bug_and_pass_with_the_fix(
    release: str, state: str, tmp_path: Path, sdist_roots: dict[str, Path]
):
    if importlib.util.find_spec("torch") is None:
        pytest.fail("torch is not installed: run `make test`, which installs the CPU build")
    target = trees.pristine(release)
    if state == "patched":
        target = trees.clone(release, tmp_path / "tree")
        assert cli.main(["patches", "apply", "--target", str(target)]) == 0
    selected = upstream.cases(CATALOG, release, state, "cpu")
    outcomes = upstream.run(target, selected, tmp_path / "report.json")
    wrong = [w for c in selected if (w := upstream.verdict(c, outcomes[c.test]))]
    assert not wrong, "\n".join(wrong)
    # Every fix we backport here that upstream tested shows the bug on the pristine tree (and,
    # run on both trees, the fix on the patched one).
    if state == "pristine":
        backported = {
            f.id
            for f in CATALOG.fixes
            if f.on(release).status is catalog.Status.PATCHED
            and f.upstream_tests
            and f.upstream_tests.shows_bug
            and f.upstream_tests.selected("cpu", release)
        }
        shown = {c.fix for c in selected if c.expect == "fail"}
        assert backported <= shown, f"no upstream test shows {backported - shown} here"


def test_every_named_upstream_test_exists_in_its_sdist(sdist_roots: dict[str, Path]):
    """The catalog names functions the sdist really has (a typo would look like a skip)."""
    for fix in CATALOG.fixes:
        tests = fix.upstream_tests
        if fix.fixed_upstream is None:
            continue  # no upstream fix yet, so no upstream test of it
        assert tests is not None, f"{fix.id} names no upstream tests"
        for test in (*tests.cpu, *tests.gpu, *(o.test for o in tests.left_out)):
            path, _, function = test.partition("::")
            source = (sdist_roots[tests.sdist] / path).read_text(encoding="utf-8")
            defined = {
                n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)
            }
            assert not function or function in defined, f"{fix.id}: {test} not in the sdist"


def test_left_out_tests_name_a_reason_and_every_patched_cell_its_code_path():
    for fix in CATALOG.fixes:
        assert fix.upstream_tests is not None or fix.fixed_upstream is None, fix.id
        for left in fix.upstream_tests.left_out if fix.upstream_tests else ():
            assert len(left.reason) > 40, (fix.id, left.test)
        for release in CATALOG.releases:
            claim = fix.on(release)
            if claim.status is catalog.Status.PATCHED:
                assert claim.path, (fix.id, release)  # the code that reaches the bug there
            elif claim.status is not catalog.Status.AFFECTED:
                assert not claim.path, (fix.id, release)  # no bug, no path to it


def test_the_reporter_keeps_why_a_test_failed_and_a_file_skipped(tmp_path: Path):
    """The verdict of a GPU run must say why (the GPU machine is gone afterwards): the end of
    pytest's report of a failure, a module-level skip as skipped with its reason, and a
    passing test with none."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "test_a.py").write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'the reason'\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\npytest.skip('no CUDA platform', allow_module_level=True)\n"
        "def test_never():\n    pass\n"
    )
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(upstream.REPORTER.parent),
           "MLA_SERVE_UPSTREAM_REPORT": str(report)}  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pytest", "-c", os.devnull, "--noconftest", "-p", "upstream_report",
         "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), "test_a.py", "test_b.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    recorded = json.loads(report.read_text())
    assert upstream.outcome("test_a.py::test_bad", recorded) == "failed"
    assert "the reason" in (upstream.why("test_a.py::test_bad", recorded) or "")
    assert upstream.outcome("test_a.py::test_ok", recorded) == "passed"
    assert upstream.why("test_a.py::test_ok", recorded) is None
    assert upstream.outcome("test_b.py::test_never", recorded) == "skipped"
    assert "no CUDA platform" in (upstream.why("test_b.py::test_never", recorded) or "")
