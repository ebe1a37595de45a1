"""vLLM's own tests for each fix, fetched from its source distribution and run unchanged.

The catalog (`[fix.upstream_tests]`) names, per fix, the release whose sdist carries the
fix's final form and the tests (`tests/FILE::function`) to take from it. This module
downloads that sdist once (cached in .cache/sdists, its sha256 checked against the index),
extracts only the named files (cached in .cache/upstream-tests/<release>/), and runs them
with pytest `--noconftest` against a vLLM tree, reporting each test's outcome.

The package index is the one pip is configured with (`pip config`, PIP_INDEX_URL), else
pip's own default; extra indexes are tried after it. Only the index's simple page
(PEP 691 JSON, else PEP 503 HTML) is read, as `pip download` of an sdist would try to
build it. Used by tests/test_upstream_suite.py here and, on the GPU machine (no network),
from the files `make gpu-pack` carries (tests/gpu/run.sh).
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mla_serve.patching import catalog as catalog_

ROOT = Path(__file__).resolve().parent.parent

CACHE = Path(os.environ.get("MLA_SERVE_CACHE", ROOT / ".cache"))
TIMEOUT_S = 60  # per network read
REPORTER = Path(__file__).resolve().parent / "upstream_report.py"


class UpstreamError(Exception):
    """The sdist could not be found, fetched or read."""


# --- the index ------------------------------------------------------------------------


def index_urls() -> list[str]:
    """The simple-index URLs pip would use: its configured index (or default), then extras."""
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    primary: str | None = os.environ.get("PIP_INDEX_URL")
    extras = os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    for line in found.stdout.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url") and primary is None:
            primary = value
        elif key.endswith(".extra-index-url"):
            extras.extend(value.split())
    if primary is None:
        from pip._internal.models.index import PyPI

        primary = PyPI.simple_url
    return [primary, *dict.fromkeys(e for e in extras if e != primary)]


@dataclass(frozen=True)
class Link:
    url: str
    sha256: str | None


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.hrefs.append((data.strip(), self._href))
            self._href = None


def _find_link(index: str, filename: str) -> Link | None:
    page = index.rstrip("/") + "/vllm/"
    request = urllib.request.Request(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            kind = response.headers.get("Content-Type", "")
            body = response.read()
    except (OSError, ValueError):
        return None
    if "json" in kind:
        for entry in json.loads(body)["files"]:
            if entry["filename"] == filename:
                url = urllib.parse.urljoin(page, entry["url"])
                return Link(url, entry.get("hashes", {}).get("sha256"))
        return None
    anchors = _Anchors()
    anchors.feed(body.decode("utf-8", "replace"))
    for text, href in anchors.hrefs:
        if text == filename:
            url = urllib.parse.urljoin(page, href)
            fragment = urllib.parse.urlparse(url).fragment
            sha = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
            return Link(url.split("#", 1)[0], sha)
    return None


def sdist(release: str) -> Path:
    """vLLM `release`'s source distribution, downloaded once into .cache/sdists."""
    filename = f"vllm-{release}.tar.gz"
    target = CACHE / "sdists" / filename
    if target.is_file():
        return target
    indexes = index_urls()
    link = next((found for i in indexes if (found := _find_link(i, filename))), None)
    if link is None:
        raise UpstreamError(f"{filename} is on none of pip's indexes ({len(indexes)} tried)")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as partial:
        try:
            with urllib.request.urlopen(link.url, timeout=TIMEOUT_S) as response:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    partial.write(chunk)
        except OSError as error:
            os.unlink(partial.name)
            raise UpstreamError(f"cannot download {filename}: {error}") from None
    if link.sha256 and digest.hexdigest() != link.sha256:
        os.unlink(partial.name)
        raise UpstreamError(f"{filename}: sha256 {digest.hexdigest()} is not the index's")
    os.replace(partial.name, target)
    return target


def extract(release: str, files: tuple[str, ...]) -> Path:
    """The named files of the sdist (and the package __init__ files above them), once."""
    dest = CACHE / "upstream-tests" / release
    wanted = set(files)
    for name in files:
        parts = Path(name).parts[:-1]
        wanted |= {str(Path(*parts[:i], "__init__.py")) for i in range(1, len(parts) + 1)}
    missing = {name for name in wanted if not (dest / name).is_file()}
    if not missing - {n for n in wanted if n.endswith("__init__.py")}:
        return dest
    prefix = f"vllm-{release}/"
    got: set[str] = set()
    with tarfile.open(sdist(release), "r:gz") as archive:
        for member in archive:
            name = member.name.removeprefix(prefix)
            if member.isfile() and name in wanted:
                member.name = name
                archive.extract(member, dest, filter="data")
                got.add(name)
    absent = {n for n in wanted - got if not n.endswith("__init__.py")}
    if absent:
        raise UpstreamError(f"vllm-{release}.tar.gz has no {', '.join(sorted(absent))}")
    return dest


# --- what to run and what to expect -------------------------------------------------------


@dataclass(frozen=True)
class Case:
    fix: str
    test: str  # tests/FILE::function, or tests/FILE:: for the whole file
    sdist: str
    expect: str  # "pass" or "fail"


def cases(catalog: catalog_.Catalog, release: str, state: str, kind: str) -> list[Case]:
    """The upstream tests of `kind` for this tree, with the outcome the catalog implies."""
    found = []
    for fix in catalog.fixes:
        tests = fix.upstream_tests
        claim = fix.on(release)
        if tests is None or claim.status is catalog_.Status.NOT_AFFECTED:
            continue
        fixed = claim.status is catalog_.Status.UPSTREAM or (
            state == "patched" and claim.status is catalog_.Status.PATCHED
        )
        expect = "pass" if fixed or not tests.shows_bug else "fail"
        found += [Case(fix.id, t, tests.sdist, expect) for t in tests.selected(kind, release)]
    return found


