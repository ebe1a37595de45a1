"""What every request through the pass-through shares, and what a front must do.

`PassThrough` holds the settings, the one client to vLLM (upstream.py's pool), the in-flight
byte budget, the metrics, the runaway ledger and guard, the routes, the live exchanges and
the drain; each request is an exchange (exchange.py `admit` makes it). `Front` is what an
exchange writes its response through (fronts.py: the transport front, the ASGI front).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from mla_serve.sidecar.guard.loops import LoopGuard
from mla_serve.sidecar.passthrough import upstream
from mla_serve.sidecar.passthrough.metrics import ByteBudget, Metrics
from mla_serve.sidecar.passthrough.routes import Routes, normalize
from mla_serve.sidecar.passthrough.runaways import Ledger

if TYPE_CHECKING:
    from mla_serve.sidecar.settings import Settings

SHUTTING_DOWN = "the sidecar is shutting down"
Headers = list[tuple[bytes, bytes]]


class Open(Protocol):
    """A request the pass-through serves now (an exchange.Exchange)."""

    def shut(self, why: str) -> None: ...  # the drain timed out: end it


class Front(Protocol):
    """Where an exchange's response goes: the client's connection (fronts.py)."""

    @property
    def direct(self) -> bool: ...  # writes go straight onto the client's transport now

    @property
    def ready(self) -> bool: ...  # False while an earlier response on its connection goes out

    def start(self, status: int, headers: Headers, length: bool, close: bool) -> None: ...
    def write(self, data: bytes) -> bool: ...  # True: over the high-water mark, pause vLLM
    def finish(self, data: bytes) -> None: ...
    def cut(self) -> None: ...
    def answer(self, status: int, body: bytes, close: bool) -> None: ...
    def transport_write(self) -> Any: ...  # the client transport's write, for the lane


class PassThrough:
    """What every request shares; see the module's docstring."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        loops: LoopGuard | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.loops = loops  # the runaway guard (guard/loops.py); None: no loop detection
        self.routes = Routes(settings.routes)
        self.budget = ByteBudget(settings.max_inflight_body_bytes)
        self.metrics = Metrics(
            registry if registry is not None else CollectorRegistry(), self.budget
        )
        self.trusted = settings.trusted_networks
        self.pool: upstream.Pool | None = None
        self.live: set[Open] = set()
        self.draining = False  # SIGTERM came: responses close their connections

    async def start(self) -> None:
        settings = self.settings
        self.pool = upstream.Pool(
            settings.vllm_url, settings.connect_timeout, lane_on=settings.lane_on
        )

    def drain(self) -> None:
        """The drain begins: every response from now on closes its connection."""
        self.draining = True

    def close(self, why: str = SHUTTING_DOWN) -> None:
        """At the drain's timeout (or shutdown): what still runs is ended (`Exchange.shut`),
        the idle connections to vLLM closed."""
        for exchange in list(self.live):
            exchange.shut(why)
        if self.pool is not None:
            self.pool.close()

    def route(self, raw_path: str) -> str | None:
        """The normalized path if the pass-through serves it, else None."""
        if raw_path in self.routes.exact:  # already normalized (what clients send)
            return raw_path
        path = normalize(raw_path)
        return path if path is not None and self.routes.allows(path) else None
