"""Human and JSON renderings of the catalog and of a tree's fix states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mla_serve.patching import probes
from mla_serve.patching.catalog import Catalog, Fix, Origin, ReleaseStatus, Status, UpstreamTests
from mla_serve.patching.engine import FixState

_SHORT = {
    "patched": "patched",
    "upstream": "upstream",
    "not-affected": "n/a",
    "affected": "AFFECTED",
}


def matrix(
    catalog: Catalog, current: str | None = None, states: list[FixState] | None = None
) -> str:
    """Fix-by-release table; the `current` release's column also shows probe results."""
    by_id = {s.fix.id: s for s in states or []}
    width = max(len(f.id) for f in catalog.fixes)
    headers = [f"[{r}]" if r == current else r for r in catalog.releases]
    cells = {
        fix.id: [
            _cell(fix.on(release).status.value, by_id.get(fix.id) if release == current else None)
            for release in catalog.releases
        ]
        for fix in catalog.fixes
    }
    widths = [
        max(len(h), *(len(cells[f.id][i]) for f in catalog.fixes)) for i, h in enumerate(headers)
    ]
    lines = [
        "fix".ljust(width)
        + "  "
        + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    ]
    for fix in catalog.fixes:
        row = "  ".join(c.ljust(w) for c, w in zip(cells[fix.id], widths, strict=True))
        lines.append(fix.id.ljust(width) + "  " + row)
    lines.append("n/a = not affected (the code is not there, or never reached: --verbose says why)")
    if any(c.startswith(_SHORT["affected"]) for row in cells.values() for c in row):
        lines.append("AFFECTED = the release has the bug and mla-serve carries no backport for it")
    return "\n".join(line.rstrip() for line in lines)


def _cell(status: str, state: FixState | None) -> str:
    label = _SHORT[status]
    return label if state is None else f"{label}:{state.probe.word}"


def not_in_place(release: str, states: list[FixState]) -> list[str]:
    """`patches status`: a line per fix that is not as the catalog says on the tree, or where
    the catalog says the release has a bug mla-serve does not fix (empty: all in place)."""
    lines = []
    for state in states:
        claim = state.fix.on(release)
        if claim.status is Status.AFFECTED:
            found = "the probe finds it fixed" if state.probe.passed else state.probe.detail
            lines.append(
                f"AFFECTED {state.fix.id}: vLLM {release} has the bug and mla-serve carries no "
                f"backport ({found})"
            )
        elif not probes.proves(claim, state.probe):
            lines.append(
                f"MISSING {state.fix.id} ({claim.status.value}): probe {state.probe.word}: "
                f"{state.probe.detail}"
            )
    return lines


def catalog_json(catalog: Catalog) -> dict[str, Any]:
    return {
        "releases": list(catalog.releases),
        "default": catalog.default,
        "fixes": [
            {
                "id": fix.id,
                "title": fix.title,
                "symptom": fix.symptom,
                "models": list(fix.models),
                "layouts": list(fix.layouts),
                "upstream": list(fix.upstream),
                "affected": list(fix.affected),
                "fixed_upstream": fix.fixed_upstream,
                "releases": {
                    release: {
                        "status": claim.status.value,
                        "reason": claim.reason,
                        "patches": list(claim.patches),
                        "since": claim.since,
                        "path": claim.path,
                        "modes": list(claim.modes),
                    }
                    for release, claim in fix.releases.items()
                },
                "upstream_tests": _upstream_tests_json(fix.upstream_tests),
                "origin": origin_json(fix.origin),
            }
            for fix in catalog.fixes
        ],
    }


# ---- where each fix comes from (catalog [fix.origin] / fixed_upstream) -----------------


def origin_json(origin: Origin) -> dict[str, Any]:
    return {
        "kind": origin.kind.value,
        "release": origin.release,
        "pull_request": origin.url,
        "pull_request_tests": list(origin.tests),
        "ahead_of_upstream": origin.ahead,
        "note": origin.note,
    }


def ahead(catalog: Catalog, release: str) -> list[Fix]:
    """The fixes mla-serve patches into `release` whose upstream fix is in no vLLM release."""
    return [
        fix
        for fix in catalog.fixes
        if fix.on(release).status is Status.PATCHED and fix.origin.ahead
    ]


