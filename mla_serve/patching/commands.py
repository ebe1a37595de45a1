"""`mla-serve patches …`: list, status, apply, verify, repair, fetch, wheel, check-wheel,
deep-gemm."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mla_serve.patching import catalog as catalog_
from mla_serve.patching import (
    deep_gemm,
    diff,
    dist,
    engine,
    journal,
    manifest,
    probes,
    report,
    tree,
    wheel,
)


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    patches = commands.add_parser("patches", help="the sparse-MLA fix series")
    actions = patches.add_subparsers(dest="action", required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="every fix and its status in every release")
    listing.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: the table (default); json: every fix and release cell as one document",
    )
    listing.add_argument("--verbose", action="store_true", help="symptoms and references too")
    listing.set_defaults(run=_list)

    for name, run, text in (
        ("status", _status, "which fixes a vLLM tree has, proven by probes; 1 if one is not"),
        ("apply", _apply, "apply the release's series (all or nothing) and write the manifest"),
        ("verify", _verify, "check a patched tree against its manifest; non-zero on drift"),
        (
            "repair",
            _repair,
            "undo an interrupted apply; restore the series' content of files changed since",
        ),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument(
            "--target",
            type=Path,
            metavar="DIR",
            help="directory containing the vllm/ package (default: the installed vLLM)",
        )
        if name != "status":
            sub.add_argument(
                "--manifest",
                type=Path,
                metavar="FILE",
                help=f"manifest path (default: <target>/vllm/{manifest.FILENAME})",
            )
        if name == "status":
            sub.add_argument(
                "--format",
                choices=("text", "json"),
                default="text",
                help="text: one line per fix (default); json: the statuses as one document",
            )
        if name == "apply":
            sub.add_argument("--dry-run", action="store_true", help="check only, write nothing")
        sub.set_defaults(run=run)

    fetch = actions.add_parser("fetch", help="download a vLLM wheel (cached) and unpack it")
    fetch.add_argument("--vllm-version", required=True, metavar="X.Y.Z")
    fetch.add_argument("--dest", type=Path, required=True, metavar="DIR")
    fetch.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        default=_wheel_cache(),
        help="wheel cache (default: $MLA_SERVE_WHEEL_CACHE or ~/.cache/mla-serve/wheels)",
    )
    fetch.add_argument("--python-only", action="store_true", help="skip compiled extensions")
    fetch.set_defaults(run=_fetch)
    _register_wheel(actions)
    deep_gemm.register(actions)  # `patches deep-gemm`: mla_serve/patching/deep_gemm.py


def _wheel_cache() -> Path:
    return Path(os.environ.get("MLA_SERVE_WHEEL_CACHE", "~/.cache/mla-serve/wheels")).expanduser()


def _register_wheel(actions: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    built = actions.add_parser(
        "wheel", help="write the release's vLLM wheel with the series applied (pip-installable)"
    )
    source = built.add_mutually_exclusive_group(required=True)
    source.add_argument("--vllm-version", metavar="X.Y.Z", help="fetch this release's wheel")
    source.add_argument("--wheel", type=Path, metavar="FILE", help="a vLLM wheel file to patch")
    built.add_argument("--arch", choices=wheel.ARCHES, default="x86_64", help="with --vllm-version")
    built.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        default=_wheel_cache(),
        help="wheel cache (default: $MLA_SERVE_WHEEL_CACHE or ~/.cache/mla-serve/wheels)",
    )
    built.add_argument(
        "--out", type=Path, default=Path("dist"), metavar="DIR", help="default: ./dist"
    )
    built.set_defaults(run=_wheel)
    checking = actions.add_parser(
        "check-wheel", help="compare every file of a wheel with its RECORD; non-zero on mismatch"
    )
    checking.add_argument("wheel", type=Path, metavar="FILE")
    checking.set_defaults(run=_check_wheel)


def _wheel(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    if args.wheel is not None:
        source = args.wheel
    else:
        catalog.release_of(args.vllm_version)  # refuse unsupported releases before downloading
        dist.writable(args.out)  # and an output folder that cannot take the wheel
        source = wheel.fetch(args.vllm_version, args.cache, arch=args.arch)
    print(f"source: {source}")
    built = dist.build(source, args.out, catalog, progress=print)
    print(f"series vllm-{built.release}: digest {built.digest[:12]}")
    _print_states(built.states, status=True)
    changed = ", ".join(built.changed) or "no file"
    print(f"changed {changed}; added {dist.MANIFEST_MEMBER}")
    print(f"RECORD matches all {built.checked} files; version {built.version}")
    print(f"sha256: {built.sha256}")
    print(f"patched wheel: {built.path}")
    return 0


def _check_wheel(args: argparse.Namespace) -> int:
    problems, count = dist.check(args.wheel)
    if problems:
        for problem in problems:
            print(f"BAD {problem}", file=sys.stderr)
        print(f"{args.wheel} does not match its RECORD", file=sys.stderr)
        return 1
    print(f"{args.wheel}: all {count} files match RECORD")
    return 0


def _list(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    if args.format == "json":
        print(json.dumps(report.catalog_json(catalog), indent=2))
        return 0
    print(report.matrix(catalog))
    if args.verbose:
        print()
        print(report.details(catalog))
    return 0


def _status(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    found = tree.locate(args.target)
    if journal.journal_path(found).exists():
        print(
            f"WARNING: an apply on {found.root} was interrupted; run `mla-serve patches repair`",
            file=sys.stderr,
        )
    release = catalog.release_of(found.version)
    states = engine.Plan(tree=found, release=release, series=catalog.series(release)).states(
        catalog
    )
    if args.format == "json":
        print(json.dumps(report.states_json(found.version, release, states), indent=2))
    else:
        _describe(found, catalog.series(release))
        print(report.matrix(catalog, release, states))
        print("\n".join(report.ahead_lines(catalog, release)))
    problems = report.not_in_place(release, states)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        unapplied = any(
            s.status is catalog_.Status.PATCHED and not probes.proves(s.fix.on(release), s.probe)
            for s in states
        )
        hint = " (`mla-serve patches apply` applies the series)" if unapplied else ""
        print(
            f"vLLM {found.version} at {found.root}: {len(problems)} fix(es) not as the catalog "
            f"says{hint}",
            file=sys.stderr,
        )
        return 1
    return 0


def _apply(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    found = tree.locate(args.target)
    _describe(found, catalog.series(catalog.release_of(found.version)))
    path = args.manifest or manifest.default_path(found)
    if args.dry_run:
        if journal.journal_path(found).exists():
            print(f"dry run: an interrupted apply would be undone first ({JOURNAL_HINT})")
        elif _drift_refused(found, path):
            return 1
        plan = engine.plan(found, catalog)
        _print_states(engine.check(plan, catalog))
        changed = ", ".join(sorted(plan.changes)) or "nothing"
        print(f"dry run: would change {changed}")
        return 0
    with journal.locked(found):
        _recover(found, path, catalog)
        if _drift_refused(found, path):
            return 1
        plan = engine.plan(found, catalog)
        states = engine.check(plan, catalog)
        _print_states(states)
        written = engine.write(plan, (path, manifest.render(manifest.build(plan, states))))
    print(f"{len(written)} file(s) changed; manifest: {path}")
    return 0


JOURNAL_HINT = f"vllm/{journal.JOURNAL}"


def _drift_refused(found: tree.VllmTree, path: Path) -> bool:
    """Whether files of the tree differ from its manifest, which `apply` then refuses (it
    would record them as the series' result); says which, and what to do, on stderr."""
    try:
        _, drifts = manifest.drifted(found, path, reverted=False)
    except manifest.ManifestError as error:
        raise manifest.ManifestError(
            f"{error}; apply checks the tree against its manifest before writing: remove "
            "the manifest to apply afresh"
        ) from None
    for drift in drifts:
        print(f"DRIFT {drift.what}: {drift.detail}", file=sys.stderr)
    if drifts:
        print(
            f"vLLM {found.version} at {found.root}: {len(drifts)} file(s) changed since the "
            f"series was applied ({path}), neither its result nor the release's original; "
            "nothing written. `mla-serve patches repair` restores the series' content of "
            "these files (the changes are lost)",
            file=sys.stderr,
        )
    return bool(drifts)


def _print_states(states: list[engine.FixState], status: bool = False) -> None:
    """One line per fix: what `apply` did to the tree (applied, already-applied, ...), or with
    `status` the fix's status in the wheel, in the words of `patches list` (patched, upstream,
    not-affected, affected)."""
    for state in states:
        word = state.status.value if status else state.action
        print(f"  {state.fix.id:32} {word:16} probe {state.probe.word}")


def _recover(found: tree.VllmTree, path: Path, catalog: catalog_.Catalog) -> list[str] | None:
    """Under the lock: undo an interrupted apply, if any, and remove its leftovers."""
    series = catalog.series(catalog.release_of(found.version))
    names = sorted(
        {
            file_diff.path
            for patch in series.patches
            for file_diff in _parsed(series, patch)
            if _inside(found, file_diff.path)
        }
    )
    restored = journal.recover(found, path, names)
    if restored is not None:
        listed = ", ".join(restored) or "nothing had been written yet"
        print(f"undid an interrupted apply from its journal: restored {listed}")
    return restored


def _parsed(series: catalog_.Series, patch: str) -> list[diff.FileDiff]:
    try:
        return diff.parse(series.text(patch))
    except diff.DiffError:
        return []  # plan() reports it, naming the fix


def _inside(found: tree.VllmTree, name: str) -> bool:
    try:
        found.file(name)
    except tree.TreeError:
        return False  # plan() refuses it, naming the fix
    return True


def _repair(args: argparse.Namespace) -> int:
    """Undo an interrupted apply, then restore the series' content of every file changed
    since the manifest was written (from the originals it records), as one transaction."""
    catalog = catalog_.load()
    found = tree.locate(args.target)
    path = args.manifest or manifest.default_path(found)
    where = f"vLLM {found.version} at {found.root}"
    with journal.locked(found):
        restored = _recover(found, path, catalog)
        if restored is not None:
            print(f"{where} is as it was before the interrupted apply")
        document, drifts = manifest.drifted(found, path)
        if document is None or not drifts:
            if restored is None:
                print(f"{where}: no interrupted apply and no file changed since {path}")
            return 0
        for drift in drifts:
            print(f"DRIFT {drift.what}: {drift.detail}")
        plan = engine.plan(found, catalog, manifest.originals(found, document, catalog))
        states = engine.check(plan, catalog)
        written = engine.write(plan, (path, manifest.render(manifest.build(plan, states))))
    listed = ", ".join(written) or "no file"
    print(f"restored the series' content of {listed}; {where} matches {path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    found = tree.locate(args.target)
    path = args.manifest or manifest.default_path(found)
    drifts = manifest.verify(found, manifest.read(path), catalog)
    if drifts:
        for drift in drifts:
            print(f"DRIFT {drift.what}: {drift.detail}", file=sys.stderr)
        print(f"vLLM {found.version} at {found.root} does not match {path}", file=sys.stderr)
        return 1
    print(f"vLLM {found.version} at {found.root} matches {path}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    catalog = catalog_.load()
    catalog.release_of(args.vllm_version)  # refuse unsupported releases before downloading
    path = wheel.fetch(args.vllm_version, args.cache)
    print(f"wheel: {path}")
    wheel.unpack(path, args.dest, python_only=args.python_only, progress=print)
    print(f"tree: {args.dest}")
    return 0


def _describe(found: tree.VllmTree, series: catalog_.Series) -> None:
    commit = f" (commit {found.commit})" if found.commit else ""
    print(f"vLLM {found.version}{commit} at {found.root}")
    count = len(series.patches)
    print(f"series vllm-{series.release}: {count} patch(es), digest {series.digest[:12]}")


ERRORS = (
    catalog_.CatalogError,
    tree.TreeError,
    engine.PatchError,
    manifest.ManifestError,
    journal.JournalError,
    journal.WriteFailed,  # restoring a file while repairing: names the file and the reason
    wheel.WheelError,
    dist.DistError,
)
