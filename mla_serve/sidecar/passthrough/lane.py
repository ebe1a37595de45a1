"""The C lane, when it is built: reads of a stream's token chunks done without Python.

`_lane.c` (typed in `_lane.pyi`) is an accelerator of the one classifier
(classify.TokenShape): an armed `Lane` is a connection's `data_received` that takes a read
which is nothing but whole chunks of HTTP/1.1 chunked coding, each a token chunk of the
stream's shape, writes it to the client as vLLM framed it, and keeps on its own object what
the Python path would have done with it: the tokens taken, whether a visible one was among
them, their texts for the runaway guard's detector. The exchange collects that (`drain`)
before any read it handles itself, at the end of the response, and where the texts reach
the detector's next check (the lane calls the exchange's `checkpoint` there). Anything else
disarms the lane and goes to the Python method (`fallback`). Without a C compiler the package
installs without it (`BUILT` is False) and every read is Python's, with the same effects.
"""

from __future__ import annotations

__all__ = ["BUILT", "Lane", "frames", "taken"]

try:
    from mla_serve.sidecar.passthrough import _lane
    from mla_serve.sidecar.passthrough._lane import Lane
except ImportError:  # a build without a C compiler: every read in Python, the same effects
    _lane = None  # type: ignore[assignment]
    Lane = None  # type: ignore[assignment,misc]

BUILT = _lane is not None


def taken() -> int:
    """Reads of vLLM's sockets done in C so far (every connection of this process)."""
    return _lane.taken() if _lane is not None else 0


def frames(data: bytes) -> list[int] | None:
    """The payload sizes when `data` is whole chunks of data only (canonical chunked coding)."""
    assert _lane is not None
    return _lane.frames(data)
