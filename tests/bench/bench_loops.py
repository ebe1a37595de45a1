"""`make bench`: what the runaway guard (mla_serve/sidecar/guard/loops.py) costs the sidecar.

1. The sidecar process: the same streamed load through a sidecar with `--loop-action off` and
   one with `--loop-action observe` (the default), in alternating rounds, against the fast
   vLLM 0.33.0 stand-in of bench_passthrough (passthrough/upstream.py) and its load generator
   (passthrough/loadgen.py, production mode: --streams streams at --rate tokens/s, one chunk
   per token, each chunk in its own read, as vLLM streams). The CPU time of each sidecar
   process over its rounds, per 1000 chunks relayed. Target: observe costs at most 20 % more
   than off. The stand-in's tokens (`"<seq>@<t> "`, about 20 characters, never periodic) make
   the guard check at almost every chunk; real tokens (about 4 characters) make it check
   every fourth one, so this is the expensive case of ordinary text.
2. The hot path alone, in this process: an exchange's response path over the same chat
   chunks (a read each: the token shape, the guard's tokens) with no
   guard and with an observing guard, in CPU microseconds per 1000 chunks, for ordinary text
   (4-character tokens of a long non-periodic reasoning) and for a looping stream. Reported,
   not judged: it leaves out the network and ASGI work that dominates (1).

Results: --out (JSON) and a summary. Exit 1 when the target is missed or not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from mla_serve.sidecar.guard.loops import LoopGuard, LoopPolicy
from mla_serve.sidecar.passthrough.classify import Request
from mla_serve.sidecar.passthrough.exchange import Exchange
from mla_serve.sidecar.passthrough.phases import Phase
from mla_serve.sidecar.passthrough.runaways import Ledger
from mla_serve.sidecar.passthrough.service import PassThrough
from mla_serve.sidecar.settings import Settings
from tests.bench.bench_passthrough import LOADGEN, MODEL, ROOT, UPSTREAM, run_loadgen
from tests.bench.passthrough import proxies
from tests.bench.passthrough.procs import Proc, wait_http
from tests.http_server import free_port
from tests.loop_corpus import LEGIT, LOOPS, stream

TARGET_GROWTH = 0.20


def process_cost(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    bin_dir = Path(sys.executable).parent
    upstream_port = free_port()
    upstream = Proc(
        "upstream", [*UPSTREAM, "--port", str(upstream_port)], work / "upstream.log", cwd=ROOT
    ).start()
    sidecars: dict[str, proxies.Target] = {}
    try:
        wait_http(upstream, f"http://127.0.0.1:{upstream_port}/health", 30)
        for action in ("off", "observe"):
            sidecars[action] = proxies.start_sidecar(
                bin_dir, upstream_port, work, ["--loop-action", action], f"-{action}"
            )
            proxies.wait_ready(sidecars[action], 60)
        rounds: dict[str, list[dict[str, Any]]] = {"off": [], "observe": []}
        options = [
            "--streams", str(args.streams), "--rate", str(args.rate),
            "--tokens", str(args.tokens), "--ramp", "1",
        ]  # fmt: skip
        for index in range(args.rounds):
            order = ("off", "observe") if index % 2 == 0 else ("observe", "off")
            for action in order:
                target = sidecars[action]
                other = sidecars["observe" if action == "off" else "off"]
                assert target.proc is not None and other.proc is not None
                other.proc.pause(True)  # its health polling stays out of this round
                before = target.proc.cpu_seconds()
                result = run_loadgen("production", target, options, 600, None)
                cpu = target.proc.cpu_seconds() - before
                other.proc.pause(False)
                chunks = int(result["chunks_received"])
                rounds[action].append(
                    {
                        "cpu_s": round(cpu, 3),
                        "chunks": chunks,
                        "cpu_ms_per_1000_chunks": round(1e6 * cpu / chunks, 3) if chunks else None,
                        "streams_failed": result["streams_failed"],
                        "elapsed_s": result["elapsed_s"],
                    }
                )
                print(f"  round {index + 1} {action}: {rounds[action][-1]}", flush=True)
    finally:
        for target in sidecars.values():
            if target.proc is not None:
                target.proc.stop()
        upstream.stop()
    per = {
        action: statistics.median(
            r["cpu_ms_per_1000_chunks"] for r in found if r["cpu_ms_per_1000_chunks"]
        )
        for action, found in rounds.items()
    }
    return {
        "load": {
            "streams": args.streams,
            "rate": args.rate,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "loadgen": str(LOADGEN.relative_to(ROOT)),
        },
        "rounds": rounds,
        "cpu_ms_per_1000_chunks": {k: round(v, 3) for k, v in per.items()},  # medians
        "range_ms_per_1000_chunks": {
            action: [
                min(r["cpu_ms_per_1000_chunks"] for r in found),
                max(r["cpu_ms_per_1000_chunks"] for r in found),
            ]
            for action, found in rounds.items()
        },
        "growth": round(per["observe"] / per["off"] - 1, 4),
        "failed_streams": sum(r["streams_failed"] for found in rounds.values() for r in found),
    }


def sse(chunks: list[dict[str, Any]]) -> list[bytes]:
    return [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks]


def chat_chunks(text: str) -> list[dict[str, Any]]:
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL}  # fmt: skip
    first = {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    return [first] + [
        {
            **head,
            "choices": [
                {"index": 0, "delta": {"reasoning": piece}, "logprobs": None, "finish_reason": None}
            ],
        }
        for piece in stream(text, (4,))
    ]


def hot_path(repeat: int) -> dict[str, Any]:
    texts = {
        "ordinary_text": LEGIT["long_reasoning"][1] * 4,
        "looping_text": LOOPS["paragraph"][1],
    }
    return asyncio.run(_hot_path(texts, repeat))


async def _hot_path(texts: dict[str, str], repeat: int) -> dict[str, Any]:
    registry = CollectorRegistry()
    guard = LoopGuard(LoopPolicy(action="observe"), registry)
    # The sidecar's own exchange, as it runs per read of vLLM's stream (no network here).
    service = PassThrough(Settings(vllm_url="http://127.0.0.1:9"), Ledger(registry, "bench_"),
                          guard, registry)  # fmt: skip
    out: dict[str, Any] = {}
    for name, text in texts.items():
        events = sse(chat_chunks(text))
        timings: dict[str, list[float]] = {"off": [], "observe": []}
        for _ in range(repeat):
            for mode in ("off", "observe"):
                exchange = Exchange(service, _Front(), b"POST", "/v1/chat/completions", b"", [],
                                    "", b"http")  # fmt: skip
                watch = None
                if mode == "observe":
                    watch = guard.watch({"model": MODEL, "max_tokens": 100000},
                                        "/v1/chat/completions")  # fmt: skip
                exchange.request = Request(model=MODEL, stream=True, guard=watch)
                exchange.phase = Phase.SENT  # as if its request went out
                piece = exchange.head(200, [(b"content-type", b"text/event-stream")])
                started = time.process_time()
                for event in events:
                    piece(event)
                    exchange.fed()
                timings[mode].append(time.process_time() - started)
                exchange.close()
        per = {m: 1e9 * min(t) / len(events) for m, t in timings.items()}  # µs per 1000
        out[name] = {
            "chunks": len(events),
            "cpu_us_per_1000_chunks": {m: round(v, 1) for m, v in per.items()},
            "growth": round(per["observe"] / per["off"] - 1, 4),
        }
    return out


class _Front:
    """Where the exchange's bytes would go: nowhere (the guard's cost is what is measured)."""

    direct = False
    ready = True

    def start(
        self, status: int, headers: list[tuple[bytes, bytes]], length: bool, close: bool
    ) -> None:
        pass

    def write(self, data: bytes) -> bool:
        return False

    def finish(self, data: bytes) -> None:
        pass

    def cut(self) -> None:
        pass

    def answer(self, status: int, body: bytes, close: bool) -> None:
        pass

    def transport_write(self) -> Any:
        raise AssertionError


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--hot-path-repeat", type=int, default=5)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        },
        "target": {"observe_cpu_growth_at_most": TARGET_GROWTH},
    }
    print("hot path (in process):", flush=True)
    report["hot_path"] = hot_path(args.hot_path_repeat)
    print(json.dumps(report["hot_path"], indent=1), flush=True)
    ok = False
    print("sidecar process, off vs observe:", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-loops-") as work:
        try:
            report["process"] = process_cost(args, Path(work))
            ok = (
                report["process"]["growth"] <= TARGET_GROWTH
                and report["process"]["failed_streams"] == 0
            )
        except (RuntimeError, OSError, KeyError, ValueError) as error:
            report["process"] = {"error": f"{type(error).__name__}: {error}"}
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    report["passed"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    process = report["process"]
    if "error" in process:
        print(f"FAILED: {process['error']}")
    else:
        per = process["cpu_ms_per_1000_chunks"]
        print(
            f"sidecar CPU per 1000 chunks: off {per['off']} ms, observe {per['observe']} ms, "
            f"growth {100 * process['growth']:.1f} % (target <= {100 * TARGET_GROWTH:.0f} %)"
        )
    print(f"written: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
