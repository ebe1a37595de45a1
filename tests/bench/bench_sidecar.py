"""`make bench`: latency of the sidecar's /metrics and /readyz with vLLM healthy.

Targets: a /metrics scrape within 10 ms and /readyz within 5 ms. The
sidecar serves a 4-rank engine state and a verified manifest, as in a TP4 pod;
vLLM is the stand-in of the tests. Figures are client-side latencies over
keep-alive connections on 127.0.0.1: median and p99.
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

import httpx

from mla_serve.engine import state
from mla_serve.sidecar.app import create_app
from mla_serve.sidecar.settings import Settings
from tests import trees
from tests.http_server import ServerThread
from tests.test_sidecar import _plugin_state
from tests.vllm_standin import StandIn

TARGETS_MS = {"/metrics": 10.0, "/readyz": 5.0}


def measure(client: httpx.Client, path: str, requests: int) -> dict[str, float]:
    for _ in range(50):  # warm-up
        client.get(path)
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        response = client.get(path)
        samples.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, response.text
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 3),
        "p99_ms": round(samples[int(len(samples) * 0.99) - 1], 3),
        "max_ms": round(samples[-1], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        target = trees.patched("0.29.0", work / "tree", work / "manifest.json")
        for rank in range(4):
            state.write(work / "state", _plugin_state(rank, "FULL_AND_PIECEWISE", 2_561_671_168))
        vllm = StandIn().start()
        settings = Settings(
            vllm_url=vllm.url,
            state_dir=work / "state",
            manifest=work / "manifest.json",
            vllm_tree=target,
        )
        sidecar = ServerThread(create_app(settings)).start()
        try:
            with httpx.Client(base_url=sidecar.url) as client:
                deadline = time.monotonic() + 30
                while client.get("/readyz").status_code != 200:
                    if time.monotonic() > deadline:
                        raise SystemExit("sidecar never became ready")
                    time.sleep(0.1)
                results = {path: measure(client, path, args.requests) for path in TARGETS_MS}
        finally:
            sidecar.stop()
            vllm.stop()
    ok = True
    for path, figures in results.items():
        target_ms = TARGETS_MS[path]
        figures["target_ms"] = target_ms
        figures["meets_target"] = figures["p99_ms"] <= target_ms
        ok &= figures["meets_target"]
        print(
            f"{path}: median {figures['median_ms']} ms, p99 {figures['p99_ms']} ms "
            f"(target {target_ms} ms)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "sidecar /metrics and /readyz latency, vLLM healthy, 4 ranks",
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"python": platform.python_version()},
                "requests": args.requests,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"results: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
