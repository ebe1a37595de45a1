"""The sidecar's ASGI application: health, status and metrics routes, and the pass-through."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from server import __version__
from server.sidecar import engine, fixes, health, status
from server.sidecar.canary import Canary
from server.sidecar.loops import LoopGuard
from server.sidecar.metrics import SidecarCollector, View
from server.sidecar.proxy import Proxy, ProxySettings, Receive, Scope, Send
from server.sidecar.runaways import Ledger
from server.sidecar.settings import Settings
from server.sidecar.vllm_monitor import VllmMonitor


@dataclass
class Sidecar:
    """The sidecar's live state, shared by the routes and the background tasks."""

    settings: Settings
    monitor: VllmMonitor
    fix_report: fixes.FixReport
    registry: CollectorRegistry
    ledger: Ledger
    proxy: Proxy
    canary: Canary | None

    @classmethod
    def create(cls, settings: Settings) -> Sidecar:
        registry = CollectorRegistry()
        monitor = VllmMonitor(settings.probe_timeout, settings.poll_interval)
        ledger = Ledger(registry, "mla_serve_")
        loops = LoopGuard(settings.loop_policy(), registry)
        proxy = Proxy(
            ProxySettings(
                upstream=settings.vllm_url,
                connect_timeout=settings.connect_timeout,
                response_timeout=settings.upstream_timeout,
                idle_timeout=settings.stream_idle_timeout,
                max_body_bytes=settings.max_body_bytes,
            ),
            ledger,
            loops,
        )
        canary = None
        if settings.canary_prompt_file is not None:
            canary = Canary(
                prompt_file=settings.canary_prompt_file,
                model=settings.canary_model,
                interval=settings.canary_interval,
                concurrency=settings.canary_concurrency,
                max_tokens=settings.canary_max_tokens,
                timeout=settings.upstream_timeout,
                ledger=Ledger(registry, "mla_serve_canary_"),
                monitor=monitor,
            )
        fix_report = fixes.FixReport(path=settings.manifest)
        sidecar = cls(settings, monitor, fix_report, registry, ledger, proxy, canary)
        registry.register(SidecarCollector(sidecar.view))
        return sidecar

    def status_extra(self) -> dict[str, object]:
        canary: dict[str, object] = {"enabled": self.canary is not None}
        if self.canary is not None:
            canary["last_round"] = self.canary.last_round
            canary["recent_runaways"] = self.canary.ledger.recent_json()
        return {"runaways": {"recent": self.ledger.recent_json()}, "canary": canary}

    def readiness(self) -> health.Verdict:
        return health.readiness(self.monitor.snapshot, self.fix_report, self.settings.model)

    def view(self) -> View:
        ranks = engine.read(self.settings.state_dir, self.settings.vllm_log)
        return View(self.monitor.snapshot, self.fix_report, ranks, self.readiness().ok)

    async def verify_fixes_forever(self) -> None:
        while True:
            self.fix_report = await asyncio.to_thread(
                fixes.check, self.settings.manifest, self.settings.vllm_tree
            )
            await asyncio.sleep(self.settings.manifest_interval)


class PassThroughRouter:
    """`/v1/*` goes straight to the proxy; everything else to the FastAPI app.

    Keeping the pass-through outside FastAPI's routing and middleware stack
    saves per-request work on the hot path.
    """

    def __init__(self, app: FastAPI, proxy: Proxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await self.proxy(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(settings: Settings) -> PassThroughRouter:
    sidecar = Sidecar.create(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await sidecar.proxy.start()
        session = sidecar.proxy.session
        tasks = [
            asyncio.create_task(sidecar.monitor.run(session), name="vllm-monitor"),
            asyncio.create_task(sidecar.verify_fixes_forever(), name="fix-verifier"),
        ]
        if sidecar.canary is not None:
            tasks.append(asyncio.create_task(sidecar.canary.run(session), name="canary"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await sidecar.proxy.close()

    app = FastAPI(title="mla-serve sidecar", version=__version__, lifespan=lifespan)
    app.state.sidecar = sidecar

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """The sidecar's own liveness: answering at all is the signal."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        verdict = sidecar.readiness()
        return JSONResponse(verdict.body(), status_code=200 if verdict.ok else 503)

    @app.get("/startupz")
    async def startupz() -> JSONResponse:
        verdict = health.startup(sidecar.monitor.snapshot)
        return JSONResponse(verdict.body(), status_code=200 if verdict.ok else 503)

    @app.get("/status", response_model=None)
    async def status_page(request: Request, format: str | None = None) -> Response:
        view = await asyncio.to_thread(sidecar.view)
        doc = status.document(view, sidecar.readiness(), settings.vllm_url, sidecar.status_extra())
        wants_html = format == "html" or (
            format is None and "text/html" in request.headers.get("accept", "")
        )
        if wants_html:
            return HTMLResponse(status.render_html(doc))
        return JSONResponse(doc)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(sidecar.registry), media_type=CONTENT_TYPE_LATEST)

    return PassThroughRouter(app, sidecar.proxy)
