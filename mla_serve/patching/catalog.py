"""The fix catalog (`patches/catalog.toml`) and the backports beside it.

The catalog states each fact once: the supported releases and the default one, and per
fix the releases whose code has the bug (`affected = [first, last]`) and the first
release carrying upstream's fix (`fixed_upstream`). Every release's status is derived:
`upstream` from `fixed_upstream` on, `patched` inside the affected range where a backport
`patches/vllm-<release>/NNNN-<fix id>.patch` exists, `affected` inside the range without
one, `not-affected` elsewhere. A release's series (the patches applied to it, in file-name
order) is the set of its backports. `load()` refuses a catalog whose facts contradict each
other (a backport for a release the fix does not affect, a file that belongs to no fix), so
a mistake in the data fails every command and every test instead of silently skipping a fix.

`python -m mla_serve.patching.catalog default` prints the default release (Makefile,
docker/build.sh and docker/smoke.sh read it so).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class CatalogError(Exception):
    """The catalog or a backport is inconsistent, or a release is unknown."""


class Status(StrEnum):
    PATCHED = "patched"  # the release has the bug; our backport fixes it
    UPSTREAM = "upstream"  # the release ships upstream's fix
    NOT_AFFECTED = "not-affected"  # the release never had the bug
    AFFECTED = "affected"  # the release has the bug and mla-serve carries no backport


@dataclass(frozen=True)
class ReleaseStatus:
    status: Status
    reason: str
    patches: tuple[str, ...] = ()
    since: str | None = None  # first release carrying the fix, for `upstream`
    path: str | None = None  # the code path that reaches the bug there (patched, affected)
    modes: tuple[str, ...] = ()  # CUDA graph modes that reach it; empty: not mode-bound
    verdict: bool = False  # not-affected by a verdict ([fix.releases] not_affected), not the range


@dataclass(frozen=True)
class LeftOut:
    """An upstream test not run on some releases (all when `releases` is empty), and why."""

    test: str
    reason: str
    releases: tuple[str, ...] = ()

    def covers(self, release: str) -> bool:
        return not self.releases or release in self.releases


@dataclass(frozen=True)
class UpstreamTests:
    """vLLM's own tests for a fix, taken unchanged from the source distribution of `sdist`
    (the first release carrying the fix's final form). Each test is `path::function`."""

    sdist: str
    cpu: tuple[str, ...]
    gpu: tuple[str, ...]
    support: tuple[str, ...]  # other files of the sdist the tests import
    left_out: tuple[LeftOut, ...]
    shows_bug: bool = True  # False: a regression guard that passes with or without the fix
    note: str = ""

    def selected(self, kind: str, release: str) -> tuple[str, ...]:
        """The tests of `kind` (cpu or gpu) to run on `release`."""
        tests = self.cpu if kind == "cpu" else self.gpu
        return tuple(
            t for t in tests if not any(o.test == t and o.covers(release) for o in self.left_out)
        )

    def files(self) -> tuple[str, ...]:
        """Every file of the sdist these tests need."""
        names = {t.split("::", 1)[0] for t in (*self.cpu, *self.gpu)} | set(self.support)
        return tuple(sorted(names))


class OriginKind(StrEnum):
    MERGED = "merged"  # upstream's fix ships in a release (`fixed_upstream`)
    PULL_REQUEST = "pull-request"  # upstream has a fix in an open pull request
    OURS = "ours"  # no upstream fix yet: the fix is mla-serve's own


@dataclass(frozen=True)
class Origin:
    """Where a fix comes from: upstream's release that merged it, upstream's open pull
    request, or mla-serve with no upstream fix yet. `tests` names the pull request's own
    tests (not run here: CI reaches package registries only, and an open pull request's
    tests are in no source distribution)."""

    kind: OriginKind
    release: str | None = None  # merged: the first release carrying the fix
    url: str | None = None  # pull-request: the pull request
    tests: tuple[str, ...] = ()
    note: str = ""

    @property
    def ahead(self) -> bool:
        """The fix is in no vLLM release: mla-serve carries it ahead of upstream."""
        return self.kind is not OriginKind.MERGED

    def describe(self) -> str:
        if self.kind is OriginKind.MERGED:
            return f"upstream, merged in vLLM {self.release}"
        if self.kind is OriginKind.PULL_REQUEST:
            return f"upstream pull request open ({self.url}), in no release yet"
        return "ours: no upstream fix yet"


@dataclass(frozen=True)
class Regression:
    """The fix undone in the default release's code: `old`, found once in `file`, replaced
    by `new`, on the release as shipped where it carries upstream's fix, or on it with its
    series applied where mla-serve patches it. The fix's probe must fail on the result."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    symptom: str
    models: tuple[str, ...]
    layouts: tuple[str, ...]
    upstream: tuple[str, ...]
    releases: dict[str, ReleaseStatus]
    upstream_tests: UpstreamTests | None = None
    affected: tuple[str, ...] = ()  # (first, last) release whose code has the bug; () none
    fixed_upstream: str | None = None  # first release carrying upstream's fix
    regression: Regression | None = None
    origin: Origin = Origin(OriginKind.OURS)

    def on(self, release: str) -> ReleaseStatus:
        return self.releases[release]


@dataclass(frozen=True)
class Series:
    """The ordered patch files of one release, with a digest of their bytes."""

    release: str
    directory: Path
    patches: tuple[str, ...]
    digest: str

    def text(self, patch: str) -> str:
        return (self.directory / patch).read_bytes().decode("utf-8")


@dataclass(frozen=True)
class Catalog:
    root: Path
    releases: tuple[str, ...]
    fixes: tuple[Fix, ...]
    default: str = ""  # the release make dist, the image and the chart use
    backports: dict[str, tuple[str, ...]] = field(default_factory=dict)  # release -> files

    def fix(self, fix_id: str) -> Fix:
        for fix in self.fixes:
            if fix.id == fix_id:
                return fix
        raise CatalogError(f"unknown fix {fix_id!r}")

    def release_of(self, version: str) -> str:
        """The supported release a version string belongs to, or a clear refusal."""
        release = version.split("+", 1)[0]  # local builds: 0.33.0+cu130 is 0.33.0
        if release not in self.releases:
            raise CatalogError(
                f"vLLM {version} is not a supported release; supported: " + ", ".join(self.releases)
            )
        return release

    def series(self, release: str) -> Series:
        """The release's backports in file-name order, and their digest: sha256 over the
        series text (one name a line) and each name with its bytes."""
        self.release_of(release)
        directory = self.root / f"vllm-{release}"
        names = self.backports.get(release, ())
        digest = hashlib.sha256()
        digest.update("".join(f"{name}\n" for name in names).encode())
        for name in names:
            digest.update(name.encode() + b"\0" + (directory / name).read_bytes())
        return Series(release, directory, names, digest.hexdigest())

    def fix_of_patch(self, release: str, patch: str) -> Fix:
        for fix in self.fixes:
            if patch in fix.on(release).patches:
                return fix
        raise CatalogError(f"vllm-{release}/{patch} belongs to no fix")


def default_root() -> Path:
    """Where the catalog lives: $MLA_SERVE_PATCHES, the installed copy, or the checkout."""
    override = os.environ.get("MLA_SERVE_PATCHES")
    if override:
        return Path(override)
    packaged = Path(__file__).resolve().parent.parent / "_patches"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "patches"


def load(root: Path | None = None) -> Catalog:
    root = root or default_root()
    path = root / "catalog.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"no fix catalog at {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise CatalogError(f"{path}: {error}") from None
    try:
        return _catalog(root, data)
    except (KeyError, TypeError, ValueError) as error:  # a missing key or a wrong type
        raise CatalogError(f"{path}: malformed ({type(error).__name__}: {error})") from None


def _catalog(root: Path, data: dict[str, Any]) -> Catalog:
    releases = tuple(data["releases"])
    keys = [_version_key(r) for r in releases]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise CatalogError("releases must be listed once each, oldest first")
    default = data.get("default")
    if not isinstance(default, str) or default not in releases:
        raise CatalogError(f"the default release {default!r} is not one of the releases")
    ids = [entry["id"] for entry in data["fix"]]
    if len(set(ids)) != len(ids):
        raise CatalogError("a fix id is used twice")
    backports = _backports(root, releases, ids)
    fixes = tuple(_fix(entry, releases, backports) for entry in data["fix"])
    series = {
        release: tuple(name for name, _ in sorted(backports.get(release, {}).items()))
        for release in releases
    }
    return Catalog(root, releases, fixes, default, series)


_BACKPORT = re.compile(r"^[0-9]{4}-(?P<fix>[a-z0-9][a-z0-9-]*)\.patch$")


def _backports(root: Path, releases: tuple[str, ...], ids: list[str]) -> dict[str, dict[str, str]]:
    """release -> {patch file: fix id}, from the files of patches/vllm-<release>/."""
    found: dict[str, dict[str, str]] = {}
    for directory in sorted(root.glob("vllm-*")):
        release = directory.name.removeprefix("vllm-")
        if release not in releases:
            raise CatalogError(f"{directory} is for vLLM {release}, which is not a release")
        files: dict[str, str] = {}
        for path in sorted(directory.iterdir()):
            match = _BACKPORT.match(path.name)
            if not path.is_file() or match is None or match["fix"] not in ids:
                raise CatalogError(
                    f"{path} is not a backport: a release folder holds only "
                    "NNNN-<fix id>.patch files of the catalog's fixes"
                )
            if match["fix"] in files.values():
                raise CatalogError(f"{directory} holds two backports of {match['fix']}")
            files[path.name] = match["fix"]
        found[release] = files
    return found


def _version_key(release: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in release.split("."))
    except (AttributeError, ValueError):
        raise CatalogError(f"{release!r} is not a release number (X.Y.Z)") from None


_RELEASE_KEYS = {"reason", "path", "modes", "not_affected"}


def _fix(
    entry: dict[str, Any], releases: tuple[str, ...], backports: dict[str, dict[str, str]]
) -> Fix:
    fix_id = entry["id"]
    affected = tuple(entry["affected"])
    if len(affected) not in (0, 2):
        raise CatalogError(f"fix {fix_id}: affected is [first, last] or [] (no release)")
    first, last = (_version_key(r) for r in affected) if affected else ((), ())
    if affected and first > last:
        raise CatalogError(f"fix {fix_id}: affected range {affected[0]}..{affected[1]} is empty")
    fixed = entry.get("fixed_upstream")
    if fixed is not None and affected and _version_key(fixed) <= last:
        raise CatalogError(
            f"fix {fix_id}: fixed upstream in {fixed}, so it cannot affect {affected[1]}"
        )
    overrides: dict[str, dict[str, Any]] = entry.get("releases", {})
    for release, override in overrides.items():
        if release not in releases:
            raise CatalogError(f"fix {fix_id}: [fix.releases] names unknown release {release}")
        if not set(override) <= _RELEASE_KEYS:
            unknown = ", ".join(sorted(set(override) - _RELEASE_KEYS))
            raise CatalogError(f"fix {fix_id} on {release}: unknown key(s) {unknown}")
    statuses: dict[str, ReleaseStatus] = {}
    for release in releases:
        key = _version_key(release)
        override = overrides.get(release, {})
        patches = tuple(p for p, owner in backports.get(release, {}).items() if owner == fix_id)
        verdict = override.get("not_affected")
        if fixed is not None and key >= _version_key(fixed):
            status, reason = Status.UPSTREAM, override.get("reason", entry.get("upstream_fix"))
        elif affected and first <= key <= last and verdict is None:
            status = Status.PATCHED if patches else Status.AFFECTED
            reason = override.get("reason", entry.get("bug"))
        else:
            status = Status.NOT_AFFECTED
            reason = verdict or override.get("reason", entry.get("not_affected"))
        claim = _claim(fix_id, release, status, reason, patches, fixed, entry, override)
        statuses[release] = claim
    return Fix(
        id=fix_id,
        title=entry["title"],
        symptom=entry["symptom"],
        models=tuple(entry["models"]),
        layouts=tuple(entry["layouts"]),
        upstream=tuple(entry["upstream"]),
        releases=statuses,
        upstream_tests=_upstream_tests(fix_id, entry.get("upstream_tests"), releases),
        affected=affected,
        fixed_upstream=fixed,
        regression=_regression(fix_id, entry.get("regression")),
        origin=_origin(fix_id, entry.get("origin"), fixed),
    )


_REASON_KEY = {
    Status.UPSTREAM: "upstream_fix",
    Status.PATCHED: "bug",
    Status.AFFECTED: "bug",
    Status.NOT_AFFECTED: "not_affected",
}


def _claim(
    fix_id: str,
    release: str,
    status: Status,
    reason: str | None,
    patches: tuple[str, ...],
    fixed: str | None,
    entry: dict[str, Any],
    override: dict[str, Any],
) -> ReleaseStatus:
    """One release's derived status, its reason, and the facts that go with it."""
    where = f"fix {fix_id} on {release}"
    if patches and status is not Status.PATCHED:
        raise CatalogError(
            f"{where} is {status.value}, yet vllm-{release}/{patches[0]} backports it: "
            "delete the backport, or correct the fix's affected range"
        )
    if not reason:
        raise CatalogError(f"{where} is {status.value}: say why with '{_REASON_KEY[status]}'")
    in_range = status in (Status.PATCHED, Status.AFFECTED)
    if not in_range and ("path" in override or "modes" in override):
        raise CatalogError(f"{where}: 'path' and 'modes' are for releases that have the bug")
    path = override.get("path", entry.get("path")) if in_range else None
    if status is Status.PATCHED and not path:
        raise CatalogError(f"{where}: 'patched' names the code path that reaches the bug ('path')")
    modes = tuple(override.get("modes", entry.get("modes", ()))) if in_range else ()
    since = fixed if status is Status.UPSTREAM else None
    verdict = status is Status.NOT_AFFECTED and "not_affected" in override
    return ReleaseStatus(status, reason, patches, since, path, modes, verdict)


_PULL_REQUEST = re.compile(r"^https://github\.com/vllm-project/vllm/pull/[0-9]+$")
_ORIGIN_KEYS = {"kind", "url", "tests", "note"}


def _origin(fix_id: str, raw: dict[str, Any] | None, fixed: str | None) -> Origin:
    """A fix's origin: `fixed_upstream` says upstream merged it (then [fix.origin] must be
    absent); otherwise [fix.origin] says whether a pull request is open or the fix is ours."""
    where = f"fix {fix_id}"
    if fixed is not None:
        if raw is not None:
            raise CatalogError(
                f"{where} is fixed upstream in {fixed}: that is its origin; drop [fix.origin]"
            )
        return Origin(OriginKind.MERGED, release=fixed)
    if raw is None:
        raise CatalogError(
            f"{where} has no upstream release with the fix: say where it comes from in "
            '[fix.origin] (kind = "pull-request" with its url, or kind = "ours")'
        )
    if not set(raw) <= _ORIGIN_KEYS:
        unknown = ", ".join(sorted(set(raw) - _ORIGIN_KEYS))
        raise CatalogError(f"{where}: [fix.origin] has unknown key(s) {unknown}")
    kind = raw.get("kind")
    url = raw.get("url")
    tests = tuple(raw.get("tests", ()))
    if kind == OriginKind.PULL_REQUEST:
        if not isinstance(url, str) or not _PULL_REQUEST.match(url):
            raise CatalogError(
                f"{where}: an origin of kind pull-request names it as "
                'url = "https://github.com/vllm-project/vllm/pull/N"'
            )
    elif kind == OriginKind.OURS:
        if url is not None or tests:
            raise CatalogError(f"{where}: an origin of kind ours has no pull request url or tests")
    else:
        raise CatalogError(
            f"{where}: [fix.origin] kind is pull-request or ours (merged fixes say "
            f"fixed_upstream), not {kind!r}"
        )
    for test in tests:
        if "::" not in test or not test.startswith("tests/"):
            raise CatalogError(f"{where}: pull request test {test!r} is not tests/FILE::function")
    return Origin(OriginKind(kind), url=url, tests=tests, note=raw.get("note", ""))


def _regression(fix_id: str, raw: dict[str, str] | None) -> Regression | None:
    if raw is None:
        return None
    regression = Regression(raw["file"], raw["old"], raw["new"])
    if not regression.file.startswith("vllm/") or regression.old == regression.new:
        raise CatalogError(f"fix {fix_id}: a regression changes `old` to `new` in a vllm/ file")
    return regression


def _upstream_tests(
    fix_id: str, raw: dict[str, Any] | None, releases: tuple[str, ...]
) -> UpstreamTests | None:
    if raw is None:
        return None
    tests = UpstreamTests(
        sdist=raw["sdist"],
        cpu=tuple(raw.get("cpu", ())),
        gpu=tuple(raw.get("gpu", ())),
        support=tuple(raw.get("support", ())),
        left_out=tuple(
            LeftOut(o["test"], o["reason"], tuple(o.get("releases", ())))
            for o in raw.get("left_out", ())
        ),
        shows_bug=raw.get("shows_bug", True),
        note=raw.get("note", ""),
    )
    if tests.sdist not in releases:
        raise CatalogError(f"fix {fix_id}: upstream tests from unknown release {tests.sdist}")
    for test in (*tests.cpu, *tests.gpu):
        if "::" not in test or not test.startswith("tests/"):
            raise CatalogError(f"fix {fix_id}: upstream test {test!r} is not tests/FILE::function")
    for left in tests.left_out:
        if not set(left.releases) <= set(releases):
            raise CatalogError(f"fix {fix_id}: left-out test {left.test} names unknown releases")
    return tests


def main(argv: list[str] | None = None) -> int:
    """`python -m mla_serve.patching.catalog default|releases`: for make and shell scripts."""
    args = sys.argv[1:] if argv is None else argv
    if args not in (["default"], ["releases"]):
        print("usage: python -m mla_serve.patching.catalog default|releases", file=sys.stderr)
        return 2
    try:
        catalog = load()
    except CatalogError as error:
        print(f"mla-serve catalog: {error}", file=sys.stderr)
        return 2
    print(catalog.default if args == ["default"] else " ".join(catalog.releases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
