"""`make demo`: the sidecar, its metrics and the chart's alerts, on a laptop, without a GPU.

What runs, each a program of its own on 127.0.0.1 (logs in build/demo/):

- **vLLM's CPU stand-in** (`python -m tests.vllm_standin`): not vLLM. It speaks vLLM 0.33.0's
  OpenAI protocol exactly (routes, JSON, SSE chunks, `/metrics`) with scripted answers, because
  a real vLLM needs a GPU. It says so when it starts.
- **The sidecar** (`mla-serve sidecar`) in front of it, with vLLM 0.33.0's own tree (from the
  released wheel, as `make dist` uses it) patched by the fix series and the manifest of that
  patch run, which the sidecar verifies (hashes and probes) before it turns ready.
- **Prometheus** (Debian's `prometheus` package) loaded with the chart's own alert rules,
  rendered by Helm's engine from helm/mla-serve with `monitoring.prometheusRule.enabled`,
  scraping both `/metrics` with the labels the chart's PodMonitor gives them. So that an alert
  fires within a minute, the demo shortens the rules' windows and `for:` durations
  (`DEMO_RULES` below; the chart's defaults are 5-10 minute windows); it says so.
- **A scripted load** through the official `openai` client: ordinary answers, length-cap
  runaways (reasoning until `max_tokens`, no answer) and reasoning loops (the same paragraph
  over and over), streamed and not.

The stand-in stays in tests/ rather than in the package: it is a test double, and an installed
mla-serve should hold nothing that answers like vLLM without being vLLM; the demo runs from the
checkout, where the chart and the patched tree it needs are too.

It prints the URLs, follows the alerts until one fires, keeps a light load going, and stops
everything on Ctrl-C. `--until-firing` ends it once an alert fires (the test of it,
tests/test_demo.py, runs it so).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import yaml
from openai.types.chat import ChatCompletionMessageParam

from tests import trees
from tests.helm.helm_support import NAMESPACE, RELEASE, documents, find, render
from tests.http_server import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "glm-5.3-flash"
POD = f"{RELEASE}-demo-0"
# The chart's PodMonitor relabels each series with these; Kubernetes' discovery adds namespace
# and pod. Here the scrape configuration sets them, so the chart's rules select the series.
TARGET_LABELS = {
    "namespace": NAMESPACE,
    "pod": POD,
    "mla_serve_release": RELEASE,
    "mla_serve_role": "leader",
    "mla_serve_profile": "demo",
}
# Shorter windows and `for:` than the chart's defaults, so an alert fires within a minute.
DEMO_RULES: dict[str, Any] = {
    "runaways": {"window": "1m", "for": "10s"},
    "reasoningLoops": {"window": "1m", "for": "10s"},
    "upstreamFailures": {"window": "1m", "for": "10s"},
}
WATCHED = ("MlaServeLengthCapRunaways", "MlaServeReasoningLoops")
SCRAPE_SECONDS = 2


class DemoError(Exception):
    """Something the demo needs did not come up; the message says what and where to look."""


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


@dataclass
class Program:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])


@dataclass
class Demo:
    workdir: Path
    programs: list[Program] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> Program:
        log_path = self.workdir / f"{name}.log"
        log = log_path.open("wb")
        self._logs.append(log)
        # A session of its own: Ctrl-C in the terminal reaches the demo alone, which then
        # stops every program in order (they would otherwise die under it at once).
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
        )
        program = Program(name, process, log_path)
        self.programs.append(program)
        return program

    def stop(self) -> None:
        for program in reversed(self.programs):
            if program.alive():
                program.process.terminate()
        for program in reversed(self.programs):
            try:
                program.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                program.process.kill()
                program.process.wait(timeout=15)
        for log in self._logs:
            log.close()
        self.programs.clear()


def wait_for(what: str, check: Any, program: Program, seconds: float) -> Any:
    """Poll `check()` until it returns something truthy; DemoError after `seconds` or when
    the program it waits for exits."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not program.alive():
            raise DemoError(f"{program.name} exited: {program.tail()} ({program.log})")
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            found = check()
            if found:
                return found
        time.sleep(0.25)
    raise DemoError(f"{what} not within {seconds:.0f} s ({program.log})")


def mla_serve() -> list[str]:
    exe = Path(sys.executable).with_name("mla-serve")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mla_serve.cli"]


def rules() -> dict[str, Any]:
    """The chart's PrometheusRule `.spec` (a plain rule file), rendered by Helm's engine."""
    values = {"monitoring": {"prometheusRule": {"enabled": True, **DEMO_RULES}}}
    spec: dict[str, Any] = find(documents(render(values)), "PrometheusRule")["spec"]
    return spec


def prometheus_config(vllm: str, admin: str) -> dict[str, Any]:
    return {
        "global": {
            "scrape_interval": f"{SCRAPE_SECONDS}s",
            "evaluation_interval": f"{SCRAPE_SECONDS}s",
        },
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target], "labels": TARGET_LABELS}]}
            for job, target in (("vllm", vllm), ("mla-serve-sidecar", admin))
        ],
    }


