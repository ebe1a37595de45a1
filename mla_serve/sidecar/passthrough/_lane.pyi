"""The C lane (_lane.c): a connection's data_received that takes token chunks in C."""

from collections.abc import Callable
from typing import Any

MAX_FRAMES: int

class Lane:
    armed: bool
    def __init__(self, fallback: Callable[[bytes], None]) -> None: ...
    def __call__(self, data: bytes) -> None: ...
    def arm(
        self,
        conn: Any,
        exchange: Any,
        head: bytes,
        choice: Any,
        guard: Any,
        watch: Any,
        check_every: int,
        /,
    ) -> None: ...
    def disarm(self) -> None: ...

def frames(data: bytes, /) -> list[int] | None: ...
def taken() -> int: ...
