"""Classify finished completions and count length-cap runaways.

A runaway (the DeepSeek-V4 symptom of vllm#52448, fixed by #52492 and #51318) is a
choice that stopped at the length cap with nothing visible to show for it:
`finish_reason == "length"`, content empty or whitespace, no tool calls.
Reasoning may be long: that is where the tokens went. vLLM's own
`finished_reason="length"` counter cannot tell this from an ordinary
truncated answer; the sidecar sees the response body and can.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from mla_serve.sidecar.passthrough.labels import Labels, finished_reason

REASONING = "reasoning"  # the one channel whose text is not the answer


def visible_channel(channel: str) -> bool:
    """Whether a channel's text is what the client sees as the answer: content (chat) and
    text (completions) are; reasoning is not."""
    return channel != REASONING


def visible(channel: str, text: object) -> bool:
    """The one rule for a visible answer: text of a visible channel (`visible_channel`'s
    test, written out: this runs per token) with a character that is not whitespace
    (`str.isspace`; the C lane checks it the same way, per channel as `visible_channel`
    says)."""
    return channel != REASONING and isinstance(text, str) and text != "" and not text.isspace()


@dataclass
class Choice:
    """What a finished choice showed, accumulated over a stream or read at once."""

    visible: bool = False  # any non-whitespace content (chat) or text (completions)
    tool_calls: bool = False
    finish_reason: str | None = None
    loop: bool = False  # the loop guard (loops.py) confirmed an exact loop in its text

    def add_delta(self, delta: dict[str, Any]) -> None:
        if not self.visible and visible("content", delta.get("content")):
            self.visible = True
        if delta.get("tool_calls"):
            self.tool_calls = True

    @property
    def runaway(self) -> bool:
        return self.finish_reason == "length" and not self.visible and not self.tool_calls

    @property
    def cause(self) -> str:
        """Why a runaway ran away: a confirmed loop, or reasoning that never ended."""
        return "loop" if self.loop else "long_reasoning"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None

    @classmethod
    def of(cls, usage: Any) -> Usage:
        """Counts as vLLM sends them; anything but a non-negative integer is left out."""
        if not isinstance(usage, dict):
            return cls()
        details = usage.get("completion_tokens_details")
        return cls(
            _count(usage.get("prompt_tokens")),
            _count(usage.get("completion_tokens")),
            _count(details.get("reasoning_tokens")) if isinstance(details, dict) else None,
        )


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _index(raw: Any) -> int:
    """A choice's index; ValueError when the choice is not an object with a sane index."""
    if type(raw) is not dict:
        raise ValueError(f"choice {raw!r:.40} is not an object")
    index = raw.get("index", 0)
    if type(index) is not int or not 0 <= index < 4096:
        raise ValueError(f"choice index {index!r}")
    return index


@dataclass
class Completion:
    """One response's choices, filled from a JSON body or from stream chunks."""

    id: str | None = None
    model: str | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        """A `chat.completion.chunk` or streamed `text_completion`."""
        self._header(chunk)
        for raw in _choices(chunk):
            choice = self.choices.setdefault(_index(raw), Choice())
            if isinstance(raw.get("delta"), dict):
                choice.add_delta(raw["delta"])
            elif visible("text", raw.get("text")):
                choice.visible = True
            if raw.get("finish_reason"):
                choice.finish_reason = str(raw["finish_reason"])

    def add_body(self, body: dict[str, Any]) -> None:
        """A non-streamed `chat.completion` or `text_completion`."""
        self._header(body)
        for raw in _choices(body):
            choice = self.choices.setdefault(_index(raw), Choice())
            message = raw.get("message")
            if isinstance(message, dict):
                choice.add_delta(message)
            elif visible("text", raw.get("text")):
                choice.visible = True
            if raw.get("finish_reason"):
                choice.finish_reason = str(raw["finish_reason"])

    def _header(self, document: dict[str, Any]) -> None:
        if self.id is None and isinstance(document.get("id"), str):
            self.id = document["id"]
        if self.model is None and isinstance(document.get("model"), str):
            self.model = document["model"]
        if document.get("usage"):
            self.usage = Usage.of(document["usage"])


def _choices(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's choices; ValueError when they are not what vLLM sends (a list)."""
    choices = document.get("choices") or []
    if type(choices) is not list:
        raise ValueError("choices is not a list")
    return choices


@dataclass(frozen=True)
class Runaway:
    """A recent runaway, as /status lists it: identifiers and counts, never text."""

    request_id: str | None
    model: str
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    at: float
    cause: str = "long_reasoning"  # "loop" when the loop guard saw a runaway choice loop


class Ledger:
    """Counters and the recent-runaway list; one per sidecar (and one for the canary)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        recent: int = 50,
        labels: Labels | None = None,
    ) -> None:
        self.labels = labels if labels is not None else Labels()
        self.completions = Counter(
            f"{prefix}completions",
            "Finished completion choices seen by the pass-through, by finish reason.",
            ["model", "finished_reason"],  # vLLM's own label name (vllm:request_success_total)
            registry=registry,
        )
        self.runaways = Counter(
            f"{prefix}runaway_completions",
            "Choices that hit the length cap with no visible content and no tool calls.",
            ["model"],
            registry=registry,
        )
        # A label on runaway_completions_total would change the series alerts, dashboards and
        # tests already select by {model}: the split is a counter of its own.
        self.runaway_causes = Counter(
            f"{prefix}runaways_by_cause",
            "Runaways by cause: loop (the guard confirmed a loop) or long_reasoning.",
            ["model", "cause"],
            registry=registry,
        )
        self.runaway_tokens = Counter(
            f"{prefix}runaway_tokens",
            "Completion tokens spent by runaway responses.",
            ["model"],
            registry=registry,
        )
        self.recent: deque[Runaway] = deque(maxlen=recent)

    def record(self, completion: Completion, fallback_model: str | None) -> int:
        """Count every finished choice; return how many were runaways."""
        model = self.labels.model(completion.model or fallback_model)
        runaways = 0
        looped = False
        for choice in completion.choices.values():
            self.completions.labels(model, finished_reason(choice.finish_reason)).inc()
            if choice.runaway:
                runaways += 1
                self.runaways.labels(model).inc()
                self.runaway_causes.labels(model, choice.cause).inc()
                looped = looped or choice.loop
        if runaways:
            tokens = completion.usage.completion_tokens
            if tokens:
                self.runaway_tokens.labels(model).inc(tokens)
            usage = completion.usage
            self.recent.appendleft(
                Runaway(
                    completion.id,
                    model,
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    usage.reasoning_tokens,
                    time.time(),
                    "loop" if looped else "long_reasoning",
                )
            )
        return runaways

    def recent_json(self) -> list[dict[str, Any]]:
        return [asdict(runaway) for runaway in self.recent]

    def by_model_json(self) -> list[dict[str, Any]]:
        """Per model so far: finished choices, runaways and the tokens they burnt."""
        completions = totals(self.completions)
        runaways = totals(self.runaways)
        tokens = totals(self.runaway_tokens)
        models = sorted({labels[0] for labels in completions})
        return [
            {
                "model": model,
                "completions": sum(v for k, v in completions.items() if k[0] == model),
                "runaways": runaways.get((model,), 0.0),
                "runaway_tokens": tokens.get((model,), 0.0),
            }
            for model in models
        ]


def totals(counter: Counter) -> dict[tuple[str, ...], float]:
    """A labelled counter's values now, by its label values (in the counter's label order)."""
    found: dict[tuple[str, ...], float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found[tuple(sample.labels.values())] = sample.value
    return found