def ahead_lines(catalog: Catalog, release: str) -> list[str]:
    """`patches status`: which of the tree's fixes are ours ahead of upstream, and why."""
    fixes = ahead(catalog, release)
    if not fixes:
        return [f"ahead of upstream: none (every fix vLLM {release} gets is in a vLLM release)"]
    lines = [f"ahead of upstream: {len(fixes)} fix(es) in no vLLM release yet"]
    lines += [f"  {fix.id}: {fix.origin.describe()}" for fix in fixes]
    return lines


def states_json(version: str, release: str, states: list[FixState]) -> dict[str, Any]:
    return {
        "vllm_version": version,
        "release": release,
        "fixes": [
            {
                "id": s.fix.id,
                "status": s.status.value,
                "probe": s.probe.word,
                "detail": s.probe.detail,
                "ahead_of_upstream": s.status is Status.PATCHED and s.fix.origin.ahead,
            }
            for s in states
        ],
    }


def _upstream_tests_json(tests: UpstreamTests | None) -> dict[str, Any] | None:
    if tests is None:
        return None
    return {
        "sdist": tests.sdist,
        "cpu": list(tests.cpu),
        "gpu": list(tests.gpu),
        "shows_bug": tests.shows_bug,
        "left_out": [
            {"test": o.test, "releases": list(o.releases), "reason": o.reason}
            for o in tests.left_out
        ],
        "note": tests.note,
    }


def _proof(tests: UpstreamTests | None, origin: Origin) -> list[str]:
    """`patches list --verbose`: the upstream tests that prove a fix, and those left out."""
    if tests is None and origin.tests:
        lines = ["  proven by: no released upstream test; the pull request's, not run here:"]
        lines += [f"    {name}" for name in origin.tests]
        return lines + ([f"    note: {origin.note}"] if origin.note else [])
    if tests is None:
        note = [f"    note: {origin.note}"] if origin.note else []
        return ["  proven by: no upstream test", *note]
    lines = [f"  proven by upstream's tests (vLLM {tests.sdist} sdist, run unchanged):"]
    for kind, names in (("cpu", tests.cpu), ("gpu", tests.gpu)):
        lines += [f"    {kind}  {name.removesuffix('::')}" for name in names]
    if not tests.shows_bug:
        lines.append("    (a regression guard: passes with or without the fix)")
    for left in tests.left_out:
        where = ", ".join(left.releases) or "every release"
        lines.append(f"    not on {where}: {left.test.split('::')[-1]}: {left.reason}")
    if tests.note:
        lines.append(f"    note: {tests.note}")
    return lines


def _grouped(
    catalog: Catalog, fix: Fix, key: Callable[[ReleaseStatus], object]
) -> list[tuple[str, ReleaseStatus]]:
    """The fix's releases grouped by `key` of their claims (first-seen order), each group
    named by its releases, a run of consecutive ones as `first-last`."""
    groups: dict[object, list[int]] = {}
    for index, release in enumerate(catalog.releases):
        groups.setdefault(key(fix.on(release)), []).append(index)
    named = []
    for indices in groups.values():
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        names = [
            catalog.releases[run[0]]
            if len(run) == 1
            else f"{catalog.releases[run[0]]}-{catalog.releases[run[-1]]}"
            for run in runs
        ]
        named.append((", ".join(names), fix.on(catalog.releases[indices[0]])))
    return named


def details(catalog: Catalog) -> str:
    """Each fix's title, symptom, references, why each release has its status (the reasons
    for n/a, patched, upstream and AFFECTED cells), the code path per release that has the bug
    and the upstream tests that prove it, for `patches list --verbose`."""
    blocks = []
    for fix in catalog.fixes:
        lines = [
            f"{fix.id}: {fix.title}",
            f"  symptom:  {fix.symptom}",
            f"  models:   {', '.join(fix.models)}",
            f"  layouts:  {', '.join(fix.layouts)}",
            f"  upstream: {', '.join(fix.upstream)}",
            f"  origin:   {fix.origin.describe()}",
        ]
        for releases, claim in _grouped(catalog, fix, lambda c: (c.status, c.reason, c.verdict)):
            verdict = " (verdict)" if claim.verdict else ""
            lines.append(f"  {_SHORT[claim.status.value]} {releases}{verdict}: {claim.reason}")
        for releases, claim in _grouped(catalog, fix, lambda c: (c.path, c.modes, c.status)):
            if claim.path:
                modes = f" [{', '.join(claim.modes)}]" if claim.modes else ""
                bare = " (AFFECTED: no backport)" if claim.status is Status.AFFECTED else ""
                lines.append(f"  path {releases}{modes}{bare}: {claim.path}")
        lines += _proof(fix.upstream_tests, fix.origin)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
