"""The sidecar's ASGI application: health, status and metrics routes, and the pass-through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)

from mla_serve import __version__
from mla_serve.engine import ranks, vllm_log
from mla_serve.sidecar.admin import fixes, health, status
from mla_serve.sidecar.admin.canary import Canary
from mla_serve.sidecar.admin.metrics import SidecarCollector, View
from mla_serve.sidecar.admin.vllm_monitor import VllmMonitor
from mla_serve.sidecar.guard.loops import LoopGuard
from mla_serve.sidecar.passthrough import fronts, lane
from mla_serve.sidecar.passthrough.fronts import QuietAborts, Receive, Scope, Send
from mla_serve.sidecar.passthrough.labels import Labels
from mla_serve.sidecar.passthrough.runaways import Ledger, totals
from mla_serve.sidecar.passthrough.service import PassThrough
from mla_serve.sidecar.settings import Settings

log = logging.getLogger("mla_serve.sidecar")
# vLLM's log grows by a line per request and a stats line every 10 s: up to this many new
# bytes are read on the event loop (tens of microseconds), more in a thread.
LOG_INLINE_BYTES = 64 * 1024


@dataclass
class Sidecar:
    """The sidecar's live state, shared by the routes and the background tasks."""

    settings: Settings
    monitor: VllmMonitor
    fix_report: fixes.FixReport
    registry: CollectorRegistry
    ledger: Ledger
    passthrough: PassThrough
    canary: Canary | None
    log_file: vllm_log.LogFile | None = None
    task_errors: dict[str, str] = field(default_factory=dict)  # last crash of each task

    @classmethod
    def create(cls, settings: Settings) -> Sidecar:
        # No `_created` series beside the counters and histograms (one more series for each,
        # which Prometheus would store and no rule reads); prometheus_client's switch is per
        # process, so it holds for every registry and collector the sidecar exports (the
        # ledgers, the pass-through's and the guard's counters alike).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        registry = CollectorRegistry()
        monitor = VllmMonitor(
            settings.probe_timeout,
            settings.poll_interval,
            api_key=settings.vllm_api_key,
            model=settings.model,
        )
        policy = settings.check().loop_policy
        # Series by model: only the models vLLM serves or the settings name (labels.py).
        named = (settings.model, settings.canary_model, *policy.model_actions)
        labels = Labels(lambda: monitor.snapshot.models, [name for name in named if name])
        ledger = Ledger(registry, "mla_serve_", labels=labels)
        loops = LoopGuard(policy, registry, labels)
        passthrough = PassThrough(settings, ledger, loops, registry)
        canary = None
        if settings.canary_prompt_file is not None:
            canary = Canary(
                prompt_file=settings.canary_prompt_file,
                model=settings.canary_model,
                interval=settings.canary_interval,
                concurrency=settings.canary_concurrency,
                max_tokens=settings.canary_max_tokens,
                timeout=settings.upstream_timeout,
                ledger=Ledger(registry, "mla_serve_canary_", labels=labels),
                monitor=monitor,
                api_key=settings.vllm_api_key,
            )
        fix_report = fixes.FixReport(path=settings.manifest)
        log_file = None if settings.vllm_log is None else vllm_log.LogFile(settings.vllm_log)
        sidecar = cls(
            settings, monitor, fix_report, registry, ledger, passthrough, canary, log_file
        )
        registry.register(SidecarCollector(sidecar.view))
        return sidecar

    def status_extra(self) -> dict[str, object]:
        canary: dict[str, object] = {"enabled": self.canary is not None}
        if self.canary is not None:
            canary["last_round"] = self.canary.last_round
            canary["recent_runaways"] = self.canary.ledger.recent_json()
        pool = self.passthrough.pool
        in_c = pool is not None and pool.lane
        extra: dict[str, object] = {
            "pass_through": {
                # token chunks read in C (lane.py, _lane.c), and how many reads so far
                "lane": in_c,
                "lane_reads": lane.taken() if in_c else 0,
            },
            "runaways": {
                "recent": self.ledger.recent_json(),
                "by_model": self.ledger.by_model_json(),
            },
            "guard": self.guard_json(),
            "canary": canary,
            "background_errors": dict(self.task_errors),
        }
        if self.log_file is not None:
            extra["vllm_log"] = {"path": str(self.log_file.path), "error": self.log_file.error}
        return extra

    def guard_json(self) -> dict[str, object]:
        """The runaway guard's policy and what it has seen per model (guard/loops.py)."""
        policy = self.settings.loop_policy
        guard: dict[str, object] = {
            "action": policy.action,
            "model_actions": dict(policy.model_actions),
            "min_repeats": policy.config.min_repeats,
            "window_chars": policy.config.window_chars,
            "min_chars": policy.config.min_chars,
            "repetition_detection": policy.repetition_detection,
            "thinking_token_budget": policy.thinking_token_budget,
        }
        loops = self.passthrough.loops
        if loops is not None:
            found = totals(loops.metrics.loops)
            stops, saved = totals(loops.metrics.stops), totals(loops.metrics.saved)
            guard["by_model"] = [
                {
                    "model": model,
                    "loops": {ch: v for (m, ch), v in found.items() if m == model},
                    "stops": stops.get((model,), 0.0),
                    "tokens_saved": saved.get((model,), 0.0),
                }
                for model in sorted({m for m, _ in found} | {m for (m,) in stops})
            ]
        return guard

    def readiness(self) -> health.Verdict:
        # The monitor checks every poll interval with a bounded probe; a snapshot much older
        # than that means the monitor itself is stuck or crashing.
        stale_after = 5 * (self.settings.poll_interval + 3 * self.settings.probe_timeout)
        return health.readiness(
            self.monitor.snapshot,
            self.fix_report,
            self.settings.model,
            stale_after=stale_after,
            monitor_error=self.task_errors.get("vllm-monitor"),
            draining=self.passthrough.draining,
        )

    def view(self) -> View:
        found = ranks.read(self.settings.state_dir, self.log_file)
        return View(self.monitor.snapshot, self.fix_report, found, self.readiness().ok)

    async def verify_fixes_once(self) -> None:
        """Verify the manifest; anything that goes wrong fails closed, with the reason."""
        try:
            self.fix_report = await asyncio.to_thread(
                fixes.check, self.settings.manifest, self.settings.vllm_tree, self.fix_report
            )
        except Exception as error:
            self.fix_report = fixes.failed(self.settings.manifest, error)

    async def verify_fixes_forever(self) -> None:
        while True:
            await self.verify_fixes_once()
            await asyncio.sleep(self.settings.manifest_interval)

    async def follow_log_forever(self) -> None:
        """Read what vLLM appended to its log every poll interval: on the event loop when it
        is a few lines (a stat and one small read, cheaper than handing it to a thread),
        in a thread when it is more, or the file was replaced (a large first read)."""
        log_file = self.log_file
        assert log_file is not None
        while True:
            unread = log_file.unread()
            if unread is not None and unread <= LOG_INLINE_BYTES:
                log_file.refresh()
            else:
                await asyncio.to_thread(log_file.refresh)
            await asyncio.sleep(self.settings.poll_interval)

    async def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run a background task for ever: a crash is logged, kept for /readyz and
        /status, and the task restarted after a pause."""
        while True:
            try:
                await run()
                raise RuntimeError("returned")
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.task_errors[name] = f"{type(error).__name__}: {error}"
                log.error("background task %s failed, restarting: %s", name, error)
                if name == "fix-verifier":
                    self.fix_report = fixes.failed(self.settings.manifest, error)
                await asyncio.sleep(min(self.settings.poll_interval, 1.0))


class Router:
    """Dispatch by port and path; keeps the pass-through outside FastAPI's routing and
    middleware stack, which saves per-request work on the hot path.

    With an admin port, connections to it reach the sidecar's own routes (`admin`) and
    those to the pass-through port reach only vLLM's OpenAI routes. Without one (library
    use, tests), both share the port: `/v1/...` goes to the pass-through.
    """

    def __init__(self, admin: FastAPI, passthrough: PassThrough, admin_port: int | None) -> None:
        self.admin = admin
        self.passthrough = passthrough
        self.admin_port = admin_port

    def passes_through(self, port: int, path: str) -> bool:
        """Whether a request to `port` for `path` is the pass-through's (else the admin
        routes'). /livez says nothing but "running": the image's HEALTHCHECK finds it on the
        pass-through port too."""
        if self.admin_port is None:
            return path.startswith("/v1/")
        return port != self.admin_port and path != "/livez"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.admin(scope, receive, send)  # lifespan
            return
        server = scope.get("server") or ("", 0)
        if self.passes_through(server[1], scope["path"]):
            await fronts.serve(self.passthrough, scope, receive, send)
        else:
            await self.admin(scope, receive, send)


def create_app(settings: Settings) -> Router:
    """The sidecar as one ASGI app (both ports' routes; see Router)."""
    sidecar = Sidecar.create(settings)
    logging.getLogger("uvicorn.error").addFilter(QuietAborts())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await sidecar.passthrough.start()
        # the monitor's and the canary's client to vLLM (not the pass-through's: upstream.py)
        session = aiohttp.ClientSession(
            base_url=settings.vllm_url,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        if sidecar.log_file is not None:
            await asyncio.to_thread(sidecar.log_file.refresh)
        jobs: dict[str, Callable[[], Awaitable[None]]] = {
            "vllm-monitor": lambda: sidecar.monitor.run(session),
            "fix-verifier": sidecar.verify_fixes_forever,
        }
        if sidecar.log_file is not None:
            jobs["vllm-log"] = sidecar.follow_log_forever
        if sidecar.canary is not None:
            canary = sidecar.canary
            jobs["canary"] = lambda: canary.run(session)
        tasks = [
            asyncio.create_task(sidecar.supervise(name, job), name=name)
            for name, job in jobs.items()
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sidecar.passthrough.close()
            await session.close()

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

    admin_port = settings.admin_port if settings.admin_port != settings.port else None
    router = Router(app, sidecar.passthrough, admin_port)
    return router
