"""Sidecar settings: command-line flags, each with an MLA_SERVE_* environment fallback."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the guard (and prometheus_client) load when the sidecar starts, not per CLI
    from mla_serve.sidecar.guard.loops import LoopPolicy

from mla_serve.sidecar.passthrough import routes


@dataclass(frozen=True)
class Settings:
    vllm_url: str = "http://127.0.0.1:8000"
    host: str = "0.0.0.0"  # noqa: S104 - a sidecar serves the pod network
    port: int = 8080
    # /livez /readyz /startupz /status /metrics. None (library use, tests): on `port` too;
    # the CLI defaults to 8081, so the port a Service exposes carries only the pass-through.
    admin_port: int | None = None
    admin_host: str | None = None  # default: `host`
    vllm_api_key: str | None = None  # vLLM's --api-key, for /v1/models and the canary
    state_dir: Path | None = None
    manifest: Path | None = None
    vllm_tree: Path | None = None  # the tree the manifest describes; the installed vLLM if unset
    vllm_log: Path | None = None
    model: str | None = None  # the served model readiness requires; any when unset
    poll_interval: float = 1.0
    probe_timeout: float = 2.0
    manifest_interval: float = 60.0
    # The OpenAI pass-through.
    connect_timeout: float = 5.0
    upstream_timeout: float = 600.0
    stream_idle_timeout: float = 300.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_inflight_body_bytes: int = 64 * 1024 * 1024
    max_json_values: int = 1_000_000
    max_event_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 60.0
    body_deadline: float = 300.0
    response_deadline: float = 300.0
    write_timeout: float = 60.0
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout: float = 30.0
    max_connections: int = 1024
    drain_timeout: float = 30.0
    extra_routes: str | None = None  # comma-separated, `*` for one segment
    upstream_client: str = "auto"  # auto, direct (upstream.py), aiohttp: see proxy.upstream_client
    lane: str = "auto"  # auto, on, off: token chunks read in C (upstream.py, _lane.c)
    trusted_proxies: str | None = None  # comma-separated addresses/CIDRs whose XFF is kept
    # The optional canary: a long-prefix prompt sent periodically, counted apart.
    canary_prompt_file: Path | None = None
    canary_model: str | None = None
    canary_interval: float = 300.0
    canary_concurrency: int = 8
    canary_max_tokens: int = 2048
    # The runaway guard (loops.py): what a loop is, what to do about it, vLLM-side defaults.
    loop_action: str = "observe"
    loop_model_actions: str | None = None  # "MODEL=ACTION,…", overrides loop_action per model
    loop_min_repeats: int = 4
    loop_window_chars: int = 4096
    loop_min_chars: int = 1024
    default_repetition_detection: str | None = None  # JSON, vLLM's RepetitionDetectionParams
    default_thinking_token_budget: int | None = None

    def loop_policy(self) -> LoopPolicy:
        """The guard's policy from these settings; SettingsError when they are unusable."""
        return _loop_policy(self)


CLI_ADMIN_PORT = 8081

FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--vllm-url", "MLA_SERVE_VLLM_URL", str, "vLLM's base URL (default http://127.0.0.1:8000)"),
    ("--host", "MLA_SERVE_HOST", str, "address to listen on (default 0.0.0.0)"),
    ("--port", "MLA_SERVE_PORT", int, "pass-through port: vLLM's OpenAI routes only (8080)"),
    (
        "--admin-port",
        "MLA_SERVE_ADMIN_PORT",
        int,
        "port of /livez /readyz /startupz /status /metrics (8081; the same as --port serves "
        "both on one port)",
    ),
    ("--admin-host", "MLA_SERVE_ADMIN_HOST", str, "address of the admin port (default --host)"),
    (
        "--vllm-api-key",
        "MLA_SERVE_VLLM_API_KEY",
        str,
        "vLLM's API key, sent on /v1/models checks and canary requests (prefer the env)",
    ),
    ("--state-dir", "MLA_SERVE_STATE_DIR", Path, "directory the engine plugin writes to"),
    ("--manifest", "MLA_SERVE_MANIFEST", Path, "fix manifest to verify (the image's)"),
    ("--vllm-tree", "MLA_SERVE_VLLM_TREE", Path, "vLLM tree the manifest describes (installed)"),
    ("--vllm-log", "MLA_SERVE_VLLM_LOG", Path, "vLLM log file, read when the plugin is absent"),
    ("--model", "MLA_SERVE_MODEL", str, "served model name readiness requires"),
    ("--poll-interval", "MLA_SERVE_POLL_INTERVAL", float, "seconds between vLLM checks (1)"),
    ("--probe-timeout", "MLA_SERVE_PROBE_TIMEOUT", float, "timeout of each vLLM check (2 s)"),
    (
        "--connect-timeout",
        "MLA_SERVE_CONNECT_TIMEOUT",
        float,
        "pass-through: connect to vLLM (5 s)",
    ),
    (
        "--upstream-timeout",
        "MLA_SERVE_UPSTREAM_TIMEOUT",
        float,
        "pass-through: wait for vLLM's response headers, 504 after (600 s)",
    ),
    (
        "--stream-idle-timeout",
        "MLA_SERVE_STREAM_IDLE_TIMEOUT",
        float,
        "pass-through: longest silence in a response body after its headers (300 s)",
    ),
    (
        "--max-body-bytes",
        "MLA_SERVE_MAX_BODY_BYTES",
        int,
        "pass-through: request size cap (16 MiB)",
    ),
    (
        "--max-inflight-body-bytes",
        "MLA_SERVE_MAX_INFLIGHT_BODY_BYTES",
        int,
        "pass-through: request body bytes held at once over all requests, 503 past it (64 MiB)",
    ),
    (
        "--max-json-values",
        "MLA_SERVE_MAX_JSON_VALUES",
        int,
        "pass-through: JSON values in a chat/completions body, 413 past it (1000000)",
    ),
    (
        "--max-event-bytes",
        "MLA_SERVE_MAX_EVENT_BYTES",
        int,
        "pass-through: largest response event/body classified; bigger ones pass unparsed (4 MiB)",
    ),
    (
        "--body-timeout",
        "MLA_SERVE_BODY_TIMEOUT",
        float,
        "pass-through: longest silence while reading a request body, 408 after (60 s)",
    ),
    (
        "--body-deadline",
        "MLA_SERVE_BODY_DEADLINE",
        float,
        "pass-through: a request body (and its trailers) must arrive whole within this long "
        "after its headers, 408 after (300 s)",
    ),
    (
        "--response-deadline",
        "MLA_SERVE_RESPONSE_DEADLINE",
        float,
        "pass-through: a vLLM response that is not an event stream must end within this long "
        "after its headers, cut off after (300 s)",
    ),
    (
        "--write-timeout",
        "MLA_SERVE_WRITE_TIMEOUT",
        float,
        "longest time a client may take none of the response bytes waiting for it; then it is "
        "disconnected and its vLLM request aborted (60 s)",
    ),
    ("--max-header-bytes", "MLA_SERVE_MAX_HEADER_BYTES", int, "request line + headers (32 KiB)"),
    ("--max-headers", "MLA_SERVE_MAX_HEADERS", int, "request headers, 431 past it (100)"),
    (
        "--header-timeout",
        "MLA_SERVE_HEADER_TIMEOUT",
        float,
        "seconds a client may take to send its request headers (30)",
    ),
    (
        "--max-connections",
        "MLA_SERVE_MAX_CONNECTIONS",
        int,
        "open connections per port, 503 past it (1024)",
    ),
    (
        "--drain-timeout",
        "MLA_SERVE_DRAIN_TIMEOUT",
        float,
        "on SIGTERM: stop accepting, finish in-flight requests for at most this long (30 s)",
    ),
    (
        "--extra-routes",
        "MLA_SERVE_EXTRA_ROUTES",
        str,
        "more vLLM paths to pass through, comma-separated, `*` for one segment",
    ),
    (
        "--trusted-proxies",
        "MLA_SERVE_TRUSTED_PROXIES",
        str,
        "addresses/CIDRs whose X-Forwarded-For is kept (appended to); others' is replaced",
    ),
    (
        "--upstream-client",
        "MLA_SERVE_UPSTREAM_CLIENT",
        str,
        "pass-through client for chat/completions: direct (a bare HTTP/1.1 client, needs "
        "httptools and an http:// --vllm-url), aiohttp, or auto: direct when usable (auto)",
    ),
    (
        "--lane",
        "MLA_SERVE_LANE",
        str,
        "reads of vLLM's token chunks on the direct client in C (the sidecar's _lane "
        "extension): auto (when built; the image has it), on (refuse to start without it), "
        "or off (every read in Python, the same effects) (auto)",
    ),
    ("--canary-prompt-file", "MLA_SERVE_CANARY_PROMPT_FILE", Path, "canary prompt; off when unset"),
    ("--canary-model", "MLA_SERVE_CANARY_MODEL", str, "canary model (default: the first served)"),
    (
        "--canary-interval",
        "MLA_SERVE_CANARY_INTERVAL",
        float,
        "seconds between canary rounds (300)",
    ),
    ("--canary-concurrency", "MLA_SERVE_CANARY_CONCURRENCY", int, "requests per canary round (8)"),
    ("--canary-max-tokens", "MLA_SERVE_CANARY_MAX_TOKENS", int, "max_tokens of the canary (2048)"),
    (
        "--loop-action",
        "MLA_SERVE_LOOP_ACTION",
        str,
        "runaway guard: off, observe (count loops) or stop (end looping streams) (observe)",
    ),
    (
        "--loop-model-actions",
        "MLA_SERVE_LOOP_MODEL_ACTIONS",
        str,
        "per-model override of --loop-action, MODEL=ACTION[,MODEL=ACTION…]",
    ),
    (
        "--loop-min-repeats",
        "MLA_SERVE_LOOP_MIN_REPEATS",
        int,
        "a loop: its unit repeats at least this many times in a row (4)",
    ),
    (
        "--loop-window-chars",
        "MLA_SERVE_LOOP_WINDOW_CHARS",
        int,
        "text tail kept per choice; longest loop unit = window / min repeats (4096)",
    ),
    (
        "--loop-min-chars",
        "MLA_SERVE_LOOP_MIN_CHARS",
        int,
        "a loop covers at least this many characters (1024)",
    ),
    (
        "--default-repetition-detection",
        "MLA_SERVE_DEFAULT_REPETITION_DETECTION",
        str,
        "vLLM repetition_detection JSON set on requests without one (off)",
    ),
    (
        "--default-thinking-token-budget",
        "MLA_SERVE_DEFAULT_THINKING_TOKEN_BUDGET",
        int,
        "vLLM thinking_token_budget set on requests without one; needs a reasoning parser (off)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, env, kind, text in FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=f"{text}; env {env}")


def from_arguments(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Flags win over environment variables, which win over defaults."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, object] = {}
    for flag, env, kind, _ in FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name, None)
        if value is None and environ.get(env):
            try:
                value = kind(environ[env])
            except ValueError:
                raise SettingsError(
                    f"{env}={environ[env]!r} is not a valid {kind.__name__}"
                ) from None
        if value is not None:
            values[name] = value
    values.setdefault("admin_port", CLI_ADMIN_PORT)
    settings = Settings(**values)  # type: ignore[arg-type]
    if not settings.vllm_url.startswith(("http://", "https://")):
        raise SettingsError(f"--vllm-url must be an http(s) URL, got {settings.vllm_url!r}")
    positive = ("poll_interval", "probe_timeout", "connect_timeout", "upstream_timeout",
                "stream_idle_timeout", "max_body_bytes", "canary_interval", "canary_concurrency",
                "canary_max_tokens", "max_inflight_body_bytes", "max_json_values",
                "max_event_bytes", "body_timeout", "body_deadline", "response_deadline",
                "write_timeout", "max_header_bytes", "max_headers",
                "header_timeout", "max_connections", "drain_timeout", "loop_min_repeats",
                "loop_window_chars", "loop_min_chars")  # fmt: skip
    for name in positive:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"--{name.replace('_', '-')} must be positive")
    if settings.max_inflight_body_bytes < settings.max_body_bytes:
        raise SettingsError("--max-inflight-body-bytes must be at least --max-body-bytes")
    for name in ("port", "admin_port"):
        port = getattr(settings, name)
        if port is not None and not 0 < port < 65536:
            raise SettingsError(f"--{name.replace('_', '-')} must be a TCP port, got {port}")
    try:
        extra_routes(settings)
        trusted_proxies(settings)
        upstream_client(settings)
        lane(settings)
    except ValueError as error:
        raise SettingsError(str(error)) from None
    if settings.canary_prompt_file is not None and not settings.canary_prompt_file.is_file():
        raise SettingsError(f"--canary-prompt-file {settings.canary_prompt_file} does not exist")
    settings.loop_policy()  # refuses unusable guard settings now, not at the first request
    return settings


