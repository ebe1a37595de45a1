"""The catalog states each release fact once and derives every status from them
(patches/catalog.toml, mla_serve/patching/catalog.py).

The derivation rules run on small catalogs written here; the fourth status (`affected`: the
bug is there and no backport) and the one-line verdict run on the real catalog and a real
vLLM tree."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from mla_serve.patching import catalog as catalog_
from mla_serve.patching import manifest, probes
from tests import trees
from tests.cli_run import run

CATALOG = catalog_.load()
S = catalog_.Status
ROOT = Path(__file__).resolve().parent.parent


def labels_problems(document: dict[str, object], release: str) -> list[str]:
    """docker/labels.py's check of an image's manifest against its labels (build args)."""
    spec = importlib.util.spec_from_file_location("labels", ROOT / "docker" / "labels.py")
    assert spec and spec.loader
    labels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(labels)
    args = labels.build_args(release)
    found: list[str] = labels.problems(document, release, args["SERIES_DIGEST"], args["FIXES"])
    return found


RELEASES = '["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"]'


def write(
    tmp_path: Path,
    fix: str,
    backports: dict[str, str] | None = None,
    default: str = "1.4.0",
    releases: str = RELEASES,
) -> Path:
    """A catalog of one fix `demo` in tmp_path/patches, with backport files
    {release: file name}; returns its root."""
    root = tmp_path / "patches"
    root.mkdir(parents=True)
    (root / "catalog.toml").write_text(
        f'default = "{default}"\nreleases = {releases}\n\n[[fix]]\n'
        'id = "demo"\ntitle = "t"\nsymptom = "s"\nmodels = []\nlayouts = []\n'
        "upstream = []\n" + textwrap.dedent(fix),
        encoding="utf-8",
    )
    for release, name in (backports or {}).items():
        (root / f"vllm-{release}").mkdir(exist_ok=True)
        (root / f"vllm-{release}" / name).write_text("a patch\n", encoding="utf-8")
    return root


FULL = """\
affected = ["1.1.0", "1.2.0"]
fixed_upstream = "1.3.0"
not_affected = "no such code"
bug = "the bug"
path = "the path"
upstream_fix = "upstream's fix"
"""


def statuses(root: Path) -> dict[str, tuple[S, str]]:
    fix = catalog_.load(root).fix("demo")
    return {r: (c.status, c.reason) for r, c in fix.releases.items()}


def test_every_status_is_derived_from_the_range_the_upstream_fix_and_the_backports(
    tmp_path: Path,
):
    root = write(tmp_path, FULL, {"1.1.0": "0001-demo.patch"})
    assert statuses(root) == {
        "1.0.0": (S.NOT_AFFECTED, "no such code"),
        "1.1.0": (S.PATCHED, "the bug"),
        "1.2.0": (S.AFFECTED, "the bug"),  # in range, no backport: the honest answer
        "1.3.0": (S.UPSTREAM, "upstream's fix"),
        "1.4.0": (S.UPSTREAM, "upstream's fix"),
    }
    loaded = catalog_.load(root)
    claim = loaded.fix("demo").on("1.1.0")
    assert (claim.patches, claim.path, claim.since) == (("0001-demo.patch",), "the path", None)
    assert loaded.fix("demo").on("1.2.0").path == "the path"
    assert loaded.fix("demo").on("1.4.0").since == "1.3.0"
    assert loaded.series("1.1.0").patches == ("0001-demo.patch",)
    assert loaded.series("1.2.0").patches == ()
    assert loaded.default == "1.4.0"


OPEN_PR = (
    '\n[fix.origin]\nkind = "pull-request"\nurl = "https://github.com/vllm-project/vllm/pull/7"\n'
)


def test_a_bug_not_fixed_upstream_affects_every_release_from_the_first(tmp_path: Path):
    root = write(
        tmp_path, 'affected = ["1.2.0", "1.4.0"]\nnot_affected = "n"\nbug = "b"\n' + OPEN_PR
    )
    assert [s for s, _ in statuses(root).values()] == [
        S.NOT_AFFECTED,
        S.NOT_AFFECTED,
        S.AFFECTED,
        S.AFFECTED,
        S.AFFECTED,
    ]


def test_one_release_overrides_a_reason_or_is_judged_not_affected(tmp_path: Path):
    fix = FULL + (
        '\n[fix.releases]\n"1.4.0" = { reason = "moved" }\n'
        '"1.2.0" = { not_affected = "a GPU run: never reached" }\n'
    )
    root = write(tmp_path, fix, {"1.1.0": "0001-demo.patch"})
    got = statuses(root)
    assert got["1.2.0"] == (S.NOT_AFFECTED, "a GPU run: never reached")
    assert got["1.4.0"] == (S.UPSTREAM, "moved")
    assert got["1.3.0"] == (S.UPSTREAM, "upstream's fix")


@pytest.mark.parametrize(
    ("fix", "backports", "message"),
    [
        (FULL, {"1.0.0": "0001-demo.patch"}, "is not-affected, yet vllm-1.0.0/0001-demo.patch"),
        (FULL, {"1.3.0": "0001-demo.patch"}, "is upstream, yet vllm-1.3.0/0001-demo.patch"),
        (FULL, {"1.1.0": "0001-other.patch"}, "is not a backport"),
        (FULL, {"1.1.0": "series"}, "is not a backport"),
        (FULL, {"0.9.0": "0001-demo.patch"}, "which is not a release"),
        (FULL.replace('fixed_upstream = "1.3.0"', 'fixed_upstream = "1.2.0"'), {}, "cannot affect"),
        (FULL.replace('["1.1.0", "1.2.0"]', '["1.2.0", "1.1.0"]'), {}, "is empty"),
        (FULL.replace('["1.1.0", "1.2.0"]', '["1.1.0"]'), {}, "[first, last]"),
        (FULL.replace('bug = "the bug"\n', ""), {}, "say why with 'bug'"),
        (FULL.replace('not_affected = "no such code"\n', ""), {}, "with 'not_affected'"),
        (FULL.replace('upstream_fix = "upstream\'s fix"\n', ""), {}, "with 'upstream_fix'"),
        (FULL.replace('path = "the path"\n', ""), {"1.1.0": "0001-demo.patch"}, "('path')"),
        (FULL + '\n[fix.releases]\n"1.0.0" = { path = "p" }\n', {}, "releases that have the bug"),
        (FULL + '\n[fix.releases]\n"1.0.0" = { status = "patched" }\n', {}, "unknown key(s)"),
        (FULL + '\n[fix.releases]\n"2.0.0" = { reason = "r" }\n', {}, "unknown release 2.0.0"),
        (FULL.replace("affected = ", "afected = "), {}, "malformed (KeyError: 'affected')"),
    ],
)
def test_contradictory_facts_are_refused_naming_the_fix(
    tmp_path: Path, fix: str, backports: dict[str, str], message: str
):
    root = write(tmp_path, fix, backports)
    with pytest.raises(catalog_.CatalogError) as error:
        catalog_.load(root)
    assert message in str(error.value)


UNFIXED = 'affected = ["1.2.0", "1.4.0"]\nnot_affected = "n"\nbug = "b"\n'


def test_each_fix_says_where_it_comes_from(tmp_path: Path):
    """Upstream's release (fixed_upstream), upstream's open pull request, or ours."""
    merged = catalog_.load(write(tmp_path / "a", FULL)).fix("demo").origin
    assert (merged.kind, merged.release, merged.ahead) == ("merged", "1.3.0", False)
    assert merged.describe() == "upstream, merged in vLLM 1.3.0"
    pull = catalog_.load(
        write(tmp_path / "b", UNFIXED + OPEN_PR + 'tests = ["tests/t.py::test_x"]\n')
    ).fix("demo")
    assert (pull.origin.kind, pull.origin.ahead) == ("pull-request", True)
    assert pull.origin.tests == ("tests/t.py::test_x",)
    assert "pull/7" in pull.origin.describe() and "no release" in pull.origin.describe()
    ours = catalog_.load(
        write(tmp_path / "c", UNFIXED + '\n[fix.origin]\nkind = "ours"\nnote = "why"\n')
    ).fix("demo")
    assert (ours.origin.kind, ours.origin.note, ours.origin.ahead) == ("ours", "why", True)
    assert ours.origin.describe() == "ours: no upstream fix yet"


@pytest.mark.parametrize(
    ("fix", "message"),
    [
        (UNFIXED, "say where it comes from in [fix.origin]"),
        (FULL + OPEN_PR, "fixed upstream in 1.3.0: that is its origin; drop [fix.origin]"),
        (UNFIXED + '\n[fix.origin]\nkind = "merged"\n', "kind is pull-request or ours"),
        (UNFIXED + '\n[fix.origin]\nkind = "pull-request"\n', "names it as url ="),
        (
            UNFIXED + '\n[fix.origin]\nkind = "pull-request"\nurl = "https://example.org/1"\n',
            "names it as url =",
        ),
        (UNFIXED + OPEN_PR.replace("pull-request", "ours"), "has no pull request url"),
        (UNFIXED + OPEN_PR + 'tests = ["test_x"]\n', "is not tests/FILE::function"),
        (UNFIXED + OPEN_PR + 'merged_in = "1.4.0"\n', "unknown key(s) merged_in"),
    ],
)
def test_an_origin_that_contradicts_the_facts_is_refused(tmp_path: Path, fix: str, message: str):
    with pytest.raises(catalog_.CatalogError) as error:
        catalog_.load(write(tmp_path, fix))
    assert message in str(error.value) and "fix demo" in str(error.value)


def test_fixes_ahead_of_upstream_in_the_real_catalog():
    """Every fix the default release needs from mla-serve alone is one whose upstream fix is
    in no release (an open pull request, or none), and the catalog says which."""
    for fix in CATALOG.fixes:
        assert fix.origin.ahead is (fix.fixed_upstream is None), fix.id
        if fix.origin.kind == "pull-request":
            assert fix.origin.url and fix.origin.url in fix.upstream, fix.id
            assert fix.origin.note, fix.id  # what of the pull request was followed
    ahead = {f.id for f in CATALOG.fixes if f.on(CATALOG.default).status is S.PATCHED}
    assert ahead and all(CATALOG.fix(i).origin.ahead for i in ahead)


@pytest.mark.parametrize(
    ("default", "releases", "message"),
    [
        ("2.0.0", RELEASES, "the default release '2.0.0' is not one of the releases"),
        ("1.0.0", '["1.1.0", "1.0.0"]', "oldest first"),
        ("1.0.0", '["1.0.0", "1.0.0"]', "oldest first"),
        ("1.0.0", '["1.0.0", "one"]', "'one' is not a release number"),
    ],
)
def test_the_releases_and_the_default_are_checked(
    tmp_path: Path, default: str, releases: str, message: str
):
    root = write(tmp_path, 'affected = []\nnot_affected = "n"\n', {}, default, releases)
    with pytest.raises(catalog_.CatalogError, match=message):
        catalog_.load(root)


def test_the_real_catalog_states_each_reason_once():
    """No fix repeats a reason per release that its fix-level field already says."""
    text = (CATALOG.root / "catalog.toml").read_text(encoding="utf-8")
    for fix in CATALOG.fixes:
        for reason in {c.reason for c in fix.releases.values()}:
            assert text.count(json.dumps(reason, ensure_ascii=False)) == 1, (fix.id, reason)


def test_each_fix_is_found_from_its_id():
    """Its probe is the module named after it, its backports the files named after it."""
    assert set(probes.PROBES) == {f.id for f in CATALOG.fixes}
    for fix in CATALOG.fixes:
        module = "mla_serve.patching.probes." + fix.id.replace("-", "_")
        assert probes.PROBES[fix.id].__module__ == module, fix.id
        for release in CATALOG.releases:
            for patch in fix.on(release).patches:
                assert patch.endswith(f"-{fix.id}.patch"), (release, patch)


# ---- the fourth status and the one-line verdict, on a real tree -----------------------


def private_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "patches"
    shutil.copytree(CATALOG.root, root)
    monkeypatch.setenv("MLA_SERVE_PATCHES", str(root))
    return root


def test_a_release_without_a_backport_is_affected_applied_and_verified_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """Remove 0.28.0's backport of dcp-empty-shard-mask: 0.28.0 becomes `affected`, the
    rest of its series applies, and the manifest, status and verify say the bug is there."""
    root = private_catalog(tmp_path, monkeypatch)
    (root / "vllm-0.28.0" / "0003-dcp-empty-shard-mask.patch").unlink()
    claim = catalog_.load(root).fix("dcp-empty-shard-mask").on("0.28.0")
    assert claim.status is S.AFFECTED and claim.path and not claim.patches

    target = trees.clone("0.28.0", tmp_path / "tree")
    code, out, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 0, err
    assert "dcp-empty-shard-mask             affected         probe fail" in out
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    row = next(f for f in document["fixes"] if f["id"] == "dcp-empty-shard-mask")
    assert (row["status"], row["probe"], row["patches"]) == ("affected", "fail", [])
    assert "0003-dcp-empty-shard-mask.patch" not in document["series"]["patches"]
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0
    assert labels_problems(document, "0.28.0") == []  # an image may say so in its labels

    code, out, err = run(capsys, "patches", "status", "--target", target)
    assert code == 1  # the bug is there, as the catalog says: not a tree to serve unawares
    assert err.splitlines()[0].startswith(
        "AFFECTED dcp-empty-shard-mask: vLLM 0.28.0 has the bug and mla-serve carries no backport"
    )
    assert "patches apply" not in err  # it would not help: there is no backport to apply
    row_text = next(line for line in out.splitlines() if line.startswith("dcp-empty-shard-mask"))
    assert row_text.split()[1:4] == ["n/a", "AFFECTED:fail", "patched"]
    assert "AFFECTED = the release has the bug and mla-serve carries no backport" in out


def test_affected_claims_are_proven_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """A tree whose probe passes where the catalog says `affected` is refused by apply and
    reported by verify: the catalog would be wrong about it."""
    target = trees.clone("0.28.0", tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0  # the fix is in
    root = private_catalog(tmp_path, monkeypatch)
    (root / "vllm-0.28.0" / "0003-dcp-empty-shard-mask.patch").unlink()
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1
    assert "DRIFT dcp-empty-shard-mask: probe passes, but the catalog says 0.28.0 is affected" in (
        err
    )
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 2 and "Traceback" not in err
    assert "the catalog says vLLM 0.28.0 has these bugs (no backport), but the probes" in err


def test_the_0_27_1_verdict_holds_and_a_backport_beside_it_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """0.27.1's dsv4-indexer-capture-shortcut is a verdict (the H200 run of
    tests/gpu/test_dsv4_capture_path.py): one line of the catalog. The probe finds the
    shortcut there but reachable only in eager-break regions, which proves the verdict (and
    only a verdict: see test_unreachable_proves_only_a_verdict); a backport left beside a
    verdict is refused by the loader, which names the file to delete."""
    claim = CATALOG.fix("dsv4-indexer-capture-shortcut").on("0.27.1")
    assert claim.status is S.NOT_AFFECTED and claim.verdict and "H200" in claim.reason
    assert not any("dsv4-indexer" in name for name in CATALOG.series("0.27.1").patches)

    root = private_catalog(tmp_path, monkeypatch)
    backport = "vllm-0.27.1/0004-dsv4-indexer-capture-shortcut.patch"
    (root / backport).write_text(
        (root / "vllm-0.27.1" / "0001-dcp-workspace-sizing.patch").read_text()
    )
    with pytest.raises(catalog_.CatalogError, match=f"yet {backport} backports it: delete"):
        catalog_.load(root)
    (root / backport).unlink()

    target = trees.clone("0.27.1", tmp_path / "tree")
    code, out, err = run(capsys, "patches", "apply", "--target", target)
    assert code == 0, err
    assert "dsv4-indexer-capture-shortcut    not-affected     probe unreachable" in out
    document = json.loads((target / "vllm" / manifest.FILENAME).read_text())
    row = next(f for f in document["fixes"] if f["id"] == "dsv4-indexer-capture-shortcut")
    assert (row["status"], row["probe"]) == ("not-affected", "unreachable")
    assert "eager_break_during_capture" in row["probe_detail"]
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0
    assert labels_problems(document, "0.27.1") == []
    row["status"] = "upstream"  # "unreachable" bears out a verdict only
    assert any("probe unreachable" in p for p in labels_problems(document, "0.27.1"))


def test_unreachable_proves_only_a_verdict():
    unreachable = probes.ProbeResult(False, "code there, not reached", unreachable=True)
    failing = probes.ProbeResult(False, "bug")
    passing = probes.ProbeResult(True, "fixed")
    verdict = catalog_.ReleaseStatus(S.NOT_AFFECTED, "GPU run", verdict=True)
    by_range = catalog_.ReleaseStatus(S.NOT_AFFECTED, "no such code")
    assert probes.proves(verdict, unreachable) and probes.proves(verdict, passing)
    assert not probes.proves(verdict, failing)
    assert not probes.proves(by_range, unreachable) and probes.proves(by_range, passing)
    for status in (S.PATCHED, S.UPSTREAM):
        claim = catalog_.ReleaseStatus(status, "r")
        assert probes.proves(claim, passing) and not probes.proves(claim, unreachable)
    affected = catalog_.ReleaseStatus(S.AFFECTED, "the bug")
    assert probes.proves(affected, failing) and not probes.proves(affected, passing)


def test_list_verbose_gives_the_reason_for_every_cell(capsys: pytest.CaptureFixture[str]):
    """The table's footer says `--verbose` tells why a cell is n/a: for every fix, each
    release's status is printed with its reason (n/a, patched, upstream and verdicts alike),
    and every release where the bug is with the code path that reaches it."""
    code, out, _ = run(capsys, "patches", "list")
    assert code == 0 and "--verbose says why" in out
    code, out, _ = run(capsys, "patches", "list", "--verbose")
    assert code == 0
    blocks = {block.split(":", 1)[0]: block for block in out.split("\n\n")}
    label = {S.NOT_AFFECTED: "n/a", S.PATCHED: "patched", S.UPSTREAM: "upstream"}
    label[S.AFFECTED] = "AFFECTED"
    for fix in CATALOG.fixes:
        block = blocks[fix.id]
        for release in CATALOG.releases:
            claim = fix.on(release)
            lines = [
                line.strip()
                for line in block.splitlines()
                if line.startswith(f"  {label[claim.status]} ") and line.endswith(claim.reason)
            ]
            assert len(lines) == 1, (fix.id, release, claim.reason)
            assert _names(lines[0].split(":", 1)[0], release), (fix.id, release, lines[0])
            if claim.path:
                assert any(
                    line.startswith("  path ")
                    and line.endswith(claim.path)
                    and _names(line.split(":", 1)[0], release)
                    for line in block.splitlines()
                ), (fix.id, release)
    verdict = CATALOG.fix("dsv4-indexer-capture-shortcut").on("0.27.1")
    assert f"  n/a 0.27.1 (verdict): {verdict.reason}" in out


def _names(head: str, release: str) -> bool:
    """Whether `n/a 0.27.1, 0.30.0-0.33.0 (verdict)` names `release` (in a run or alone)."""
    key = catalog_._version_key
    for first, last in re.findall(r"(\d+\.\d+\.\d+)(?:-(\d+\.\d+\.\d+))?", head):
        if key(first) <= key(release) <= key(last or first):
            return True
    return False


def test_patches_list_shows_each_fixs_origin(capsys: pytest.CaptureFixture[str]):
    code, out, _ = run(capsys, "patches", "list", "--format", "json")
    assert code == 0
    origins = {f["id"]: f["origin"] for f in json.loads(out)["fixes"]}
    assert origins["dcp-workspace-sizing"]["kind"] == "merged"
    assert origins["dcp-workspace-sizing"]["release"] == "0.30.0"
    pull = origins["kv-cache-memory-suggestion"]
    assert (pull["kind"], pull["ahead_of_upstream"]) == ("pull-request", True)
    assert pull["pull_request"] == "https://github.com/vllm-project/vllm/pull/57983"
    assert pull["pull_request_tests"] == [
        "tests/v1/worker/test_gpu_worker.py::test_kv_cache_suggestion_does_not_double_count_cudagraph"
    ]
    code, out, _ = run(capsys, "patches", "list", "--verbose")
    block = out[out.index("kv-cache-memory-suggestion: ") :]
    assert (
        "  origin:   upstream pull request open (https://github.com/vllm-project/vllm/pull/57983)"
        in block
    )
    assert "the pull request's, not run here:" in block
