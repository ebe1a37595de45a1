"""The patch engine on the real released vLLM trees (unpacked from the wheels)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from mla_serve.patching import catalog as catalog_
from mla_serve.patching import diff, engine, manifest, probes, tree
from tests import trees
from tests.cli_run import run

CATALOG = catalog_.load()
AFFECTED = trees.PATCHED_RELEASES


def snapshot(root: Path) -> dict[str, str]:
    """Every file's hash, bytecode caches aside."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.parametrize("release", trees.RELEASES)
def test_pristine_probes_match_the_catalog(release: str):
    """A probe fails exactly where the catalog says the release has the bug."""
    pristine = tree.locate(trees.pristine(release))
    assert pristine.version == release
    for fix in CATALOG.fixes:
        result = probes.run(fix.id, pristine)
        claim = fix.on(release)
        if claim.status is catalog_.Status.PATCHED:
            assert not result.passed, (fix.id, result.detail)  # the bug, until the series
        else:
            assert probes.proves(claim, result), (fix.id, result.detail)


@pytest.mark.parametrize("release", AFFECTED)
def test_apply_fixes_every_probe_and_twice_is_a_no_op(release: str, tmp_path: Path, capsys):
    target = trees.clone(release, tmp_path / "tree")
    before = snapshot(target)

    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0, out
    after = snapshot(target)
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    changed = {k for k in after if before.get(k) != after[k]} - {f"vllm/{manifest.FILENAME}"}
    assert changed == {row["path"] for row in document["files"]}
    for row in document["fixes"]:  # fixed, or (a verdict) the bug's code never reached
        verdict = CATALOG.fix(row["id"]).on(release).verdict
        assert row["probe"] == "pass" or (verdict and row["probe"] == "unreachable"), row
    assert "applied" in out and "already-applied" not in out
    for row in document["files"]:
        assert row["sha256_before"] == before[row["path"]]
        assert row["sha256_after"] == after[row["path"]]
        pyc = importlib.util.cache_from_source(str(target / row["path"]))
        assert Path(pyc).is_file(), "bytecode of a touched file was not refreshed"

    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0
    assert "already-applied" in out and "0 file(s) changed" in out
    assert snapshot(target) == after  # manifest included: byte-identical

    code, out, _ = run(capsys, "patches", "verify", "--target", target)
    assert code == 0 and "matches" in out


# Releases without a backport (an empty series: every fix upstream, absent, or affected with
# no backport carried): the first and the newest.
NOTHING_TO_DO = [r for r in trees.RELEASES if not CATALOG.series(r).patches]


@pytest.mark.parametrize("release", sorted(set(NOTHING_TO_DO[:1] + NOTHING_TO_DO[-1:])))
def test_a_release_without_backports_changes_nothing_and_records_why(
    release: str, tmp_path: Path, capsys
):
    target = trees.clone(release, tmp_path / "tree")
    before = snapshot(target)
    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0 and "0 file(s) changed" in out
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    assert document["files"] == []
    statuses = {f["id"]: f["status"] for f in document["fixes"]}
    assert statuses == {f.id: f.on(release).status.value for f in CATALOG.fixes}
    assert set(statuses.values()) <= {"upstream", "not-affected", "affected"}
    assert all(f["reason"] for f in document["fixes"])
    after = snapshot(target)
    del after[f"vllm/{manifest.FILENAME}"]
    assert after == before


def _broken_catalog(tmp_path: Path, release: str, patch: str, old: str, new: str) -> Path:
    root = tmp_path / "patches"
    shutil.copytree(CATALOG.root, root)
    path = root / f"vllm-{release}" / patch
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return root