REPETITION_KEYS = ("max_pattern_size", "min_pattern_size", "min_count")


def _loop_policy(settings: Settings) -> LoopPolicy:
    from mla_serve.sidecar.guard.loops import ACTIONS, LoopConfig, LoopPolicy

    def action(value: str, where: str) -> str:
        if value not in ACTIONS:
            raise SettingsError(f"{where} must be one of {', '.join(ACTIONS)}, got {value!r}")
        return value

    default = action(settings.loop_action, "--loop-action")
    per_model: dict[str, str] = {}
    for item in filter(None, (settings.loop_model_actions or "").split(",")):
        model, sep, value = item.strip().rpartition("=")
        if not sep or not model:
            raise SettingsError(f"--loop-model-actions: {item!r} is not MODEL=ACTION")
        per_model[model] = action(value, f"--loop-model-actions {model}")
    config = LoopConfig(
        min_repeats=settings.loop_min_repeats,
        window_chars=settings.loop_window_chars,
        min_chars=settings.loop_min_chars,
    )
    if config.problems():
        raise SettingsError(config.problems()[0])
    budget = settings.default_thinking_token_budget
    if budget is not None and budget < 0:
        raise SettingsError("--default-thinking-token-budget must be 0 or more")
    return LoopPolicy(
        action=default,
        model_actions=per_model,
        config=config,
        repetition_detection=_repetition_detection(settings.default_repetition_detection),
        thinking_token_budget=budget,
    )


