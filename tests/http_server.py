"""Serve an ASGI app with uvicorn on a free 127.0.0.1 port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

import uvicorn


class ServerThread:
    def __init__(
        self,
        app: Any,
        lifespan: Literal["auto", "on", "off"] = "on",
        http: Any = "auto",
        keep_alive: int = 5,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan=lifespan,
            http=http,
            timeout_graceful_shutdown=1,  # stalled test handlers must not hold shutdown
            timeout_keep_alive=keep_alive,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
