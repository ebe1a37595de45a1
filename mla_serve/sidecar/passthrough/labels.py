"""Label values no client and no upstream can grow without bound.

A series per label value: a label taken from a request (`"model": "m-<random>"`) or from
what vLLM answers (`finish_reason`) would let anyone create series at will, and with them
the sidecar's memory and every scrape's size. So the values are closed sets: a model is one
vLLM serves (its `/v1/models`, which the sidecar's monitor reads) or one the sidecar's
settings name, else `other`; a finished reason one of vLLM's, else `other`. At most
MAX_MODELS model values are ever used (vLLM's list grows with LoRA adapters loaded at run
time); past them, `other` too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# vLLM's finished reasons (`vllm:request_success_total{finished_reason}` and the OpenAI
# protocol's finish_reason), and the sidecar's own `error` for a choice that never finished.
FINISHED_REASONS = frozenset({"stop", "length", "tool_calls", "abort", "repetition", "error"})
OTHER = "other"
UNKNOWN = "unknown"  # no model named at all (neither the response nor the request)
MAX_MODELS = 64


class Labels:
    """The label values of one sidecar's series."""

    def __init__(
        self, served: Callable[[], Iterable[str]] | None = None, configured: Iterable[str] = ()
    ) -> None:
        self.served = served
        self.configured = frozenset(name for name in configured if name)
        self.used: set[str] = set()

    def model(self, name: str | None) -> str:
        """`name` when vLLM serves it (or the settings name it), `unknown` for none, else
        `other`."""
        if name is None:
            return UNKNOWN
        if name in self.used:
            return name
        known = name in self.configured or (self.served is not None and name in self.served())
        if known and len(self.used) < MAX_MODELS:
            self.used.add(name)
            return name
        return OTHER


def finished_reason(reason: str | None) -> str:
    """One of vLLM's finished reasons, `error` for none (the choice never finished), else
    `other`."""
    if reason is None:
        return "error"
    return reason if reason in FINISHED_REASONS else OTHER
