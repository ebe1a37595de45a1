"""Which paths the pass-through forwards: vLLM's OpenAI routes, checked after normalization.

The server has already percent-decoded the path once (`%2e` → `.`, `%2f` → `/`). Here dot
segments are removed (RFC 3986 §5.2.4) and repeated slashes collapsed, so the route that is
checked, counted and forwarded is the one vLLM would route to: `/v1/../metrics` becomes
`/metrics` and is refused, `/v1/./chat/completions` becomes `/v1/chat/completions` and is
counted. A path that still holds a `%` or a byte outside the unreserved set after decoding
(double encoding, control characters) is refused rather than guessed at.
"""

from __future__ import annotations

import re

# vLLM's OpenAI-compatible routes (vllm/entrypoints/openai, every supported release); `*` is one
# path segment. vLLM's admin routes (/sleep, /scale_elastic_ep, /collective_rpc, LoRA
# loading, profiling, /metrics...) are deliberately absent.
OPENAI_ROUTES = (
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/*",
    "/v1/responses/*/cancel",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/rerank",
    "/v1/score",
    "/v1/messages",
    "/v1/messages/count_tokens",
)

_SAFE = re.compile(r"[A-Za-z0-9._~:@!$&'()*+,;=/-]*")  # RFC 3986 pchar minus "%"
_SEGMENT = re.compile(r"[A-Za-z0-9._~:@!$&'()+,;=-]+")


def normalize(path: str) -> str | None:
    """The path with dot segments removed and slashes collapsed; None if it is unsafe."""
    if not path.startswith("/") or _SAFE.fullmatch(path) is None:
        return None
    out: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return "/" + "/".join(out)


class Routes:
    """An allow-list of paths; entries may use `*` for exactly one segment."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.exact: frozenset[str] = frozenset(p for p in patterns if "*" not in p)
        self.wild: tuple[tuple[str, ...], ...] = tuple(
            tuple(p.split("/")) for p in patterns if "*" in p
        )

    def allows(self, path: str) -> bool:
        if path in self.exact:
            return True
        parts = path.split("/")
        for pattern in self.wild:
            if len(pattern) == len(parts) and all(
                want == got or (want == "*" and _SEGMENT.fullmatch(got) is not None)
                for want, got in zip(pattern, parts, strict=True)
            ):
                return True
        return False


def parse_extra(value: str) -> tuple[str, ...]:
    """`--extra-routes`: comma-separated absolute paths, `*` for one segment."""
    routes = tuple(item.strip() for item in value.split(",") if item.strip())
    for route in routes:
        if normalize(route.replace("*", "x")) != route.replace("*", "x") or "**" in route:
            raise ValueError(f"not a normalized absolute path: {route!r}")
    return routes
