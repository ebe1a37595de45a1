"""Careless-operator faults: API keys, exposure, drain, logs, forwarding trust, h11, floods.

Each test starts its own `mla-serve sidecar` (real CLI) with the flags under test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from tests.hostile.fake_vllm import FakeVllm
from tests.hostile.wire import MODEL, ask, dechunk, exchange, get, post
from tests.http_server import free_port

MiB = 1 << 20


def test_api_key_deployment_turns_ready(start_sidecar, tmp_path, attack):
    """Item 2: vLLM started with --api-key; the sidecar is given the same key."""
    check = attack("vLLM with --api-key: readiness and canary with the key", "2")
    vllm = FakeVllm(api_key="s3cret").start()
    try:
        prompt = tmp_path / "canary.txt"
        prompt.write_text("[runaway] a long shared prefix")
        keyless = start_sidecar(vllm.url)
        keyed = start_sidecar(
            vllm.url, "--canary-prompt-file", str(prompt), "--canary-interval", "0.3",
            "--canary-concurrency", "2", "--canary-max-tokens", "4",
            env={"MLA_SERVE_VLLM_API_KEY": "s3cret"},
        )  # fmt: skip
        ready = keyed.wait_ready(timeout=10)
        check.check(ready.status_code == 200, f"keyed /readyz {ready.status_code}: {ready.text}")
        refused = keyless.wait_ready(timeout=1)
        detail = refused.json()["checks"]["model_listed"]["detail"]
        check.figures.update(keyless_detail=detail)
        check.check(refused.status_code == 503 and "API key" in detail, f"keyless: {detail}")
        deadline = time.monotonic() + 10
        while keyed.metric("mla_serve_canary_runaway_completions_total", model=MODEL) < 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        canary = httpx.get(f"{keyed.admin}/status").json()["canary"]["last_round"]
        check.figures["canary_round"] = canary
        check.check(canary.get("errors") == 0 and canary.get("runaways") == 2, f"{canary}")
        # The client's own key is what the pass-through sends, never the sidecar's.
        anonymous = httpx.get(f"{keyed.url}/v1/models")
        check.check(anonymous.status_code == 401, f"keyless client got {anonymous.status_code}")
        check.check("s3cret" not in " ".join(keyed.process.args), "key on the command line")
    finally:
        vllm.stop()
    check.done()


def test_admin_routes_only_on_the_admin_port(sidecar, attack):
    """Item 13: /status and /metrics are not on the port the Service exposes."""
    check = attack("/status /metrics /readyz not on the pass-through port", "13")
    for path in ("/status", "/metrics", "/readyz", "/startupz", "/docs", "/openapi.json"):
        public = httpx.get(f"{sidecar.url}{path}")
        check.check(public.status_code == 404, f"pass-through port {path}: {public.status_code}")
        check.check(MODEL not in public.text, f"{path} leaks the model list")
    for path in ("/status", "/metrics", "/readyz", "/livez"):
        check.check(httpx.get(f"{sidecar.admin}{path}").status_code == 200, f"admin {path}")
    # /livez tells nothing but "running" (the image's HEALTHCHECK probes it on --port).
    check.check(httpx.get(f"{sidecar.url}/livez").json() == {"status": "ok"}, "public /livez")
    check.done()


def test_sigterm_drains_in_flight_requests(start_sidecar, fake, attack):
    """Item 13: on SIGTERM the sidecar is no longer ready but still listening (a probe must
    see the 503, not a refused connection), finishes in-flight streams within the bound,
    then exits."""
    check = attack("SIGTERM during a stream: drain", "13")
    sidecar = start_sidecar(fake.url)
    sidecar.wait_ready()
    body: list[bytes] = []

    def stream() -> None:
        with httpx.stream("POST", f"{sidecar.url}/v1/chat/completions",
                          json=ask("[slow] hi", stream=True), timeout=30) as response:  # fmt: skip
            body.extend(response.iter_raw())

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(0.4)
    started = time.monotonic()
    sidecar.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    ready = httpx.get(f"{sidecar.admin}/readyz", timeout=2)
    live = httpx.get(f"{sidecar.admin}/livez", timeout=2)
    reader.join(timeout=15)
    code = sidecar.process.wait(timeout=15)
    took = time.monotonic() - started
    whole = b"".join(body)
    check.figures.update(exit_code=code, drain_s=round(took, 2), readyz=ready.status_code)
    check.check(ready.status_code == 503 and "draining" in ready.json()["failing"],
                f"/readyz during the drain: {ready.status_code} {ready.text[:120]}")  # fmt: skip
    check.check(live.status_code == 200, f"/livez during the drain: {live.status_code}")
    check.check(whole.endswith(b"data: [DONE]\n\n"), f"stream cut: {whole[-80:]!r}")
    # uvicorn re-raises the SIGTERM it caught once the drain is over: -15 is a clean exit.
    check.check(code in (0, -signal.SIGTERM) and took < 5 + 2, f"exit {code} after {took:.1f} s")
    check.done()


class _Stream(threading.Thread):
    """One streamed chat on a raw socket, read to its end; what came and when."""

    def __init__(self, port: int, request: bytes) -> None:
        super().__init__(daemon=True)
        self.port, self.request = port, request
        self.data = b""
        self.times: list[float] = []  # when each read came
        self.ended = False  # the sidecar ended the connection

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=20) as sock:
            sock.sendall(self.request)
            try:
                while piece := sock.recv(65536):
                    self.data += piece
                    self.times.append(time.monotonic())
                self.ended = True
            except OSError:
                pass


class _Counter(threading.Thread):
    """Read one counter on the admin port every 20 ms (one kept-alive connection) until the
    sidecar is gone; the highest value seen."""

    def __init__(self, admin: str, name: str) -> None:
        super().__init__(daemon=True)
        self.url, self.name, self.seen = f"{admin}/metrics", name, 0.0

    def run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        with httpx.Client(timeout=2) as client:
            while True:
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    return
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name == self.name:
                            self.seen = max(self.seen, sample.value)
                time.sleep(0.02)


def _probe(url: str) -> int | str:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError as error:
        return type(error).__name__


def test_sigterm_drains_as_kubernetes_expects(start_sidecar, fake, attack):
    """50 streams of about 8 s, SIGTERM 0.7 s after they began, --drain-timeout 2: /readyz
    on the admin port answers 503 at once (a readiness probe sees the pod go unready, never
    a refused connection) and /livez 200 during the drain; the streams keep flowing until
    the drain timeout, where each ends with the pass-through's error event and the last
    chunk, counted (`mla_serve_drain_ended_responses_total`, or a log line as it exits)."""
    check = attack("SIGTERM with 50 streams of about 8 s, --drain-timeout 2", "drain")
    sidecar = start_sidecar(fake.url, "--drain-timeout", "2")
    sidecar.wait_ready()
    body = json.dumps(ask("[runaway] [slow] x", stream=True, max_tokens=80)).encode()
    streams = [_Stream(sidecar.port, post("/v1/chat/completions", body)) for _ in range(50)]
    began = time.monotonic()
    for stream in streams:
        stream.start()
    while not all(stream.data for stream in streams) and time.monotonic() - began < 5:
        time.sleep(0.02)
    time.sleep(max(0.0, 0.7 - (time.monotonic() - began)))
    counter = _Counter(sidecar.admin, "mla_serve_drain_ended_responses_total")
    counter.start()
    signalled = time.monotonic()
    sidecar.process.send_signal(signal.SIGTERM)
    first_ready = _probe(f"{sidecar.admin}/readyz")
    time.sleep(0.5)
    during = {"readyz": _probe(f"{sidecar.admin}/readyz"),
              "livez": _probe(f"{sidecar.admin}/livez")}  # fmt: skip
    for stream in streams:
        stream.join(timeout=15)
    code = sidecar.process.wait(timeout=15)
    took = time.monotonic() - signalled
    counter.join(timeout=5)
    flowing = sum(1 for s in streams if any(signalled + 1.0 < t < signalled + 2 for t in s.times))
    ended = []
    for stream in streams:
        _, _, raw = stream.data.partition(b"\r\n\r\n")
        events = [event for event in dechunk(raw).split(b"\n\n") if event]
        ended.append(raw.endswith(b"\r\n0\r\n\r\n") and bool(events)
                     and events[-1].startswith(b'data: {"error"'))  # fmt: skip
    log_lines = sidecar.log.read_text(errors="replace").splitlines()
    logged = [line for line in log_lines if "drain" in line.lower() and re.search(r"\b50\b", line)]
    check.figures.update(first_readyz=first_ready, during=during, flowing=flowing,
                         ended_cleanly=sum(ended), exit_code=code, counted=counter.seen,
                         seconds=round(took, 2))  # fmt: skip
    check.check(first_ready == 503, f"/readyz right after SIGTERM: {first_ready}")
    check.check(during == {"readyz": 503, "livez": 200}, f"during the drain: {during}")
    check.check(flowing == 50, f"{flowing} of 50 streams flowed 1-2 s after SIGTERM")
    check.check(all(ended), f"{sum(ended)} of 50 streams ended with the error event and last chunk")
    # counted: seen in the counter before the sidecar exits, or logged as it exits
    check.check(counter.seen == 50 or bool(logged),
                f"the 50 streams ended at the drain timeout are not counted: the counter showed "
                f"{counter.seen:g}, no log line says 50")  # fmt: skip
    check.check(code in (0, -signal.SIGTERM) and took < 2 + 3, f"exit {code} after {took:.1f} s")
    check.done()


def test_big_vllm_log_is_read_incrementally_off_the_loop(start_sidecar, fake, tmp_path, attack):
    """Item 10: a 200 MB log neither blocks /livez nor /metrics; rotation is followed."""
    check = attack("200 MB --vllm-log; rotation and truncation", "10")
    log = tmp_path / "vllm.log"
    log.write_text("")
    sidecar = start_sidecar(fake.url, "--vllm-log", str(log))
    line = b"(Worker_TP0 pid=1) INFO 11-29 10:00:00 [loggers.py:123] Engine 000: Avg throughput\n"
    filler = line * (200 * MiB // len(line) // 64)
    mode = ("INFO [core.py:1] config: compilation_config={'cudagraph_mode': "
            "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}\n")  # fmt: skip
    with log.open("ab") as handle:
        handle.write(mode.encode())
        for _ in range(64):
            handle.write(filler)
        handle.write(b"(Worker_TP1 pid=2) INFO [gpu_model_runner.py:1] Graph capturing finished"
                     b" in 14 secs, took 1.25 GiB\n")  # fmt: skip
    size = log.stat().st_size
    worst = 0.0
    deadline = time.monotonic() + 60
    found = False
    while time.monotonic() < deadline and not found:
        for url in (f"{sidecar.admin}/livez", f"{sidecar.admin}/metrics"):
            started = time.monotonic()
            text = httpx.get(url, timeout=30).text
            worst = max(worst, time.monotonic() - started)
            found = found or 'mla_serve_cudagraph_capture_duration_seconds{rank="1"} 14.0' in text
        time.sleep(0.05)
    check.figures.update(log_mib=round(size / MiB), worst_probe_s=round(worst, 3))
    check.check(found, "figures of the 200 MB log never appeared")
    check.check(worst < 1.0, f"/livez or /metrics took {worst:.2f} s")
    # Rotation: a new file under the same name; then truncation in place.
    log.rename(tmp_path / "vllm.log.1")
    log.write_text("INFO config: compilation_config={'cudagraph_mode': <CUDAGraphMode.NONE: 0>}\n")
    check.check(_wait_metric(sidecar, 'mla_serve_cudagraph_mode_info{mode="NONE",rank="1"}'),
                "rotation not followed")  # fmt: skip
    log.write_text("INFO setting cudagraph_mode=PIECEWISE\n")
    check.check(_wait_metric(sidecar, 'mla_serve_cudagraph_mode_info{mode="PIECEWISE",rank="1"}'),
                "truncation not followed")  # fmt: skip
    check.done()


def _wait_metric(sidecar, text: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in httpx.get(f"{sidecar.admin}/metrics").text:
            return True
        time.sleep(0.1)
    return False


def test_trusted_proxy_forwarded_for_is_appended(start_sidecar, fake, attack):
    """Item 13: from a trusted proxy the chain is kept and the peer appended."""
    check = attack("X-Forwarded-For from a trusted proxy (--trusted-proxies)", "13")
    sidecar = start_sidecar(fake.url, "--trusted-proxies", "127.0.0.0/8")
    reply = exchange(sidecar.port, post("/v1/chat/completions", json.dumps(ask("hi")).encode(),
                                        "X-Forwarded-For: 203.0.113.9",
                                        "X-Forwarded-Proto: https"))  # fmt: skip
    headers = fake.last("/v1/chat/completions").headers
    seen = headers.get("x-forwarded-for")
    check.figures["upstream_xff"] = seen
    check.check(reply.status == 200 and seen == "203.0.113.9, 127.0.0.1", f"XFF {seen}")
    check.check(headers.get("x-forwarded-proto") == "https", "the proxy's X-Forwarded-Proto")
    check.done()


def test_h11_parser_is_bounded_too(start_sidecar, fake, attack):
    """Item 1: the same limits with uvicorn's h11 protocol."""
    check = attack("h11: 1 MB header, 150 headers, unterminated 64 MB header", "1")
    sidecar = start_sidecar(fake.url, "--http", "h11")
    big = exchange(sidecar.port, get("/v1/models", "X-Big: " + "a" * MiB))
    count = exchange(sidecar.port, get("/v1/models", *(f"X-H{i}: v" for i in range(150))))
    ok = exchange(sidecar.port, get("/v1/models"))
    check.figures.update(big=big.status, count=count.status)
    check.check(big.status in (400, 431) and big.header("connection") == "close",
                f"1 MB header: {big.status}")  # fmt: skip
    check.check("error" in big.json(), "not an OpenAI-style error")
    check.check(count.status == 431, f"150 headers: {count.status}")
    check.check(ok.status == 200, f"plain request: {ok.status}")
    check.check(sidecar.rss() < 512 * MiB, "RSS")
    check.done()


