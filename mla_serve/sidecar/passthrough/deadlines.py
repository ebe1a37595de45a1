"""The pass-through's deadlines: when each phase of an exchange gives up, and why.

One timer per exchange (exchange.py `_tick`) asks these by phase:
- reading the request body: a silence of `--body-timeout` since its last bytes, or
  `--body-deadline` after its head (408: `body_wait`, `body_late`);
- waiting for vLLM: a connection and the response's head within `--upstream-timeout` (504);
- relaying vLLM's body: no silence over `--stream-idle-timeout` while the sidecar waits on
  it (not while the client is behind), and a body that is not a stream whole within
  `--response-deadline` after its head (`response_check`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla_serve.sidecar.passthrough.errors import Refused

if TYPE_CHECKING:
    from mla_serve.sidecar.settings import Settings


def body_wait(settings: Settings, started: float, last: float) -> float:
    """When reading a request body gives up: a silence of the body timeout since its `last`
    bytes, or the body deadline after its head."""
    return min(last + settings.body_timeout, started + settings.body_deadline)


def body_late(settings: Settings, started: float, last: float) -> Refused:
    """The 408 of a request body not read in time (body_wait)."""
    if started + settings.body_deadline <= last + settings.body_timeout:
        return Refused(408, f"request body not received within {settings.body_deadline:g} s")
    return Refused(408, f"request body stalled for {settings.body_timeout:g} s")


def response_check(
    settings: Settings, since: float, waiting: bool, ends_by: float, now: float
) -> tuple[str | None, float]:
    """The one rule for a response body after its head: it fails when vLLM has been silent
    for the idle timeout since `since` while the sidecar was `waiting` on it, or at `ends_by`
    (a response that is not a stream: the response deadline after its head). (why it failed
    or None, when to check next)."""
    if now >= ends_by:
        return f"vLLM's response did not end within {settings.response_deadline:g} s", now
    idle = settings.stream_idle_timeout
    if not waiting:
        return None, min(now + idle, ends_by)
    if now - since >= idle:
        return f"vLLM sent nothing for {idle:g} s", now
    return None, min(since + idle, ends_by)
