"""The hostile-input suite's set-up: the sidecar through its real CLI, a fake vLLM, a report.

Each attack records whether it held (`attack` fixture); the test run writes every record
to build/hostile/report.json and prints `hostile: N attacks, N held`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hostile.fake_vllm import FakeVllm
from tests.http_server import free_port

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "build" / "hostile" / "report.json"
MEMORY_LIMIT = 512 * 1024 * 1024  # the chart's sidecar memory limit (512Mi)
RECORDS: list[dict[str, Any]] = []
# The timed attacks' length and the trailer flood's size; the run of record (README.md) sets
# HOSTILE_SECONDS=20, as the attacks were first reported.
SECONDS = float(os.environ.get("HOSTILE_SECONDS", "3"))
TRAILER_BYTES = int(os.environ.get("HOSTILE_TRAILER_MIB", "1024")) << 20


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RECORDS:
        return
    held = sum(1 for record in RECORDS if record["held"])
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    document = {"attacks": len(RECORDS), "held": held, "records": RECORDS}
    REPORT.write_text(json.dumps(document, indent=2) + "\n")
    terminalreporter.write_line(f"hostile: {len(RECORDS)} attacks, {held} held ({REPORT})")


@dataclass
class Attack:
    """One attack's record; `check` notes a condition and fails the test when it is false."""

    name: str
    item: str  # the item
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.failures.append(what)

    def done(self) -> None:
        RECORDS.append({"attack": self.name, "item": self.item, "held": not self.failures,
                        "figures": self.figures, "failures": self.failures})  # fmt: skip
        assert not self.failures, f"{self.name}: " + "; ".join(self.failures)


@pytest.fixture
def attack() -> Iterator[Callable[[str, str], Attack]]:
    made: list[Attack] = []

    def make(name: str, item: str) -> Attack:
        made.append(Attack(name, item))
        return made[-1]

    yield make
    for one in made:
        if not any(r["attack"] == one.name for r in RECORDS):
            RECORDS.append({"attack": one.name, "item": one.item, "held": False,
                            "figures": one.figures,
                            "failures": one.failures or ["the test raised"]})  # fmt: skip


class Sidecar:
    """`mla-serve sidecar` as a subprocess (uvicorn + httptools + uvloop, as in the image)."""

    def __init__(self, vllm_url: str, log: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log = log
        command = [
            sys.executable, "-m", "mla_serve.cli", "sidecar", "--host", "127.0.0.1",
            "--port", str(self.port), "--admin-port", str(self.admin_port),
            "--vllm-url", vllm_url, "--poll-interval", "0.2", "--probe-timeout", "1",
            "--upstream-timeout", "5", "--stream-idle-timeout", "1", "--body-timeout", "1",
            "--header-timeout", "1", "--drain-timeout", "5", "--log-level", "warning", *args,
        ]  # fmt: skip
        environment = {k: v for k, v in os.environ.items() if not k.startswith("MLA_SERVE_")}
        environment.update(env or {})
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT
        )

    def wait_up(self, timeout: float = 30) -> Sidecar:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sidecar exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.admin}/livez", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("sidecar did not start")

    def wait_ready(self, timeout: float = 10) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while True:
            response = httpx.get(f"{self.admin}/readyz", timeout=2)
            if response.status_code == 200 or time.monotonic() > deadline:
                return response
            time.sleep(0.1)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.admin}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and dict(sample.labels) == labels:
                    return float(sample.value)
        return 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class RssPeak:
    """Sample a process's RSS every 10 ms in a thread while a block runs."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.sidecar.rss())
            except OSError:
                return
            time.sleep(0.01)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


class Livez:
    """Time /livez on the admin port every 20 ms in a thread while a block runs."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.url = f"{sidecar.admin}/livez"
        self.seconds: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while True:  # one sample at least, however short the block
                started = time.monotonic()
                try:
                    client.get(self.url)
                except httpx.HTTPError:
                    self.failed += 1
                self.seconds.append(time.monotonic() - started)
                if self._stop.wait(0.02):
                    return

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def worst(self) -> float:
        return max(self.seconds, default=0.0)

    def __enter__(self) -> Livez:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Front:
    """One way into the sidecar for a chat request: the sidecar's own front (httptools, no
    ASGI), the same with `Expect: 100-continue` (its `100 Continue` when the body is wanted),
    or h11 (always ASGI). `headers` go with the request."""

    name: str
    sidecar: Sidecar
    headers: tuple[str, ...] = ()

    @property
    def port(self) -> int:
        return self.sidecar.port


FRONTS = ("fast", "expect", "h11")


@contextlib.contextmanager
def fronts(vllm_url: str, logs: Path, *flags: str) -> Iterator[dict[str, Front]]:
    """A sidecar on httptools and one on h11 with `flags`, as the three fronts."""
    started = [Sidecar(vllm_url, logs / "httptools.log", *flags),
               Sidecar(vllm_url, logs / "h11.log", *flags, "--http", "h11")]  # fmt: skip
    try:
        httptools, h11 = (one.wait_up() for one in started)
        expect = ("Expect: 100-continue",)
        yield {"fast": Front("fast", httptools), "expect": Front("expect", httptools, expect),
               "h11": Front("h11", h11)}  # fmt: skip
    finally:
        for one in started:
            one.stop()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVllm]:
    vllm = FakeVllm().start()
    yield vllm
    vllm.stop()


@pytest.fixture(scope="module")
def sidecar(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    log = tmp_path_factory.mktemp("sidecar") / "sidecar.log"
    running = Sidecar(fake.url, log).wait_up()
    running.wait_ready()
    yield running
    running.stop()


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    started: list[Sidecar] = []

    def start(vllm_url: str, *args: str, env: dict[str, str] | None = None) -> Sidecar:
        log = tmp_path / f"sidecar-{len(started)}.log"
        started.append(Sidecar(vllm_url, log, *args, env=env).wait_up())
        return started[-1]

    yield start
    for one in started:
        one.stop()