def _repetition_detection(text: str | None) -> dict[str, int] | None:
    """vLLM's RepetitionDetectionParams as JSON, held to vLLM's own rules (0.33.0)."""
    if text is None:
        return None
    where = "--default-repetition-detection"
    try:
        value = json.loads(text)
    except ValueError:
        raise SettingsError(f"{where} is not JSON: {text!r}") from None
    if not isinstance(value, dict) or not value or set(value) - set(REPETITION_KEYS):
        raise SettingsError(
            f"{where} must be an object with keys from {', '.join(REPETITION_KEYS)}"
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise SettingsError(f"{where}: every value must be an integer")
    largest, smallest = value.get("max_pattern_size", 0), value.get("min_pattern_size", 0)
    if largest <= 0 or smallest < 0 or smallest > largest:
        raise SettingsError(f"{where}: needs max_pattern_size > 0 and 0 <= min_pattern_size <= it")
    if value.get("min_count", 0) < 2:
        raise SettingsError(f"{where}: min_count must be at least 2")
    return dict(value)


def extra_routes(settings: Settings) -> tuple[str, ...]:
    return routes.parse_extra(settings.extra_routes or "")


def upstream_client(settings: Settings) -> str:
    """`direct` or `aiohttp`; ValueError when the choice is unknown or unusable."""
    choice = settings.upstream_client
    if choice not in ("auto", "direct", "aiohttp"):
        raise ValueError(f"--upstream-client must be one of auto, direct, aiohttp, got {choice!r}")
    from mla_serve.sidecar.passthrough.proxy import upstream_client as choose

    return choose(settings.upstream_client, settings.vllm_url)


def lane(settings: Settings) -> bool:
    """Whether the direct client reads token chunks in C; ValueError when the choice is
    unknown, or `on` where the extension is not built."""
    choice = settings.lane
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--lane must be one of auto, on, off, got {choice!r}")
    from mla_serve.sidecar.passthrough import upstream

    if choice == "on" and not upstream.LANE_BUILT:
        raise ValueError("--lane on: the C lane (mla_serve/sidecar/_lane) is not built in this "
                         "install; build with a C compiler, or use --lane auto or off")  # fmt: skip
    return choice != "off" and upstream.LANE_BUILT


def trusted_proxies(
    settings: Settings,
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    items = [item.strip() for item in (settings.trusted_proxies or "").split(",") if item.strip()]
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in items)
    except ValueError as error:
        raise ValueError(f"--trusted-proxies: {error}") from None


class SettingsError(Exception):
    """A flag or environment variable with an unusable value."""