def test_a_broken_hunk_fails_naming_fix_and_file_and_leaves_the_tree(
    tmp_path: Path, capsys, monkeypatch
):
    release = "0.29.0"
    target = trees.clone(release, tmp_path / "tree")
    before = snapshot(target)
    # Break the last patch, so earlier patches of the series would apply cleanly.
    root = _broken_catalog(
        tmp_path,
        release,
        "0004-dcp-rank-device-tensor.patch",
        "            self.cp_kv_cache_interleave_size,\n",
        "            self.cp_kv_cache_interleave_size_renamed,\n",
    )
    monkeypatch.setenv("MLA_SERVE_PATCHES", str(root))
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 2
    assert "dcp-rank-device-tensor" in err
    assert "vllm/v1/attention/backends/mla/indexer.py" in err
    assert "Traceback" not in err
    assert snapshot(target) == before


def test_a_missing_file_fails_naming_it(tmp_path: Path, capsys):
    target = trees.clone("0.28.0", tmp_path / "tree")
    (target / "vllm/v1/attention/ops/common.py").unlink()
    before = snapshot(target)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 2
    assert "dcp-empty-shard-mask" in err and "vllm/v1/attention/ops/common.py: file missing" in err
    assert snapshot(target) == before


def test_a_partly_patched_tree_is_completed(tmp_path: Path, capsys):
    release = "0.27.1"
    target = trees.clone(release, tmp_path / "tree")
    found = tree.locate(target)
    first = CATALOG.series(release).patches[0]
    plan = engine.plan(found, CATALOG)
    # Write just the first patch's result, as a hand-applied patch would.
    for file_diff in plan.diffs[first]:
        original = found.read(file_diff.path)
        trees.edit(target / file_diff.path, diff.apply(file_diff, original))
    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0
    fix = CATALOG.fix_of_patch(release, first)
    assert any(line.split()[:2] == [fix.id, "already-applied"] for line in out.splitlines())
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0


def test_a_failed_write_restores_the_files_already_replaced(tmp_path: Path, monkeypatch):
    target = trees.clone("0.29.0", tmp_path / "tree")
    before = snapshot(target)
    found = tree.locate(target)
    plan = engine.plan(found, CATALOG)
    engine.check(plan, CATALOG)
    real_replace = engine._replace
    calls = []

    def fail_on_third(path: Path, text: str | None) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(path))
        real_replace(path, text)

    monkeypatch.setattr(engine, "_replace", fail_on_third)
    with pytest.raises(engine.PatchError, match="No space left on device; tree restored"):
        engine.write(plan)
    assert snapshot(target) == before


