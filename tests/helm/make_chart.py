"""`make chart`: render and lint the chart with Helm's own engine (helm-python-sdk), no cluster.

For the defaults and each profile (or the value files given with `--values`, layered like
`helm install -f A -f B`): `helm lint --strict` (values.schema.json, the templates' own checks),
then the render `helm template` would print, written to build/chart/<name>.yaml with its NOTES
beside it. One line per case; a lint error or a refused render is printed as Helm gives it and
the command exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import helm_python as helm
import yaml

from tests.helm.helm_support import (
    CASES,
    CHART,
    NAMESPACE,
    NOTES,
    PROFILES,
    RELEASE,
    REPO,
    documents,
    golden_text,
    load_values,
    render,
)

KUBE_VERSION = "v1.31.0"  # the chart's floor (Chart.yaml kubeVersion)


def check(name: str, files: list[Path], out: Path) -> bool:
    """Lint and render one case; print one line (and Helm's messages); True when clean."""
    values = load_values(files)
    report = helm.lint(
        str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=KUBE_VERSION
    )
    problems = [*report["errors"], *report["messages"]]
    try:
        rendered = render(values)
    except Exception as error:  # Helm's engine reports a refused render as an exception
        print(f"{name}: refused: {str(error).strip().splitlines()[-1]}")
        for problem in problems:
            print(f"  lint: {problem}")
        return False
    kinds = Counter(doc["kind"] for doc in documents(rendered))
    target = out / f"{name}.yaml"
    target.write_text(golden_text(rendered))
    (out / f"{name}.NOTES.txt").write_text(rendered.get(NOTES, ""))
    summary = ", ".join(f"{count} {kind}" if count > 1 else kind for kind, count in kinds.items())
    state = "lint clean" if not problems else f"lint: {len(problems)} problem(s)"
    shown = target.relative_to(REPO) if target.is_relative_to(REPO) else target
    print(f"{name}: {state}; {summary} -> {shown}")
    for problem in problems:
        print(f"  {problem}")
    return not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make chart",
        description="Render and lint helm/mla-serve with Helm's engine: the defaults and every "
        "profile, or your own value files (CHART_VALUES='a.yaml b.yaml').",
    )
    parser.add_argument(
        "--values",
        type=Path,
        nargs="*",
        default=[],
        metavar="FILE",
        help="value files layered over the defaults, as `helm install -f A -f B` (instead of "
        "the profiles)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "build" / "chart", help="where renders go"
    )
    args = parser.parse_args(argv)
    for path in args.values:
        if not path.is_file():
            print(f"make chart: error: {path}: no such file", file=sys.stderr)
            return 2
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            print(f"make chart: error: {path}: not YAML: {error}", file=sys.stderr)
            return 2
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = (
        {"values": [path.resolve() for path in args.values]}
        if args.values
        else {"default": CASES["default"], **{p: CASES[f"profile-{p}"] for p in PROFILES}}
    )
    count = f"{len(cases)} case{'s' if len(cases) > 1 else ''}"
    print(f"helm lint --strict and render of {CHART.relative_to(REPO)} ({count})")
    clean = [check(name, files, args.out) for name, files in cases.items()]
    print(f"{sum(clean)} of {len(clean)} clean; release {RELEASE!r}, namespace {NAMESPACE!r}")
    return 0 if all(clean) else 1


if __name__ == "__main__":
    sys.exit(main())