def alerts(prometheus: str) -> dict[str, str]:
    """Each active alert of the demo's rules and its state (pending or firing)."""
    answer = httpx.get(f"{prometheus}/api/v1/alerts", timeout=5).json()
    return {a["labels"]["alertname"]: a["state"] for a in answer["data"]["alerts"]}


class Load:
    """Requests as users send them, through the pass-through with the `openai` client."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0, timeout=60)
        self.sent = {"answers": 0, "runaways": 0, "loops": 0}

    def _chat(self, text: str, max_tokens: int, stream: bool) -> None:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
        if stream:
            for _ in self.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, stream=True
            ):
                pass
        else:
            self.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens
            )

    def wave(self, number: int) -> None:
        for index in range(4):
            self._chat("What is sparse attention?", 64, stream=index % 2 == 0)
            self.sent["answers"] += 1
        self._chat("[runaway] Prove it step by step.", 256, stream=number % 2 == 0)
        self.sent["runaways"] += 1
        if number % 2 == 0:
            # the same paragraph of reasoning over and over, cut at max_tokens
            self._chat("[loop:paragraph] Why does my request never answer?", 2000, stream=True)
            self.sent["loops"] += 1


def run(args: argparse.Namespace) -> int:
    workdir = ROOT / "build" / "demo"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    demo = Demo(workdir)
    try:
        release = trees.DEFAULT_RELEASE
        say(
            f"vLLM {release}'s tree with its fix series applied, and the manifest of that run "
            f"(the first run downloads vLLM {release}'s wheel into .cache/, about 340 MB)"
        )
        started = time.monotonic()
        tree = trees.patched(release, workdir / "vllm-tree", workdir / "manifest.json")
        say(f"patched in {time.monotonic() - started:.1f} s: {tree.relative_to(ROOT)}")
        time.sleep(1.1)  # the verifier trusts no file written within a second of its check
        return _serve(demo, args, tree, workdir)
    except KeyboardInterrupt:
        say("Ctrl-C: stopping")
        return 130
    except DemoError as error:
        print(f"demo: error: {error}", file=sys.stderr, flush=True)
        return 1
    except (httpx.HTTPError, openai.OpenAIError) as error:
        gone = [f"{p.name} exited ({p.log})" for p in demo.programs if not p.alive()]
        why = "; ".join(gone) or f"{type(error).__name__}: {error}"
        print(f"demo: error: {why}", file=sys.stderr, flush=True)
        return 1
    finally:
        demo.stop()
        say("stopped: the stand-in, the sidecar and Prometheus")


def _serve(demo: Demo, args: argparse.Namespace, tree: Path, workdir: Path) -> int:
    ports = {name: free_port() for name in ("vllm", "pass-through", "admin", "prometheus")}
    vllm_url = f"http://127.0.0.1:{ports['vllm']}"
    passthrough = f"http://127.0.0.1:{ports['pass-through']}"
    admin = f"http://127.0.0.1:{ports['admin']}"
    prometheus_url = f"http://127.0.0.1:{ports['prometheus']}"

    standin = demo.start(
        "vllm-standin",
        [sys.executable, "-m", "tests.vllm_standin", "--port", str(ports["vllm"]),
         "--model", MODEL, "--token-delay", "0.002"],
    )  # fmt: skip
    banner = wait_for(
        "the stand-in's banner",
        lambda: next(iter(standin.log.read_text().splitlines()), ""),
        standin,
        30,
    )
    say(banner)
    wait_for("the stand-in", lambda: httpx.get(f"{vllm_url}/health").status_code == 200,
             standin, 30)  # fmt: skip

    sidecar = demo.start(
        "sidecar",
        [*mla_serve(), "sidecar", "--vllm-url", vllm_url, "--host", "127.0.0.1",
         "--port", str(ports["pass-through"]), "--admin-port", str(ports["admin"]),
         "--manifest", str(workdir / "manifest.json"), "--vllm-tree", str(tree),
         "--model", MODEL, "--state-dir", str(workdir / "state")],
    )  # fmt: skip
    say("waiting for the sidecar's /readyz (vLLM healthy, the model listed, the manifest verified)")
    begun = time.monotonic()
    wait_for("the sidecar's /readyz", lambda: httpx.get(f"{admin}/readyz").status_code == 200,
             sidecar, 90)  # fmt: skip
    fixes = httpx.get(f"{admin}/status", headers={"accept": "application/json"}).json()["fixes"]
    patched = [f["id"] for f in fixes["fixes"] if f["status"] == "patched"]
    say(
        f"sidecar ready in {time.monotonic() - begun:.1f} s: manifest verified, "
        f"{len(fixes['fixes'])} fixes ({', '.join(patched) or 'none'} patched, the rest upstream)"
    )

    prometheus = shutil.which("prometheus")
    if prometheus is None:
        say(
            "no Prometheus here: install Debian's `prometheus` package (apt-get install "
            "prometheus) to see the chart's alerts; going on without them"
        )
    else:
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules(), sort_keys=False))
        (workdir / "prometheus.yml").write_text(
            yaml.safe_dump(
                prometheus_config(f"127.0.0.1:{ports['vllm']}", f"127.0.0.1:{ports['admin']}"),
                sort_keys=False,
            )
        )
        server = demo.start(
            "prometheus",
            [prometheus, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
             "--storage.tsdb.retention.time=1d"],
        )  # fmt: skip
        wait_for("Prometheus", lambda: httpx.get(f"{prometheus_url}/-/ready").status_code == 200,
                 server, 60)  # fmt: skip
        rule_count = sum(len(g["rules"]) for g in rules()["groups"])
        say(
            f"Prometheus loaded the chart's {rule_count} alert rules (helm/mla-serve, rendered "
            "by Helm's engine); for the demo the runaway, loop and upstream-failure rules use "
            "1m windows and `for: 10s` (the chart's defaults: 5-10m windows, `for:` 2-5m)"
        )

    print(flush=True)
    say("running; open these:")
    for what, url in (
        ("OpenAI pass-through (what clients call)", f"{passthrough}/v1"),
        ("status page", f"{admin}/status"),
        ("sidecar metrics", f"{admin}/metrics"),
        ("vLLM stand-in", f"{vllm_url}/v1/models"),
        *((("Prometheus alerts", f"{prometheus_url}/alerts"),) if prometheus else ()),
    ):
        print(f"  {what:40} {url}", flush=True)
    print(flush=True)

    if prometheus:
        wait_for(
            "Prometheus' first scrape of the sidecar",
            lambda: httpx.get(
                f"{prometheus_url}/api/v1/query", params={"query": "mla_serve_ready"}
            ).json()["data"]["result"],
            demo.programs[-1],
            60,
        )
    say(
        "load through the pass-through with the openai client: ordinary answers, length-cap "
        "runaways ('[runaway]'), reasoning loops ('[loop:paragraph]')"
    )
    return _load_and_watch(demo, args, passthrough, admin, prometheus_url if prometheus else None)


def _load_and_watch(
    demo: Demo, args: argparse.Namespace, passthrough: str, admin: str, prometheus: str | None
) -> int:
    load = Load(passthrough)
    begun = time.monotonic()
    states: dict[str, str] = {}
    fired_at: float | None = None
    number = 0
    while True:
        for program in demo.programs:
            if not program.alive():
                raise DemoError(f"{program.name} exited: {program.tail()} ({program.log})")
        load.wave(number)
        number += 1
        elapsed = time.monotonic() - begun
        if number % 3 == 1:
            counted = _counted(admin)
            say(
                f"{elapsed:4.0f} s: sent {load.sent['answers']} answers, {load.sent['runaways']} "
                f"runaways, {load.sent['loops']} loops; the sidecar counted {counted}"
            )
        if prometheus is not None:
            now = alerts(prometheus)
            for name, state in sorted(now.items()):
                if states.get(name) != state:
                    say(f"{elapsed:4.0f} s: alert {name} is {state.upper()} ({prometheus}/alerts)")
            states = now
            if fired_at is None and any(states.get(name) == "firing" for name in WATCHED):
                fired_at = elapsed
                if args.until_firing:
                    say(f"an alert fired {fired_at:.0f} s after the load began")
                    return 0
                say("an alert fired; the load goes on lightly, Ctrl-C stops everything")
            if fired_at is None and elapsed > args.timeout:
                raise DemoError(f"no alert fired within {args.timeout:.0f} s: {states or 'none'}")
        elif args.until_firing:
            raise DemoError("--until-firing needs Prometheus (Debian's `prometheus` package)")
        time.sleep(1.0 if fired_at is None else 5.0)


def _counted(admin: str) -> str:
    found: dict[str, float] = {}
    for line in httpx.get(f"{admin}/metrics", timeout=5).text.splitlines():
        for name in ("completions", "runaway_completions", "reasoning_loops"):
            if line.startswith(f"mla_serve_{name}_total{{"):
                found[name] = found.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return (
        f"{found.get('completions', 0):.0f} completions, "
        f"{found.get('runaway_completions', 0):.0f} runaways, "
        f"{found.get('reasoning_loops', 0):.0f} loops"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make demo",
        description="The sidecar in front of vLLM's CPU stand-in, Prometheus with the chart's "
        "alerts, and a scripted load; Ctrl-C stops it all.",
    )
    parser.add_argument(
        "--until-firing",
        action="store_true",
        help="stop once an alert fires (exit 0), instead of running until Ctrl-C",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds of load within which an alert must fire (default %(default)s)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    return run(args)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
