"""Run the sidecar: both ports on one uvicorn server, with the sidecar's protocols.

The pass-through port and the admin port are sockets of one uvicorn server (one event loop,
one lifespan), served by the protocol classes of uvicorn_adapter.py: httptools (what vLLM's
image runs; the pass-through served without ASGI) or h11 (`--http h11`), each holding every
request to the limits of limits.py. SIGTERM starts the drain (uvicorn_adapter.Server):
`/readyz` 503 at once, in-flight requests served for up to `--drain-timeout`, then ended.
The addresses listened on are logged at start.
"""

from __future__ import annotations

import importlib.util
import logging
import socket

import uvicorn

from mla_serve.sidecar import uvicorn_adapter
from mla_serve.sidecar.app import create_app
from mla_serve.sidecar.settings import Settings

UVLOOP = importlib.util.find_spec("uvloop") is not None
# The graceful shutdown uvicorn runs after the sidecar's own drain: connections that are
# idle or end now close, and the lifespan stops.
AFTER_DRAIN = 2


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _where(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(settings: Settings, log_level: str = "info", http: str = "auto") -> None:
    sockets = [listen(settings.host, settings.port)]
    admin = settings.admin_port is not None and settings.admin_port != settings.port
    if admin:
        assert settings.admin_port is not None
        sockets.append(listen(settings.admin_host or settings.host, settings.admin_port))
    loop = "uvloop" if UVLOOP else "asyncio"
    app = create_app(settings)
    http_class = uvicorn_adapter.protocol(http, settings, app)
    config = uvicorn.Config(
        app,
        http=http_class,
        loop=loop,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # X-Forwarded-For is the pass-through's business (--trusted-proxies)
        server_header=False,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=AFTER_DRAIN,
    )
    logger = logging.getLogger("uvicorn.error")  # uvicorn's format
    logger.info(uvicorn_adapter.front_line(http_class, loop, settings.lane_on))
    if admin:
        logger.info("pass-through on http://%s (vLLM's OpenAI routes), admin on http://%s "
                    "(/livez /readyz /startupz /status /metrics); vLLM at %s",
                    _where(sockets[0]), _where(sockets[1]), settings.vllm_url)  # fmt: skip
    else:
        logger.info("pass-through and admin routes on http://%s; vLLM at %s",
                    _where(sockets[0]), settings.vllm_url)  # fmt: skip
    server = uvicorn_adapter.Server(config)
    server.passthrough = app.passthrough
    server.drain_timeout = settings.drain_timeout
    server.run(sockets=sockets)
