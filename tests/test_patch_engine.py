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


# A release without a backport (an empty series: every fix upstream, absent, or affected
# with no backport carried). Every supported release carries a series today, so the newest
# release before the default loses its own in a private copy of the catalog
# (MLA_SERVE_PATCHES): the fixes it carried become `affected` there, as the catalog derives.
NOTHING_TO_DO = trees.RELEASES[-2]


@pytest.fixture
def without_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> catalog_.Catalog:
    """The catalog with NOTHING_TO_DO's series removed, in effect for the CLI."""
    root = tmp_path / "patches"
    shutil.copytree(CATALOG.root, root)
    shutil.rmtree(root / f"vllm-{NOTHING_TO_DO}", ignore_errors=True)
    monkeypatch.setenv("MLA_SERVE_PATCHES", str(root))
    loaded = catalog_.load(root)
    assert not loaded.series(NOTHING_TO_DO).patches
    return loaded


def test_a_release_without_backports_changes_nothing_and_records_why(
    without_series: catalog_.Catalog, tmp_path: Path, capsys
):
    release = NOTHING_TO_DO
    target = trees.clone(release, tmp_path / "tree")
    before = snapshot(target)
    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0 and "0 file(s) changed" in out
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    assert document["files"] == []
    statuses = {f["id"]: f["status"] for f in document["fixes"]}
    assert statuses == {f.id: f.on(release).status.value for f in without_series.fixes}
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
    assert code == 1  # a pristine tree of a patched release lacks its backports
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
    assert code == 1
    assert "[0.27.1]" in out
    row = next(line for line in out.splitlines() if line.startswith("dsv4-c128a-capacity-stride"))
    assert row.split()[1:3] == ["patched:fail", "upstream"]
    # The fixes 0.27.1 gets from mla-serve ahead of upstream, with their pull requests.
    ahead = out[out.index("ahead of upstream: 2 fix(es) in no vLLM release yet") :].splitlines()
    assert ahead[1].startswith("  dsv4-zero-query-prefill-chunk: upstream pull request open (")
    assert "vllm/pull/57983" in ahead[2]


