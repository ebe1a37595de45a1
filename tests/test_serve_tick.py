"""The sidecar's uvicorn server ticks once a second, and a signal still ends it at once."""

from __future__ import annotations

import signal
import threading
import time

import uvicorn

from mla_serve.sidecar.uvicorn_adapter import Server
from tests.http_server import free_port


class Counted(Server):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        type(self).ticks += 1
        return await super().on_tick(counter)


async def app(scope, receive, send):  # an ASGI app that is never called here
    raise AssertionError("no request expected")


def test_an_idle_server_wakes_once_a_second_and_stops_at_once_on_sigterm():
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off",
                            log_level="warning")  # fmt: skip
    server = Counted(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    Counted.ticks = 0
    time.sleep(3.05)
    assert 2 <= Counted.ticks <= 4  # uvicorn's own loop: about 30 in 3 s
    stopped = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert time.monotonic() - stopped < 0.5  # not a tick later
    assert server.server_state.default_headers[0][0] == b"date"  # still refreshed by on_tick