def test_verify_catches_an_edited_patched_file(tmp_path: Path, capsys):
    target = trees.clone("0.29.0", tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    edited = target / "vllm/v1/attention/ops/dcp.py"
    trees.edit(edited, edited.read_text() + "\n# local change\n")
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1
    assert "DRIFT vllm/v1/attention/ops/dcp.py" in err


def test_verify_catches_a_reverted_fix_and_a_missing_manifest(tmp_path: Path, capsys):
    target = trees.clone("0.27.1", tmp_path / "tree")
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 2 and "no manifest" in err
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    stride = target / "vllm/models/deepseek_v4/sparse_mla.py"
    trees.edit(
        stride, (trees.pristine("0.27.1") / "vllm/models/deepseek_v4/sparse_mla.py").read_text()
    )
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1
    assert "dsv4-c128a-capacity-stride: probe fails" in err


def test_status_json_has_the_documented_shape(tmp_path: Path, capsys):
    code, out, _ = run(
        capsys, "patches", "status", "--target", trees.pristine("0.28.0"), "--format", "json"
    )
    assert code == 0
    document = json.loads(out)
    assert document["vllm_version"] == "0.28.0"
    assert [f["id"] for f in document["fixes"]] == [f.id for f in CATALOG.fixes]
    by_id = {f["id"]: f for f in document["fixes"]}
    assert by_id["dcp-empty-shard-mask"] == {
        "id": "dcp-empty-shard-mask",
        "status": "patched",
        "probe": "fail",
        "detail": by_id["dcp-empty-shard-mask"]["detail"],
        "ahead_of_upstream": False,  # upstream's fix, merged in 0.30.0
    }
    assert by_id["dsv4-c128a-capacity-stride"]["probe"] == "pass"
    assert by_id["kv-cache-memory-suggestion"]["ahead_of_upstream"] is True  # no release has it


def test_status_text_shows_the_matrix_with_this_trees_probes(capsys):
    code, out, _ = run(capsys, "patches", "status", "--target", trees.pristine("0.27.1"))
    assert code == 0
    assert "[0.27.1]" in out
    row = next(line for line in out.splitlines() if line.startswith("dsv4-c128a-capacity-stride"))
    assert row.split()[1:3] == ["patched:fail", "upstream"]
    # The fixes 0.27.1 gets from mla-serve ahead of upstream, with their pull requests.
    ahead = out[out.index("ahead of upstream: 2 fix(es) in no vLLM release yet") :].splitlines()
    assert ahead[1].startswith("  dsv4-zero-query-prefill-chunk: upstream pull request open (")
    assert "vllm/pull/57983" in ahead[2]


def test_unknown_release_and_non_trees_are_refused_clearly(tmp_path: Path, capsys):
    target = trees.clone("0.33.0", tmp_path / "tree")
    version_file = target / "vllm/_version.py"
    trees.edit(version_file, version_file.read_text().replace("'0.33.0'", "'0.26.0'"))
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 2
    assert "vLLM 0.26.0 is not a supported release; supported: 0.27.1" in err
    code, _, err = run(capsys, "patches", "status", "--target", tmp_path)
    assert code == 2 and "does not contain a vllm/ package" in err
    assert "Traceback" not in err


def test_local_version_suffix_maps_to_its_release():
    assert CATALOG.release_of("0.33.0+cu130") == "0.33.0"


def test_every_patch_carries_dep3_headers():
    required = (
        "Description:",
        "Origin:",
        "Bug:",
        "Forwarded:",
        "Applied-Upstream:",
        "Last-Update:",
    )
    for release in trees.RELEASES:
        series = CATALOG.series(release)
        for name in series.patches:
            header = series.text(name).split("\n---\n", 1)[0]
            for field in required:
                assert f"\n{field}" in f"\n{header}", (release, name, field)


# Undo each fix in the default release's code (`[fix.regression]` in the catalog): where it
# ships upstream's fix, as released; where mla-serve patches it, with its series applied and
# the fix undone another way than the release shipped it. The probe must notice, or its
# pass on trees that carry the fix would prove nothing.
@pytest.mark.parametrize("fix_id", [f.id for f in CATALOG.fixes])
def test_probe_fails_when_the_fix_is_undone(fix_id: str, tmp_path: Path):
    assert {f.id for f in CATALOG.fixes} == set(probes.PROBES), "one probe per fix"
    fix = CATALOG.fix(fix_id)
    status = fix.on(trees.DEFAULT_RELEASE).status
    if status not in (catalog_.Status.UPSTREAM, catalog_.Status.PATCHED):
        assert fix.regression is None, "a regression undoes a fix the default release has"
        pytest.skip(f"{trees.DEFAULT_RELEASE} has no fix for {fix_id} (status {status.value})")
    assert fix.regression is not None, f"{fix_id}: the catalog names no [fix.regression]"
    if status is catalog_.Status.UPSTREAM:
        target = trees.clone(trees.DEFAULT_RELEASE, tmp_path / "tree")
    else:
        target = trees.patched(trees.DEFAULT_RELEASE, tmp_path / "tree", tmp_path / "m.json")
    path, old, new = fix.regression.file, fix.regression.old, fix.regression.new
    source = (target / path).read_text()
    assert source.count(old) == 1, f"the {trees.DEFAULT_RELEASE} code moved; update the regression"
    assert probes.run(fix_id, tree.locate(target)).passed
    trees.edit(target / path, source.replace(old, new))
    result = probes.run(fix_id, tree.locate(target))
    assert not result.passed, result.detail
    if status is catalog_.Status.PATCHED:  # undone another way than the release shipped it
        shipped = (trees.pristine(trees.DEFAULT_RELEASE) / path).read_text()
        assert source.replace(old, new) != shipped