def test_connection_flood_leaves_the_admin_port_alone(start_sidecar, fake, attack):
    """Item 1/13: past --max-connections the pass-through sheds the connections that have
    waited longest for a request head (40 idle connections: the first 20 closed, the last 20
    kept), a real request still gets in, and probes still answer."""
    check = attack("connection flood on the pass-through port (--max-connections 20)", "1")
    sidecar = start_sidecar(fake.url, "--max-connections", "20", "--header-timeout", "5")
    socks = []
    for _ in range(40):
        socks.append(socket.create_connection(("127.0.0.1", sidecar.port)))
        time.sleep(0.005)  # in order: the oldest first
    try:
        time.sleep(0.3)
        closed = []
        for sock in socks:
            sock.settimeout(0.05)
            try:
                closed.append(sock.recv(200) == b"")
            except TimeoutError:
                closed.append(False)
            except OSError:
                closed.append(True)
        served = httpx.get(f"{sidecar.url}/v1/models", timeout=5).status_code
        livez = httpx.get(f"{sidecar.admin}/livez", timeout=5).status_code
    finally:
        for sock in socks:
            sock.close()
    check.figures.update(shed=sum(closed))
    check.check(closed == [True] * 20 + [False] * 20, f"closed by the sidecar: {closed}")
    check.check(served == 200, f"a request at the cap: {served}")
    check.check(livez == 200, f"/livez {livez}")
    time.sleep(0.3)
    check.check(httpx.get(f"{sidecar.url}/v1/models").status_code == 200, "not recovered")
    check.done()


def test_bad_flags_are_one_line_errors(tmp_path, attack):
    """Careless operator: bad values end in one line and exit 2, never a traceback."""
    import subprocess
    import sys

    check = attack("bad sidecar flags: one-line errors, exit 2", "13")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_SERVE_")}
    for args in (["--extra-routes", "../admin"], ["--trusted-proxies", "not-an-ip"],
                 ["--max-inflight-body-bytes", "10"], ["--admin-port", "70000"],
                 ["--host", "203.0.113.254"]):  # fmt: skip
        port = str(free_port())
        done = subprocess.run([sys.executable, "-m", "mla_serve.cli", "sidecar", "--port", port,
                               *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=30)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        check.check(done.returncode == 2 and len(lines) == 1, f"{args}: {done.stderr[-300:]}")
    check.done()
