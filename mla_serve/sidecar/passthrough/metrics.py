"""The pass-through's own series, and the byte budget one of them reports.

`ByteBudget` is `--max-inflight-body-bytes`: every copy of a request body the pass-through
holds counts against it for as long as it lives (the pieces as they arrive, the body they
make, the request written to vLLM until vLLM starts answering it), and so do response bytes
kept to classify (a partial event, a whole body). A request whose body does not fit is
answered 503; a response part that does not fit is relayed unclassified.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# Why vLLM failed before its response's head (errors.upstream_failure): each a status.
FAILURES = {"unreachable": 503, "timeout": 504, "broken": 502}


class ByteBudget:
    """Bytes of request bodies (and response bytes kept to classify) held at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


class Metrics:
    def __init__(self, registry: CollectorRegistry, budget: ByteBudget) -> None:
        self.buffered = Gauge(
            "mla_serve_buffered_bytes",
            "Bytes the pass-through holds now (request bodies and the requests written to "
            "vLLM until it answers, partial events, bodies kept to classify), against "
            "--max-inflight-body-bytes.",
            registry=registry,
        )
        self.buffered.set_function(lambda: budget.used)
        self.refused = Counter(
            "mla_serve_refused_requests",
            "Requests the pass-through answered itself, by HTTP status.",
            ["code"],
            registry=registry,
        )
        self.failures = Counter(
            "mla_serve_upstream_failures",
            "Requests the pass-through answered with an error because vLLM failed before its "
            "response's head, by reason: unreachable (503), timeout (504), broken (502).",
            ["reason"],
            registry=registry,
        )
        for reason in FAILURES:
            self.failures.labels(reason)
        self.unparsed = Counter(
            "mla_serve_unparsed_events",
            "Upstream events or bodies relayed unchanged but not classified (not the JSON "
            "expected, or over --max-event-bytes).",
            registry=registry,
        )
        self.truncated = Counter(
            "mla_serve_truncated_responses",
            "Upstream responses that stalled or broke off after their headers.",
            registry=registry,
        )
        self.drained = Counter(
            "mla_serve_drain_ended_responses",
            "Requests still open when the drain timed out at shutdown, ended by the sidecar "
            "(a stream with its error event and last chunk).",
            registry=registry,
        )
