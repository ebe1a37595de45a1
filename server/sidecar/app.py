"""The sidecar's FastAPI application: health, status and metrics routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from server import __version__
from server.sidecar import engine, fixes, health, status
from server.sidecar.metrics import SidecarCollector, View
from server.sidecar.settings import Settings
from server.sidecar.vllm_monitor import VllmMonitor


@dataclass
class Sidecar:
    """The sidecar's live state, shared by the routes and the background tasks."""

    settings: Settings
    monitor: VllmMonitor
    fix_report: fixes.FixReport
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    @classmethod
    def create(cls, settings: Settings) -> Sidecar:
        monitor = VllmMonitor(settings.vllm_url, settings.probe_timeout, settings.poll_interval)
        sidecar = cls(settings, monitor, fixes.FixReport(path=settings.manifest))
        sidecar.registry.register(SidecarCollector(sidecar.view))
        return sidecar

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


def create_app(settings: Settings) -> FastAPI:
    sidecar = Sidecar.create(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(sidecar.monitor.run(), name="vllm-monitor"),
            asyncio.create_task(sidecar.verify_fixes_forever(), name="fix-verifier"),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
        doc = status.document(view, sidecar.readiness(), settings.vllm_url, {})
        wants_html = format == "html" or (
            format is None and "text/html" in request.headers.get("accept", "")
        )
        if wants_html:
            return HTMLResponse(status.render_html(doc))
        return JSONResponse(doc)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(sidecar.registry), media_type=CONTENT_TYPE_LATEST)

    return app
