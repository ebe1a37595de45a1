"""The phases of an exchange (one request through the pass-through) and the moves between.

An exchange is in exactly one phase, and only `move` changes it, along the table below; a
move the table does not have is a bug and raises `PhaseError` (the exchange ends that
request with a 500 or its stream's error event, never the connection's loop). Both fronts
drive the request side through the same calls (exchange.begin, take_body, body_done,
client_gone), the client to vLLM the response side (head, body, end, lost):

    BODY ──► QUEUED ──► CONNECTING ──► SENT ──► RELAY ──► DONE
      │         │            ▲  │        │  ▲              ▲
      │         │            └──┼────────┘  │ (a retry:    │
      │         └───────────────┼───────────┘  vLLM closed │
      └─────────────────────────┴──── DONE ◄───┴ a kept    │
                                                 connection) …from every phase

BODY: the client's request body is read. QUEUED: it is read whole, behind an earlier request
on its connection whose response is still going out (HTTP/1.1 pipelining). CONNECTING: a
connection to vLLM is being opened. SENT: the request is written to vLLM and its response's
head awaited. RELAY: vLLM's head went to the client and its body passes. DONE: the client's
response is over (`End` says how) or the client left.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    # A member is only ever equal to itself: its identity is its hash, which keeps the table
    # lookups in C (Enum's own __hash__ is a Python function, run twice a move).
    __hash__ = object.__hash__

    BODY = "reading the request body"
    QUEUED = "read, behind an earlier response on its connection"
    CONNECTING = "connecting to vLLM"
    SENT = "sent to vLLM, its response's head awaited"
    RELAY = "relaying vLLM's response"
    DONE = "over"


class End(enum.Enum):
    """How an exchange's client response ended (set on the move to DONE)."""

    FINISHED = "vLLM's response passed on to its end (or the stream ended by the sidecar)"
    CUT = "a response that could not be finished: the client's connection closed"
    ANSWERED = "the sidecar answered itself before vLLM's head"
    GONE = "the client left"


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.BODY: frozenset({Phase.QUEUED, Phase.CONNECTING, Phase.SENT, Phase.DONE}),
    Phase.QUEUED: frozenset({Phase.CONNECTING, Phase.SENT, Phase.DONE}),
    Phase.CONNECTING: frozenset({Phase.SENT, Phase.DONE}),
    Phase.SENT: frozenset({Phase.RELAY, Phase.CONNECTING, Phase.SENT, Phase.DONE}),
    Phase.RELAY: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class PhaseError(RuntimeError):
    """A move the table does not allow: a bug in the pass-through."""


def move(current: Phase, to: Phase) -> Phase:
    """`to`, when the table allows the move from `current`; else PhaseError."""
    if to not in MOVES[current]:
        raise PhaseError(f"an exchange cannot move from {current.name} to {to.name}")
    return to