def run(tree: Path, selected: list[Case], report: Path, timeout: int = 900) -> dict[str, str]:
    """Run the cases against `tree` (one pytest per sdist and kind of selection).

    Files are passed whole and functions chosen with -k: a node id in a file that does
    not import would make pytest stop before running the other files.
    """
    outcomes: dict[str, str] = {}
    merged: dict[str, dict[str, str]] = {"tests": {}, "collect": {}, "why": {}}
    groups: dict[tuple[str, bool], list[Case]] = {}
    for case in selected:
        groups.setdefault((case.sdist, case.test.endswith("::")), []).append(case)
    for (release, whole), group in groups.items():
        root = (CACHE / "upstream-tests" / release).resolve()
        files = list(dict.fromkeys(c.test.split("::", 1)[0] for c in group))
        select = [] if whole else ["-k", " or ".join(c.test.split("::", 1)[1] for c in group)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tree), str(root), str(REPORTER.parent), os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep),
            "MLA_SERVE_UPSTREAM_REPORT": str(report),
        }
        report.unlink(missing_ok=True)
        # -c os.devnull: none of this repository's pytest configuration, which pytest would
        # find above a cache inside the checkout; its pythonpath (the root) would put the
        # package `tests` of this repository before upstream's.
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-c", os.devnull, "--noconftest",
             "-p", "upstream_report", "-p", "no:cacheprovider",
             "--continue-on-collection-errors", "-q", "-rfEs",
             "-W", "ignore::DeprecationWarning", "--rootdir", str(root), *select, *files],
            cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        recorded = json.loads(report.read_text()) if report.is_file() else {}
        for key, part in merged.items():  # every group's, not only the last one's
            part.update(recorded.get(key, {}))
        for case in group:
            outcomes[case.test] = outcome(case.test.removesuffix("::"), recorded)
        if not recorded:
            raise UpstreamError(f"pytest reported nothing:\n{child.stdout[-2000:]}{child.stderr}")
    report.write_text(json.dumps(merged, indent=1))
    return outcomes


def outcome(node: str, recorded: dict[str, dict[str, str]]) -> str:
    """passed / failed / skipped / missing for one requested test, from the reporter's file."""
    path = node.split("::", 1)[0]
    collected = recorded.get("collect", {}).get(path)
    if collected == "failed":
        return "failed"  # the file did not import: the test cannot pass
    if collected == "skipped":
        return "skipped"  # the file skipped itself (pytest.skip at module level)

    tests = recorded.get("tests", {})
    runs = [result for nodeid, result in tests.items() if requested(nodeid, node)]
    if not runs:
        return "missing"
    if "failed" in runs:
        return "failed"
    if "skipped" in runs:
        return "skipped"
    return "passed"


def requested(nodeid: str, node: str) -> bool:
    """Whether pytest's `nodeid` is (a parametrization of) the requested test, or a test of
    the requested file (`node` without `::`)."""
    if "::" not in node:  # a whole file
        return nodeid.startswith(node + "::")
    return nodeid == node or nodeid.startswith(node + "[")


def why(node: str, recorded: dict[str, dict[str, str]]) -> str | None:
    """The end of pytest's report of the requested test's failure (or its file's), if any."""
    path = node.split("::", 1)[0]
    found = [text for nodeid, text in recorded.get("why", {}).items()
             if nodeid == path or requested(nodeid, node)]  # fmt: skip
    return found[0] if found else None


def verdict(case: Case, got: str) -> str | None:
    """None when the outcome is what the catalog implies, else why not."""
    if case.expect == "pass" and got == "passed":
        return None
    if case.expect == "fail" and got == "failed":
        return None
    return f"{case.fix}: {case.test} {got}, expected to {case.expect}"


def main(argv: list[str]) -> int:
    """`python -m tests.upstream gpu --tree DIR --release R --state S --out FILE` (from the
    repository root): the GPU cases of a tree, run from the files `make gpu-pack` carried,
    with a JSON verdict per case."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("kind", choices=("cpu", "gpu"))
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--release", required=True)
    parser.add_argument("--state", required=True, choices=("pristine", "patched"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    selected = cases(catalog_.load(), args.release, args.state, args.kind)
    args.out = args.out.resolve()  # the child pytest runs elsewhere: its report path too
    report = args.out.with_suffix(".report.json")
    outcomes = run(args.tree.resolve(), selected, report)
    recorded = json.loads(report.read_text())
    rows = [
        {"fix": c.fix, "test": c.test, "sdist": c.sdist, "expect": c.expect,
         "outcome": outcomes[c.test], "ok": verdict(c, outcomes[c.test]) is None,
         "why": why(c.test.removesuffix("::"), recorded)}
        for c in selected
    ]  # fmt: skip
    args.out.write_text(json.dumps({"release": args.release, "state": args.state,
                                    "cases": rows}, indent=2) + "\n")  # fmt: skip
    for row in rows:
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['fix']}: {row['test']} {row['outcome']}"
              f" (expected to {row['expect']})")  # fmt: skip
        reason = row["why"]
        if not row["ok"] and isinstance(reason, str):
            print("    " + "\n    ".join(reason.splitlines()[-15:]))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