@pytest.mark.parametrize("release", AFFECTED)
def test_status_exits_1_where_a_fix_the_catalog_promises_is_missing(
    release: str, tmp_path: Path, capsys
):
    """0: every fix as the catalog says; 1: one is not (a patched release's pristine tree),
    with a line per missing fix; the same in JSON."""
    pristine = trees.pristine(release)
    missing = [f.id for f in CATALOG.fixes if f.on(release).status is catalog_.Status.PATCHED]
    for output in ("text", "json"):
        code, _, err = run(capsys, "patches", "status", "--target", pristine, "--format", output)
        assert code == 1, (output, err)
        assert [line.split()[1] for line in err.splitlines() if line.startswith("MISSING")] == (
            missing
        )
        assert f"{len(missing)} fix(es) not as the catalog says (`mla-serve patches apply`" in err
        assert "Traceback" not in err
    target = trees.clone(release, tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    code, _, err = run(capsys, "patches", "status", "--target", target)
    assert code == 0 and err == ""


def test_status_exits_by_the_catalog_on_a_release_with_nothing_to_apply(
    without_series: catalog_.Catalog, capsys
):
    """A release with an empty series: 0 where every fix is upstream or not affected; 1 with
    an AFFECTED line per fix the release has and mla-serve carries no backport for (and no
    `apply` hint: there is nothing to apply)."""
    release = NOTHING_TO_DO
    fixes = without_series.fixes
    affected = [f.id for f in fixes if f.on(release).status is catalog_.Status.AFFECTED]
    assert affected  # the fixes its series carried in the real catalog
    code, _, err = run(capsys, "patches", "status", "--target", trees.pristine(release))
    assert code == 1, err
    listed = [
        line.split()[1].rstrip(":") for line in err.splitlines() if line.startswith("AFFECTED")
    ]
    assert listed == affected
    assert "patches apply" not in err and "Traceback" not in err


def _apply_then_edit(tmp_path: Path, capsys) -> tuple[Path, dict[str, str], Path]:
    """0.29.0 patched by `apply`, its snapshot then, and ops/dcp.py (patched) edited."""
    target = trees.clone("0.29.0", tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    applied = snapshot(target)
    edited = target / "vllm/v1/attention/ops/dcp.py"
    trees.edit(edited, edited.read_text() + "\n# local change\n")
    return target, applied, edited


def test_apply_refuses_a_drifted_tree_and_leaves_it_as_it_is(tmp_path: Path, capsys):
    """apply would have found every patch present and recorded the edited file as the
    series' result: the drift verify reports would be blessed. It refuses, naming the file,
    and writes nothing (the manifest included); verify still reports the drift."""
    target, _, edited = _apply_then_edit(tmp_path, capsys)
    before = snapshot(target)
    manifest_bytes = (target / "vllm" / manifest.FILENAME).read_bytes()
    for dry_run in ([], ["--dry-run"]):
        code, out, err = run(capsys, "patches", "apply", "--target", target, *dry_run)
        assert code == 1, (dry_run, out, err)
        assert "DRIFT vllm/v1/attention/ops/dcp.py: sha256" in err
        assert "1 file(s) changed since the series was applied" in err
        assert "`mla-serve patches repair`" in err and "Traceback" not in err
        assert "file(s) changed; manifest" not in out
        assert snapshot(target) == before
        assert (target / "vllm" / manifest.FILENAME).read_bytes() == manifest_bytes
    assert edited.read_text().endswith("# local change\n")
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1 and "DRIFT vllm/v1/attention/ops/dcp.py" in err


def test_repair_takes_a_drifted_tree_back_to_the_series(tmp_path: Path, capsys):
    """repair restores the series' content of the changed files from the originals the
    manifest records: an edit outside the series' hunks, one inside them (the series cannot
    be undone on it) and a deleted file; the tree is then byte for byte as apply left it."""
    target, applied, edited = _apply_then_edit(tmp_path, capsys)
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    paths = [row["path"] for row in document["files"]]
    assert sorted(document["originals"]) == sorted(paths)
    inside = next(p for p in paths if p.endswith("backends/utils.py"))
    # Undo one line the series added there: reversing the series no longer applies.
    plan = engine.plan(tree.locate(trees.pristine("0.29.0")), CATALOG)
    added = next(
        line
        for patch in plan.diffs.values()
        for fd in patch
        if fd.path == inside
        for hunk in fd.hunks
        for line in hunk.new
        if line not in hunk.old and line.strip()
    )
    text = (target / inside).read_text()
    assert text.count(added) == 1
    trees.edit(target / inside, text.replace(added, "    pass  # reverted by hand"))
    gone = next(p for p in paths if p.endswith("flashinfer_mla_sparse.py"))
    (target / gone).unlink()
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 1 and "3 file(s) changed" in err
    code, out, err = run(capsys, "patches", "repair", "--target", target)
    assert code == 0, err
    assert "restored the series' content of" in out
    for path in (str(edited.relative_to(target)), inside, gone):
        assert f"DRIFT {path}" in out and path in out.splitlines()[-1]
    assert snapshot(target) == applied  # the manifest included
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0
    code, out, _ = run(capsys, "patches", "repair", "--target", target)
    assert code == 0 and "no interrupted apply and no file changed" in out


def test_repair_without_recorded_originals_undoes_the_series_or_refuses(tmp_path: Path, capsys):
    """A manifest without `originals` (as older mla-serve wrote them): a file back at the
    release's original is repaired by applying the series again; an edited one cannot be
    told apart from its original, and repair refuses in one line, touching nothing."""
    target, applied, edited = _apply_then_edit(tmp_path, capsys)
    path = target / "vllm" / manifest.FILENAME
    document = json.loads(path.read_text())
    del document["originals"]
    trees.edit(path, manifest.render(document))
    before = snapshot(target)
    code, _, err = run(capsys, "patches", "repair", "--target", target)
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot restore vllm/v1/attention/ops/dcp.py: the manifest records no original" in err
    assert snapshot(target) == before
    relative = str(edited.relative_to(target))
    trees.edit(edited, (trees.pristine("0.29.0") / relative).read_text())
    code, out, err = run(capsys, "patches", "repair", "--target", target)
    assert code == 0, err
    assert "(the release's original)" in out
    assert snapshot(target) == applied  # and the manifest records the originals again


def test_apply_after_vllm_was_reinstalled_applies_the_series_again(tmp_path: Path, capsys):
    """A patched file back at the release's original (vLLM reinstalled over the tree, which
    keeps the manifest) is no drift to refuse: apply patches it again."""
    target, applied, edited = _apply_then_edit(tmp_path, capsys)
    relative = str(edited.relative_to(target))
    trees.edit(edited, (trees.pristine("0.29.0") / relative).read_text())
    code, out, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 0, err
    assert "1 file(s) changed" in out
    assert snapshot(target) == applied


def test_a_manifest_of_another_vllm_version_is_replaced_not_compared(tmp_path: Path, capsys):
    """vLLM replaced by another release keeps the old manifest (pip does not own it): it is
    no record of this tree, and apply writes this one's."""
    old = trees.clone("0.29.0", tmp_path / "old")
    assert run(capsys, "patches", "apply", "--target", old)[0] == 0
    target = trees.clone("0.28.0", tmp_path / "tree")
    shutil.copy(old / "vllm" / manifest.FILENAME, target / "vllm" / manifest.FILENAME)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 0, err
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    assert document["vllm_version"] == "0.28.0"
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0


def test_apply_refuses_a_manifest_it_cannot_read(tmp_path: Path, capsys):
    target = trees.clone("0.29.0", tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    path = target / "vllm" / manifest.FILENAME
    trees.edit(path, "{not json")
    before = snapshot(target)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "cannot read manifest" in err and "remove the manifest to apply afresh" in err
    assert snapshot(target) == before


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
