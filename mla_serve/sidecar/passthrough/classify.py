"""What the pass-through reads in a request and in vLLM's answer: one classifier.

The request (`read_request`): checked as vLLM's protocol would check it, its three fields
kept (`stream`, `model`, `stream_options.include_usage`), and usage asked for on a stream
that did not ask (spliced into the client's bytes, not re-serialized).

The answer's events are JSON (`loads`). A stream's token chunks, nearly every event of it,
are read without parsing them whole: `TokenShape` is the bytes all of that stream's token
chunks share, learnt from the first token chunk of the stream, parsed whole (for a chat
stream, its head from the first chunk, the role, and its tail from the first token chunk
that fits, so that no token chunk is parsed whole): `head`
(everything before the choice's one string field: id, object, created, model, the choice's
index, and for chat the opening of its delta), the field's name (`content` or `reasoning`
for chat, `text` for `/v1/completions`), a JSON string, and `tail` (everything after the
string: null logprobs and finish_reason, vLLM's other null fields, the end of the event).
An event matches when it is exactly those bytes around a JSON string; its text is the
string decoded as json.loads decodes it. Anything else (another shape, an escape the JSON
grammar refuses, bytes that are not UTF-8) is parsed whole. The C lane (_lane.c) matches the
same shape, given as bytes, for whole reads of token chunks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mla_serve.sidecar.passthrough.errors import Refused

if TYPE_CHECKING:
    from mla_serve.sidecar.guard.loops import LoopGuard, ResponseGuard

CLASSIFIED = ("/v1/chat/completions", "/v1/completions")

# JSON's string grammar (RFC 8259), the characters between the quotes.
_STRING = re.compile(rb'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
# The scanner json.loads ends in (C, when _json is built), made for json's default decoder.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]

# The one string field of a token chunk, by the object vLLM streams: (its bytes through the
# opening quote, the channel its text is).
Keys = tuple[tuple[bytes, str], ...]
CHAT_KEYS: Keys = ((b'"content":"', "content"), (b'"reasoning":"', "reasoning"))
TEXT_KEYS: Keys = ((b'"text":"', "text"),)
# A token chunk's choice: the one field above, then only these, each null.
_CHAT_NULLS = frozenset({"logprobs", "finish_reason", "stop_reason", "token_ids"})
_TEXT_NULLS = frozenset(
    {"logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids",
     "weight_versions"}
)  # fmt: skip
_TOP = frozenset({"id", "object", "created", "model", "choices"})
# What follows a chat token chunk's string, in vLLM's compact JSON: the closing quote, the
# delta's end, the choice's other fields (null), the choices' end, the chunk's other fields
# (null), the event's end. `_settle` checks the names.
_NULL_MEMBERS = rb'((?:,"[A-Za-z_][A-Za-z0-9_]*":null)*)'
_CHAT_TAIL = re.compile(rb'"\}' + _NULL_MEMBERS + rb"\}\]" + _NULL_MEMBERS + rb"\}\n\n")
_NAME = re.compile(rb'"([^"]*)"')
_SETTLED: set[bytes] = set()  # tails `_settle` found right (bytes only: no stream's own)
# A chat stream's first chunk (the role) up to its delta's contents: the head its token
# chunks share, when nothing before `choices` is an object or an array.
_CHAT_HEAD_END = b'"choices":[{"index":0,"delta":{'


def _letters(keys: Keys) -> dict[int, tuple[bytes, str, int]]:
    """Each key by its first letter (the byte after its opening quote): one comparison."""
    return {key[1]: (key, channel, len(key)) for key, channel in keys}


_LETTERS = {CHAT_KEYS: _letters(CHAT_KEYS), TEXT_KEYS: _letters(TEXT_KEYS)}


class TokenShape:
    """The bytes one stream's token chunks share (see the module's docstring)."""

    __slots__ = ("_at", "_by_letter", "_end", "head", "keys", "tail")

    def __init__(self, head: bytes, keys: tuple[tuple[bytes, str], ...], tail: bytes) -> None:
        self.head = head
        self.keys = keys
        self.tail = tail
        self._at = len(head)
        self._end = len(tail) + 1  # the closing quote and the tail
        self._by_letter = _LETTERS.get(keys) or _letters(keys)

    def match(self, event: bytes) -> tuple[str, str] | None:
        """(channel, text) when `event` is a token chunk of this shape; None otherwise."""
        if not event.startswith(self.head):
            return None
        at = self._at
        try:
            key, channel, size = self._by_letter[event[at + 1]]
        except (KeyError, IndexError):
            return None
        if not event.startswith(key, at):
            return None
        start = at + size
        end = _STRING.match(event, start).end()  # type: ignore[union-attr]  # matches ""
        if (  # not this shape's end (34: the closing quote), nor a first one that settles it
            end + self._end != len(event) or event[end] != 34 or not event.endswith(self.tail)
        ) and (self.tail or not self._settle(event, end)):
            return None
        raw = event[start:end]
        try:
            text = raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
        if b"\\" in raw:
            text = _scanstring(text + '"', 0)[0]
        return channel, text

    def _settle(self, event: bytes, end: int) -> bool:
        """An expected shape (no tail yet) meets its first token chunk, `end` its string's
        end: the tail is what follows the string when it holds only what `learn` allows
        there (each other field of the choice and of the chunk null, the closing brackets,
        the event's end); the shape is then exact."""
        tail = event[end + 1 :]
        if tail not in _SETTLED:
            found = _CHAT_TAIL.fullmatch(event, end)
            if found is None:
                return False
            choice, top = found.groups()
            if not all(name.decode() in _CHAT_NULLS for name in _NAME.findall(choice)):
                return False
            if any(name.decode() in _TOP for name in _NAME.findall(top)):
                return False
            if len(_SETTLED) < 64:  # what one vLLM sends: a few, the same for every stream
                _SETTLED.add(tail)
        self.tail = tail
        self._end = len(self.tail) + 1
        return True

    def arm_args(self) -> tuple[bytes, tuple[tuple[bytes, str], ...], bytes]:
        """The shape as the C lane takes it (an exact one: `tail` known)."""
        return self.head, self.keys, self.tail


def learn(event: bytes, chunk: dict[str, Any], first: bool = False) -> TokenShape | None:
    """The token shape of the stream `event` (one `data: {...}\\n\\n` event, parsed whole as
    `chunk`) belongs to, when it is a token chunk: one choice, index 0, one string field and
    every other field null. None when it is not (a role, usage, finish or tool chunk), except
    for a chat stream's `first` chunk of one choice 0 (its role): the shape its token chunks
    are expected to have, the same head and no tail yet (`TokenShape.match` takes the tail
    from the first token chunk that fits), when nothing before its choices is an object or
    an array (else the head is not flat, and only a token chunk may tell the shape)."""
    choices = chunk.get("choices")
    if choices.__class__ is not list or len(choices) != 1:
        return None
    for name, value in chunk.items():
        if value is not None and name not in _TOP:
            return None
    choice = choices[0]
    if choice.__class__ is not dict or choice.get("index") != 0:
        return None
    kind = chunk.get("object")
    if kind == "chat.completion.chunk":
        delta = choice.get("delta")
        if delta.__class__ is not dict or len(delta) != 1:
            return _expected(event) if first else None
        ((field, text),) = delta.items()
        keys, nulls, own = CHAT_KEYS, _CHAT_NULLS, "delta"
    elif kind == "text_completion":
        field, text = "text", choice.get("text")
        keys, nulls, own = TEXT_KEYS, _TEXT_NULLS, "text"
    else:
        return None
    key = next((key for key, channel in keys if channel == field), None)
    if text.__class__ is not str or key is None:
        return _expected(event) if first and own == "delta" else None
    for name, value in choice.items():
        if name != "index" and name != own and (name not in nulls or value is not None):
            return None
    at = event.find(key)
    if at < 0:
        return None
    found = _STRING.match(event, at + len(key))
    assert found is not None  # the pattern matches the empty string
    # The string ends at the first quote JSON's grammar leaves; what follows is the tail.
    return TokenShape(event[:at], keys, event[found.end() + 1 :])


def _expected(event: bytes) -> TokenShape | None:
    at = event.find(_CHAT_HEAD_END)
    if at < 0 or event.count(b"{", 0, at) != 1 or event.count(b"[", 0, at) != 0:
        return None
    return TokenShape(event[: at + len(_CHAT_HEAD_END)], CHAT_KEYS, b"")


def one_event(data: bytes) -> bool:
    """vLLM's shape: one whole `data: {...}` event of one line, LF-terminated, in one read."""
    return (
        data.startswith(b"data: {")
        and data.find(b"\n") == len(data) - 2
        and data.endswith(b"\n\n")
        and b"\r" not in data
    )


def loads(data: bytes) -> Any:
    """`json.loads(data)` for one event's data, without its per-call steps in Python
    (encoding detection, two whitespace regexes, three frames): an object in UTF-8, which is
    what vLLM sends, is decoded as json.loads decodes it and scanned by the same scanner.
    Anything else (another encoding, leading whitespace) goes through json.loads itself, so
    the result and the errors (ValueError, RecursionError) are json.loads's."""
    if data[:1] != b"{" or data[1:2] == b"\x00":  # json.detect_encoding's UTF-16/32 cases
        return json.loads(data)
    text = data.decode("utf-8", "surrogatepass")
    try:
        value, end = _SCAN(text, 0)
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    if end != len(text):
        rest = text[end:].lstrip(" \t\n\r")
        if rest:
            raise json.JSONDecodeError("Extra data", text, len(text) - len(rest))
    return value


@dataclass
class Request:
    """What the pass-through keeps of a classified request; the parsed tree is not kept."""

    body: bytes = b""
    stream: bool = False
    model: str | None = None
    strip_usage: bool = False  # usage was asked for here: dropped on the way back
    guard: ResponseGuard | None = None  # the runaway guard's watch on the response
    extra: dict[str, Any] = field(default_factory=dict)


def read_request(
    body: bytes, max_values: int, loops: LoopGuard | None = None, path: str = ""
) -> Request:
    """Check a classified request the way vLLM's protocol would, keep the three fields the
    pass-through needs, and add `stream_options.include_usage` to a stream without it. With
    the runaway guard on: its vLLM-side defaults are set on the request (which is then
    re-encoded) and its watch on the response is made. Refused for a request vLLM would
    refuse as malformed."""
    values = body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
    if values > max_values:
        raise Refused(413, f"request body has too many JSON values ({values} > {max_values})")
    try:
        document = json.loads(body)
    except RecursionError:
        raise Refused(400, "malformed JSON body: nested too deeply") from None
    except ValueError as error:
        raise Refused(400, f"malformed JSON body: {error}") from None
    if not isinstance(document, dict):
        raise Refused(400, "malformed JSON body: the body must be a JSON object")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Refused(400, "'stream' must be a boolean")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Refused(400, "'stream_options' must be an object")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise Refused(400, "'stream_options.include_usage' must be a boolean")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise Refused(400, "'model' must be a string")
    request = Request(stream=bool(stream), model=model)
    if loops is not None:
        request.guard = loops.watch(document, path)
        if loops.prepare(document):
            body = json.dumps(document).encode()
    del document
    if request.stream and not usage:
        body = _with_usage(body, options)
        request.strip_usage = True
    request.body = body
    return request


def _with_usage(body: bytes, options: dict[str, Any] | None) -> bytes:
    """The body with `"stream_options": {..., "include_usage": true}` as its last member.

    JSON parsers keep the last of duplicate keys (Python's, so vLLM's), so appending keeps
    every byte the client sent and wins over its own `stream_options`."""
    member = json.dumps({**(options or {}), "include_usage": True}, separators=(",", ":"))
    end = len(body.rstrip(b" \t\r\n"))
    if end == 0 or body[end - 1 : end] != b"}":  # another encoding (UTF-16/32): rebuild
        document = json.loads(body)
        document["stream_options"] = json.loads(member)
        return json.dumps(document).encode()
    inner = body[: end - 1].rstrip(b" \t\r\n")
    comma = b"" if inner.endswith(b"{") else b","
    return inner + comma + b'"stream_options":' + member.encode() + body[end - 1 :]
