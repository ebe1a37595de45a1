"""The runaway guard: find reasoning loops in the pass-through's text, count them, stop them.

A looping model repeats the same text exactly (one paragraph, or a short phrase, over and
over) until `max_tokens`; DeepSeek-V4 users report 77k tokens of one paragraph. The
length-cap runaway counter (runaways.py) sees such a request only when it ends. This module
watches each choice's streamed text as it passes and confirms a loop when the tail of the
text is periodic:

    the last L characters have a period p (text[i] == text[i + p] over them), with
    L >= max(min_repeats * p, min_chars) and p <= window_chars // min_repeats.

So a paragraph must repeat `min_repeats` times, and a short unit (a phrase, one token, a
run of newlines) must also cover `min_chars` characters: a markdown rule, an indented
block or a few identical code lines never do.

Cost, per choice: the text is kept as a rolling tail of at most 2 x `window_chars`
characters, and every `check_every` characters one check runs: the last `probe_chars`
characters are searched for in the max period before them (`str.rfind`, in C); each
earlier occurrence at distance d is a candidate period, verified with one slice
comparison (C as well). At most `max_candidates` candidates per check. A periodic tail
always has its probe again at distance p, so no loop is missed; ordinary text rarely has a
32-character string twice, so most checks end after one search, and such a search also
says that no loop can be confirmed for the next `LoopConfig.quiet_chars` characters (736
with the defaults): the checks there are passed without a search (TailDetector says why
that finds the same loops at the same points).

Interface: `LoopPolicy.watch(request, model)` gives a `ResponseGuard` for one response (None
when the guard is off for that model); feed it every stream chunk (`add_chunk`, True when
the stream must be stopped now) or the whole body (`add_body`); `ending()` gives the SSE
events that end a stopped stream; `settle(completion)` marks loops on the runaway
classifier's choices before they are counted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from mla_serve.sidecar.passthrough.labels import Labels
from mla_serve.sidecar.passthrough.runaways import Completion, Usage

ACTIONS = ("off", "observe", "stop")
STOP_REASON = "loop_detected"  # the stopped choice's `stop_reason` (a vLLM field)
MARKER = "loop_guard"  # the final chunk's extra object describing the stop
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class LoopConfig:
    """What counts as a loop. The defaults: zero false positives on tests/loop_corpus.py."""

    min_repeats: int = 4  # k: the repeated unit appears at least this many times in a row
    window_chars: int = 4096  # tail kept per choice; the longest period is window // k
    min_chars: int = 1024  # the periodic tail covers at least this many characters
    check_every: int = 32  # characters between two checks (detection delay, at most)
    probe_chars: int = 32  # suffix searched for earlier in the tail
    max_candidates: int = 8  # candidate periods verified per check

    @property
    def max_period(self) -> int:
        return self.window_chars // self.min_repeats

    @cached_property  # read by every detector a response makes
    def quiet_chars(self) -> int:
        """Characters after a look whose probe was nowhere earlier in which no loop can be
        confirmed (TailDetector): the least of max(min_repeats * p, min_chars) - p over the
        periods p, less the probe. That function falls, then rises, in p: its least is at
        min_chars / min_repeats, rounded either way, within 1..max_period."""
        k, m, top = self.min_repeats, self.min_chars, max(self.max_period, 1)
        around = {min(max(p, 1), top) for p in (m // k, -(-m // k), 1, top)}
        return max(min(max(k * p, m) - p for p in around) - self.probe_chars, 0)

    def problems(self) -> list[str]:
        """What makes this configuration unusable; empty when it is fine."""
        found = []
        if self.min_repeats < 2:
            found.append("--loop-min-repeats must be at least 2")
        if self.min_chars < self.probe_chars + 1:
            found.append(f"--loop-min-chars must be more than {self.probe_chars}")
        if self.window_chars < self.min_chars:
            found.append("--loop-window-chars must be at least --loop-min-chars")
        return found


@dataclass(frozen=True)
class Loop:
    """A confirmed loop: its period and how far it reached when confirmed."""

    period_chars: int
    repeats: int  # whole periods in the verified periodic tail
    channel: str  # "reasoning" or "content" (chat), "text" (completions)
    tokens: int | None  # tokens of the choice before detection (streams only)


class TailDetector:
    """Exact periodic repetition at the end of a growing text (one channel of one choice).

    It looks at points: a token's end once `check_every` characters came since the last
    point. At each point the kept tail grows by those characters and is trimmed to
    `window_chars` once it passes twice that (its length is counted at every point, the
    string itself is joined where the detector looks, in place). A look searches the last
    `max_period + probe_chars` characters only.

    Points where no loop can be confirmed yet are passed without a look: before the text
    reaches `min_chars`, and after a look that found its probe nowhere before it (the usual
    answer on ordinary text). A loop of period p confirmed at length t makes its last
    span(p) = max(min_repeats * p, min_chars) characters p-periodic; a probe that ended at
    length s with s - probe_chars >= t - span(p) + p lies in that periodic stretch and so
    occurs again p characters earlier, within the searched window. So after a look at s
    whose probe is nowhere earlier, no point up to s + `LoopConfig.quiet_chars` (the least
    span(p) - p, less the probe) can confirm, and passing them finds every loop at the same
    point, with the same period and repeats, as looking at each."""

    __slots__ = (
        "check_every",
        "config",
        "fresh",
        "max_candidates",
        "max_period",
        "min_chars",
        "min_repeats",
        "pieces",
        "pos",
        "probe_chars",
        "quiet",
        "quiet_end",
        "size",
        "tail",
        "window",
    )

    def __init__(self, config: LoopConfig) -> None:
        self.config = config
        # the configuration's figures, read at every point
        self.check_every = config.check_every
        self.window = config.window_chars
        self.min_chars = config.min_chars
        self.min_repeats = config.min_repeats
        self.probe_chars = config.probe_chars
        self.max_period = config.max_period
        self.max_candidates = config.max_candidates
        self.quiet = config.quiet_chars
        self.tail = ""  # the kept tail as of the last look
        self.pieces: list[str] = []  # text since the last look
        self.fresh = 0  # characters since the last point
        self.pos = 0  # characters of text up to the last point
        self.size = 0  # the kept tail's length as of the last point
        self.quiet_end = config.min_chars - 1  # no point up to this length can confirm

    def feed(self, text: str) -> tuple[int, int] | None:
        """Add text; (period, repeats) once the tail is a loop, else None."""
        self.pieces.append(text)
        fresh = self.fresh + len(text)
        if fresh < self.check_every:
            self.fresh = fresh
            return None
        return self._point(fresh)

    def feed_texts(self, texts: list[str]) -> tuple[int, int] | None:
        """`feed` for each text in turn (tokens' texts, in order), in one call; the answer
        of the first point that confirms a loop (the texts after it are not fed: a confirmed
        loop's text is not looked at again)."""
        check_every = self.check_every
        pieces = self.pieces
        fresh = self.fresh
        for text in texts:
            pieces.append(text)
            fresh += len(text)
            if fresh >= check_every:
                found = self._point(fresh)
                fresh = 0
                if found is not None:
                    return found
        self.fresh = fresh
        return None

    def until_check(self) -> int:
        """Characters of text still to come before the next point that may confirm: the
        text may be handed over in one piece (`feed_texts`) up to the token that reaches
        them."""
        fresh = self.fresh
        return max(self.check_every - fresh, self.quiet_end + 1 - self.pos - fresh)

    def feed_all(self, text: str) -> tuple[int, int] | None:
        """Check a whole text at once: its tail only, so a loop that ran to the end."""
        kept = text[-2 * self.window :]
        self.pieces.append(kept)
        self.pos += len(text) - len(kept)
        return self._point(self.fresh + len(kept), look=True)

    def _point(self, fresh: int, look: bool = False) -> tuple[int, int] | None:
        """A point, `fresh` characters after the last: the tail's length counted, and a look
        where a loop may be confirmed (or always, `look`)."""
        self.fresh = 0
        self.pos += fresh
        size = self.size + fresh
        if size > 2 * self.window:
            size = self.window
        self.size = size
        if self.pos <= self.quiet_end and not look:
            return None
        return self.check()

    def check(self) -> tuple[int, int] | None:
        """The look: the kept tail made current, then searched."""
        pieces = self.pieces
        added = pieces[0] if len(pieces) == 1 else "".join(pieces)
        pieces.clear()
        tail = self.tail
        self.tail = ""  # `tail` is the string's one reference now: `+=` may grow it in place
        tail += added
        size = self.size
        if len(tail) > size:
            tail = tail[-size:]
        self.tail = tail
        if size < self.min_chars:
            return None
        probe_size = self.probe_chars
        probe = tail[-probe_size:]
        end = size - 1  # occurrences that end before the last character
        first = max(size - probe_size - self.max_period, 0)  # nothing farther can be a period
        min_repeats, min_chars = self.min_repeats, self.min_chars
        for candidate in range(self.max_candidates):
            start = tail.rfind(probe, first, end)
            if start < 0:
                if candidate == 0:  # the probe is nowhere earlier: `quiet` more can't loop
                    self.quiet_end = self.pos + self.quiet
                return None
            period = size - probe_size - start
            span = max(min_repeats * period, min_chars)
            if span > size:
                return None  # a long period that has not repeated often enough yet
            if tail[size - span + period :] == tail[size - span : size - period]:
                return period, self._repeats(tail, period, span)
            end = start + probe_size - 1
        return None

    @staticmethod
    def _repeats(tail: str, period: int, span: int) -> int:
        """Whole periods of the periodic tail, extended as far back as the kept tail goes."""
        size = len(tail)
        while span + period <= size and (
            tail[size - span - period : size - span] == tail[size - span : size - span + period]
        ):
            span += period
        return span // period


@dataclass
class _Watch:
    """One choice of a response: its detector, channel, tokens so far, loop, finish."""

    detector: TailDetector
    channel: str = ""
    tokens: int = 0
    loop: Loop | None = None
    finished: bool = False


class LoopMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.loops = Counter(
            "mla_serve_reasoning_loops",
            "Choices whose text became an exact loop (periodic tail), by channel.",
            ["model", "channel"],
            registry=registry,
        )
        self.tokens_before = Histogram(
            "mla_serve_loop_detection_tokens",
            "Tokens a streamed choice had emitted when its loop was confirmed.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.stops = Counter(
            "mla_serve_loop_stops",
            "Choices the guard ended early (loop action stop).",
            ["model"],
            registry=registry,
        )
        self.saved = Counter(
            "mla_serve_loop_tokens_saved",
            "Tokens not generated because the guard stopped a loop: max_tokens - emitted.",
            ["model"],
            registry=registry,
        )


@dataclass(frozen=True)
class LoopPolicy:
    """The guard's settings: what a loop is, what to do per model, vLLM-side defaults."""

    action: str = "observe"
    model_actions: Mapping[str, str] = field(default_factory=dict)
    config: LoopConfig = field(default_factory=LoopConfig)
    # Set on requests that do not set them (vLLM's own request fields; None = leave alone).
    repetition_detection: Mapping[str, int] | None = None
    thinking_token_budget: int | None = None

    def action_for(self, model: str | None) -> str:
        return self.model_actions.get(model or "", self.action)

    def apply_defaults(self, request: dict[str, Any]) -> bool:
        """Add the configured vLLM defaults to a request that lacks them; True if changed."""
        changed = False
        if self.repetition_detection is not None and request.get("repetition_detection") is None:
            request["repetition_detection"] = dict(self.repetition_detection)
            changed = True
        if self.thinking_token_budget is not None and request.get("thinking_token_budget") is None:
            request["thinking_token_budget"] = self.thinking_token_budget
            changed = True
        return changed

    def watch(
        self,
        request: Mapping[str, Any],
        model: str | None,
        metrics: LoopMetrics,
        chat: bool,
        label: str = "unknown",
    ) -> ResponseGuard | None:
        """The guard of the response to `request` for `model` (its metrics labelled `label`,
        a bounded value: labels.Labels); None when the guard is off for that model."""
        action = self.action_for(model)
        if action == "off":
            return None
        return ResponseGuard(self.config, action, label, _max_tokens(request, chat), metrics)


def _max_tokens(request: Mapping[str, Any], chat: bool) -> int | None:
    """The request's output cap as vLLM reads it; None when vLLM derives it from the context."""
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None if chat else 16  # vLLM's CompletionRequest default


class ResponseGuard:
    """The guard for one response: every choice's detector, the stop decision, the ending."""

    def __init__(
        self,
        config: LoopConfig,
        action: str,
        label: str,
        max_tokens: int | None,
        metrics: LoopMetrics,
    ) -> None:
        self.config = config
        self.action = action
        self.label = label  # the model, as its metrics' label (bounded: labels.Labels)
        self.max_tokens = max_tokens
        self.metrics = metrics
        self.watches: dict[int, _Watch] = {}
        self.head: dict[str, Any] = {}
        self.looping = 0  # choices with a confirmed loop
        self.stopped = False

    # -- streams ---------------------------------------------------------------------------
    def add_chunk(self, chunk: dict[str, Any]) -> bool:
        """Feed one stream chunk; True when the stream must end now (action stop)."""
        if not self.head and chunk.get("id") is not None:
            self.head = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return False
        for raw in choices:
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            if not isinstance(index, int):
                continue
            watch = self.watches.get(index)
            if watch is None:
                watch = self.watches[index] = _Watch(TailDetector(self.config))
            delta = raw.get("delta")
            if delta.__class__ is dict:
                if "role" not in delta:  # vLLM's first chunk per choice carries no token
                    watch.tokens += 1
                if watch.loop is None:  # a confirmed loop needs no more looking at
                    text = delta.get("reasoning")
                    if text:
                        self._feed(watch, "reasoning", text)
                    text = delta.get("content")
                    if text:
                        self._feed(watch, "content", text)
            else:
                watch.tokens += 1
                text = raw.get("text")
                if text and watch.loop is None:
                    self._feed(watch, "text", text)
            if raw.get("finish_reason"):
                watch.finished = True
        return self._stopping()

    def add_token(self, index: int, channel: str, text: str) -> bool:
        """`add_chunk` for a chunk whose one choice (`index`) has a delta of one `channel`
        ("reasoning" or "content") and no finish_reason, once `head` is set: vLLM's token
        chunk, which the pass-through reads without parsing it whole (classify.TokenShape)."""
        watch = self.watches.get(index)
        if watch is None:
            watch = self.watches[index] = _Watch(TailDetector(self.config))
        watch.tokens += 1
        if text and watch.loop is None:
            self._feed(watch, channel, text)
        return self._stopping()

    def took(self, index: int, tokens: int, texts: list[str]) -> int:
        """`add_token` for `tokens` token chunks the C lane took (lane.py): counted, and their
        texts, of the channel the detector watches, added; the lane hands them over where
        they reach the detector's next check (its checkpoint), so the check runs after the
        same token as it would through add_token. The lane's next budget (`lane`'s): the
        characters to the detector's next check, 0 when the lane must take no more (the
        stream stopped, or its loop is found and no text is looked at from here on)."""
        watch = self.watches[index]
        watch.tokens += tokens
        if texts and watch.loop is None:
            found = watch.detector.feed_texts(texts)
            if found is not None:
                self._found(watch, watch.channel, found)
                if self._stopping():
                    return 0
        if self.stopped or watch.loop is not None:
            return 0
        return watch.detector.until_check()

    def lane(self) -> tuple[str | None, int] | None:
        """The guard's terms for the C lane (lane.py), which takes choice 0's token chunks
        without showing each to `add_token`: None when each must be shown (the stream's head
        not seen yet, the stream stopped, a loop found under action stop, where every token
        decides whether the stream ends, or choice 0's channel not yet set by a first text);
        else (the channel whose texts the lane keeps for the detector, None once choice 0
        loops and no text is looked at; the characters of text until the detector's next
        check, where the lane hands its texts over: `took`)."""
        watch = self.watches.get(0)
        if watch is None or not self.head or self.stopped:
            return None
        if self.looping and self.action == "stop":
            return None
        if watch.loop is not None:
            return None, 1 << 62
        if not watch.channel:
            return None
        return watch.channel, watch.detector.until_check()

    def _feed(self, watch: _Watch, channel: str, text: Any) -> None:
        if text.__class__ is not str or watch.loop is not None:
            return
        if channel != watch.channel:  # a new channel is progress: start over
            watch.channel = channel
            watch.detector = TailDetector(self.config)
        self._found(watch, channel, watch.detector.feed(text))

    def _found(self, watch: _Watch, channel: str, found: tuple[int, int] | None) -> None:
        """A detector's answer: a loop confirmed (counted) when it found one."""
        if found is not None:
            watch.loop = Loop(found[0], found[1], channel, watch.tokens)
            self.looping += 1
            self.metrics.loops.labels(self.label, channel).inc()
            self.metrics.tokens_before.labels(self.label).observe(watch.tokens)

    def _stopping(self) -> bool:
        """Whether the stream stops now: action stop, and every running choice looping."""
        if self.looping and self.action == "stop" and self._all_looping():
            self.stopped = True
        return self.stopped

    def _all_looping(self) -> bool:
        running = [watch for watch in self.watches.values() if not watch.finished]
        return bool(running) and all(watch.loop is not None for watch in running)

    def ending(self, include_usage: bool) -> bytes:
        """The SSE events that end a stopped stream: each looping choice's final chunk with
        `finish_reason: "length"`, `stop_reason: "loop_detected"` and the `loop_guard`
        marker, the usage chunk when the client asked for one, then `[DONE]`."""
        model = self.label
        chat = self.head.get("object") == "chat.completion.chunk"
        events = []
        for index, watch in sorted(self.watches.items()):
            if watch.finished or watch.loop is None:
                continue
            saved = None if self.max_tokens is None else max(self.max_tokens - watch.tokens, 0)
            self.metrics.stops.labels(model).inc()
            if saved:
                self.metrics.saved.labels(model).inc(saved)
            choice: dict[str, Any] = {"index": index}
            if chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            choice.update(logprobs=None, finish_reason="length", stop_reason=STOP_REASON)
            marker = {
                "action": "stop",
                "channel": watch.loop.channel,
                "period_chars": watch.loop.period_chars,
                "repeats": watch.loop.repeats,
                "completion_tokens": watch.tokens,
                "tokens_saved": saved,
            }
            events.append(self.head | {"choices": [choice], MARKER: marker})
        if include_usage:
            tokens = sum(watch.tokens for watch in self.watches.values())
            # The prompt's size is vLLM's to tell, and vLLM is gone: null, not a guess.
            usage = {"prompt_tokens": None, "total_tokens": None, "completion_tokens": tokens}
            events.append(self.head | {"choices": [], "usage": usage})
        out = b"".join(
            b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
            for event in events
        )
        return out + b"data: [DONE]\n\n"

    # -- whole responses -------------------------------------------------------------------
    def add_body(self, body: dict[str, Any]) -> None:
        """A non-streamed response: check each choice's final reasoning and content."""
        for index, loop in final_loops(body, self.config).items():
            watch = self.watches.setdefault(index, _Watch(TailDetector(self.config)))
            watch.finished = True
            watch.loop = loop
            self.metrics.loops.labels(self.label, loop.channel).inc()

    # -- the runaway classifier ------------------------------------------------------------
    def settle(self, completion: Completion) -> None:
        """Mark looping choices on the classifier; a stopped stream ends at "length" with the
        tokens it emitted (vLLM's usage never came)."""
        for index, watch in self.watches.items():
            choice = completion.choices.get(index)
            if choice is None:
                continue
            choice.loop = watch.loop is not None
            if self.stopped and not watch.finished and watch.loop is not None:
                choice.finish_reason = "length"
        if self.stopped and completion.usage.completion_tokens is None:
            tokens = sum(watch.tokens for watch in self.watches.values())
            completion.usage = Usage(None, tokens, None)


def final_loops(body: Mapping[str, Any], config: LoopConfig) -> dict[int, Loop]:
    """The choices of a whole (non-streamed) response whose final text ends in a loop: the
    loop ran to the end. Reasoning is checked, then content (or a completion's text)."""
    found: dict[int, Loop] = {}
    for raw in body.get("choices") or ():
        if not isinstance(raw, dict) or not isinstance(raw.get("index", 0), int):
            continue
        message = raw.get("message")
        parts = (
            (("reasoning", message.get("reasoning")), ("content", message.get("content")))
            if isinstance(message, dict)
            else (("text", raw.get("text")),)
        )
        for channel, text in parts:
            if isinstance(text, str) and text:
                hit = TailDetector(config).feed_all(text)
                if hit is not None:
                    found[raw.get("index", 0)] = Loop(hit[0], hit[1], channel, None)
                    break
    return found


class LoopGuard:
    """The pass-through's hook: the policy and the metrics, one per sidecar."""

    def __init__(
        self, policy: LoopPolicy, registry: CollectorRegistry, labels: Labels | None = None
    ) -> None:
        self.policy = policy
        self.metrics = LoopMetrics(registry)
        self.labels = labels if labels is not None else Labels()

    def prepare(self, request: dict[str, Any]) -> bool:
        """Set vLLM-side defaults on a request; True when the body must be re-encoded."""
        return self.policy.apply_defaults(request)

    def watch(self, request: Mapping[str, Any], path: str) -> ResponseGuard | None:
        """A guard for the response to `request` (None when the guard is off for its model)."""
        model = request.get("model")
        model = model if isinstance(model, str) else None
        chat = path == "/v1/chat/completions"
        return self.policy.watch(request, model, self.metrics, chat, self.labels.model(model))
