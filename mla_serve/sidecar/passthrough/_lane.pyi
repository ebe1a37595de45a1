"""The C lane (_lane.c): a connection's data_received that takes token chunks in C.

It works on its own object only: the shape it was armed with, what it took since it was
last drained, and the callables it was given (the client transport's `write`, the event
loop's clock, the exchange's checkpoint).
"""

from collections.abc import Callable

MAX_FRAMES: int

class Lane:
    armed: bool
    last_read: float  # the loop's time of the last read taken here (0.0 before any)
    def __init__(self, fallback: Callable[[bytes], object]) -> None: ...
    def __call__(self, data: bytes) -> None: ...
    def arm(
        self,
        head: bytes,
        keys: tuple[tuple[bytes, str, bool], ...],
        tail: bytes,
        channel: str | None,
        budget: int,
        write: Callable[[bytes], object],
        clock: Callable[[], float],
        check: Callable[[], int] | None = None,
        /,
    ) -> None:
        """Take reads of token chunks of the shape `head`, one of `keys` (its bytes through the
        string's opening quote, its channel, whether its text is visible content), a JSON
        string, `tail`; `write` each read taken as it came. `channel`: when not None, only
        that channel's tokens, their texts kept; where they reach `budget` characters, the
        read so far is written and `check()` (given with a channel, and only then) answers
        the next budget (0: the rest of the read, and the reads after it, are the Python
        path's)."""
    def disarm(self) -> None: ...
    def drain(self) -> tuple[int, bool, list[str]] | None:
        """What was taken since the lane was armed or last drained: (token chunks, whether one
        had visible text, the texts kept); None when nothing was."""

def frames(data: bytes, /) -> list[int] | None: ...
def taken() -> int: ...
