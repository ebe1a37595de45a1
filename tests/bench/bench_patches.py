"""`make bench`: time apply + verify of a full series on unpacked wheel trees.

Target: under 2 s for apply + verify of a full series. Each run gets
a fresh hard-link clone of the pristine tree; the figures are medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mla_serve.patching import catalog, engine, manifest, tree
from tests import trees

TARGET_SECONDS = 2.0


def one_run(release: str, scratch: Path) -> tuple[float, float]:
    target = trees.clone(release, scratch / "tree")
    cat = catalog.load()
    start = time.perf_counter()
    found = tree.locate(target)
    plan = engine.plan(found, cat)
    states = engine.check(plan, cat)
    engine.write(plan)
    manifest.write(manifest.default_path(found), manifest.build(plan, states))
    applied = time.perf_counter()
    drifts = manifest.verify(found, manifest.read(manifest.default_path(found)), cat)
    verified = time.perf_counter()
    assert not drifts, drifts
    return applied - start, verified - applied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    cat = catalog.load()
    # Each release with a series, and the default release even while its series is empty.
    releases = list(dict.fromkeys([*trees.PATCHED_RELEASES, trees.DEFAULT_RELEASE]))
    results = []
    for release in releases:
        trees.pristine(release)  # unpack outside the timed region
        applies, verifies = [], []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as scratch:
                a, v = one_run(release, Path(scratch))
            applies.append(a)
            verifies.append(v)
        total = statistics.median(a + v for a, v in zip(applies, verifies, strict=True))
        results.append(
            {
                "release": release,
                "patches": len(cat.series(release).patches),
                "apply_s_median": round(statistics.median(applies), 4),
                "verify_s_median": round(statistics.median(verifies), 4),
                "apply_plus_verify_s_median": round(total, 4),
                "target_s": TARGET_SECONDS,
                "meets_target": total < TARGET_SECONDS,
            }
        )
        print(
            f"vLLM {release}: {len(cat.series(release).patches)} patches, apply+verify "
            f"median {total * 1000:.0f} ms over {args.runs} runs (target < 2 s)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "patch series apply + verify on unpacked wheel trees",
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "cpus": __import__("os").cpu_count(),
                    "python": platform.python_version(),
                },
                "runs": args.runs,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"results: {args.out}")
    return 0 if all(r["meets_target"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
