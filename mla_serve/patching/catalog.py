"""The fix catalog (`patches/catalog.toml`) and the per-release series beside it.

The catalog says, for every fix and every supported release, whether the release
needs our patch (`patched`), already ships the fix (`upstream`), or never had the
affected code (`not-affected`). Each release folder `patches/vllm-<release>/`
holds a `series` file (application order) and the patch files it names. The two
must agree; `load()` refuses a catalog where they do not, so a mistake in the
data fails every command and every test instead of silently skipping a fix.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any


class CatalogError(Exception):
    """The catalog or a series is inconsistent, or a release is unknown."""


class Status(StrEnum):
    PATCHED = "patched"
    UPSTREAM = "upstream"
    NOT_AFFECTED = "not-affected"


@dataclass(frozen=True)
class ReleaseStatus:
    status: Status
    reason: str
    patches: tuple[str, ...] = ()
    since: str | None = None  # first release carrying the fix, for `upstream`
    path: str | None = None  # for `patched`: the code path that reaches the bug there
    modes: tuple[str, ...] = ()  # CUDA graph modes that reach it; empty: not mode-bound


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


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    symptom: str
    models: tuple[str, ...]
    layouts: tuple[str, ...]
    seeds: tuple[str, ...]
    upstream: tuple[str, ...]
    releases: dict[str, ReleaseStatus]
    upstream_tests: UpstreamTests | None = None

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
        directory = self.root / f"vllm-{release}"
        series_file = directory / "series"
        names = tuple(
            line.strip()
            for line in series_file.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        )
        digest = hashlib.sha256()
        digest.update(series_file.read_bytes())
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
    releases = tuple(data["releases"])
    fixes = tuple(_fix(entry, releases) for entry in data["fix"])
    catalog = Catalog(root=root, releases=releases, fixes=fixes)
    _check_series(catalog)
    return catalog


def _fix(entry: dict[str, Any], releases: tuple[str, ...]) -> Fix:
    fix_id = entry["id"]
    statuses: dict[str, ReleaseStatus] = {}
    for release in releases:
        raw = entry["releases"].get(release)
        if raw is None:
            raise CatalogError(f"fix {fix_id}: no status for release {release}")
        status = Status(raw["status"])
        patches = tuple(raw.get("patches", ()))
        if (status is Status.PATCHED) != bool(patches):
            raise CatalogError(f"fix {fix_id} on {release}: 'patched' and patch files go together")
        if status is Status.UPSTREAM and not raw.get("since"):
            raise CatalogError(f"fix {fix_id} on {release}: 'upstream' needs 'since'")
        if (status is Status.PATCHED) != bool(raw.get("path")):
            raise CatalogError(
                f"fix {fix_id} on {release}: 'patched' names the code path that reaches the bug"
                " ('path'), and only 'patched' does"
            )
        statuses[release] = ReleaseStatus(
            status,
            raw["reason"],
            patches,
            raw.get("since"),
            raw.get("path"),
            tuple(raw.get("modes", ())),
        )
    return Fix(
        id=fix_id,
        title=entry["title"],
        symptom=entry["symptom"],
        models=tuple(entry["models"]),
        layouts=tuple(entry["layouts"]),
        seeds=tuple(entry["seeds"]),
        upstream=tuple(entry["upstream"]),
        releases=statuses,
        upstream_tests=_upstream_tests(fix_id, entry.get("upstream_tests"), releases),
    )


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


def _check_series(catalog: Catalog) -> None:
    for release in catalog.releases:
        directory = catalog.root / f"vllm-{release}"
        if not (directory / "series").is_file():
            raise CatalogError(f"release {release} has no series file in {directory}")
        series = catalog.series(release)
        claimed = [p for fix in catalog.fixes for p in fix.on(release).patches]
        if sorted(claimed) != sorted(series.patches) or len(set(claimed)) != len(claimed):
            raise CatalogError(
                f"vllm-{release}/series lists {list(series.patches)} but the catalog "
                f"assigns {claimed}"
            )
        for name in series.patches:
            if not (directory / name).is_file():
                raise CatalogError(f"vllm-{release}/series names a missing file {name}")
