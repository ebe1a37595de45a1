"""Processes of the benchmark: start, wait for, pin, pause, account CPU, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


@dataclass
class Proc:
    """A server the benchmark started, with its log file."""

    name: str
    argv: Sequence[str]
    log: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = None
    paused: bool = False
    cpu_mark: float = 0.0
    notes: list[str] = field(default_factory=list)

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self) -> float:
        """User + system CPU of the process and its live descendants."""
        total = 0.0
        for proc in self.tree():
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def rss_bytes(self) -> int:
        """VmRSS of the main process, from /proc/<pid>/status."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {self.name}")

    def pin(self, cpus: set[int] | None) -> None:
        """Set the CPU affinity of every thread of the process tree (None: all CPUs)."""
        cpus = cpus or set(range(os.cpu_count() or 1))
        for proc in self.tree():
            try:
                for thread in proc.threads():
                    os.sched_setaffinity(thread.id, cpus)
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT the whole tree, so an idle proxy takes no CPU in others' phases."""
        if paused == self.paused or not self.alive():
            return
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        self.paused = paused

    def stop(self) -> None:
        if not self.alive():
            return
        self.pause(False)
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)  # our own session: only what we started
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def wait_http(
    proc: Proc, url: str, timeout: float, ok: Callable[[httpx.Response], bool] | None = None
) -> float:
    """Poll `url` until it answers (200, or `ok`); seconds waited. Raises with the log."""
    start = time.monotonic()
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - start < timeout:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited: {proc.tail()}")
            try:
                response = client.get(url)
                if (ok or (lambda r: r.status_code == 200))(response):
                    return round(time.monotonic() - start, 2)
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready after {timeout:g} s ({last}); log: {proc.tail()}")


class CpuMeter:
    """CPU used during a phase: the machine's, ours, and so everybody else's."""

    def __init__(self, procs: Sequence[Proc]) -> None:
        self.procs = procs

    @staticmethod
    def busy() -> float:
        """CPU seconds the whole machine has been busy."""
        times = psutil.cpu_times()
        return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))

    @staticmethod
    def _children() -> float:
        usage = os.times()
        return usage.children_user + usage.children_system

    def __enter__(self) -> CpuMeter:
        self.t0 = time.monotonic()
        self.busy0 = self.busy()
        self.children0 = self._children()
        self.self0 = sum(os.times()[:2])
        self.procs0 = {p.name: p.cpu_seconds() for p in self.procs if p.alive()}
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        busy = self.busy() - self.busy0
        procs = {
            p.name: p.cpu_seconds() - self.procs0[p.name]
            for p in self.procs
            if p.name in self.procs0 and p.alive()
        }
        loadgen = self._children() - self.children0  # the load generators we waited for
        own = sum(os.times()[:2]) - self.self0
        ours = sum(procs.values()) + loadgen + own
        self.wall = wall
        self.cores = {name: round(cpu / wall, 3) for name, cpu in procs.items()}
        self.cores["loadgen"] = round(loadgen / wall, 3)
        self.cores["machine"] = round(busy / wall, 3)
        self.cores["others"] = round(max(0.0, busy - ours) / wall, 3)
        self.proc_seconds = procs
