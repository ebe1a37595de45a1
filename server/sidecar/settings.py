"""Sidecar settings: command-line flags, each with an MLA_SERVE_* environment fallback."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    vllm_url: str = "http://127.0.0.1:8000"
    host: str = "0.0.0.0"  # noqa: S104 - a sidecar serves the pod network
    port: int = 8080
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
    # The optional canary: a long-prefix prompt sent periodically, counted apart.
    canary_prompt_file: Path | None = None
    canary_model: str | None = None
    canary_interval: float = 300.0
    canary_concurrency: int = 8
    canary_max_tokens: int = 2048


FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--vllm-url", "MLA_SERVE_VLLM_URL", str, "vLLM's base URL (default http://127.0.0.1:8000)"),
    ("--host", "MLA_SERVE_HOST", str, "address to listen on (default 0.0.0.0)"),
    ("--port", "MLA_SERVE_PORT", int, "port to listen on (default 8080)"),
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
        "pass-through: longest gap between stream chunks (300 s)",
    ),
    (
        "--max-body-bytes",
        "MLA_SERVE_MAX_BODY_BYTES",
        int,
        "pass-through: request size cap (16 MiB)",
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
    settings = Settings(**values)  # type: ignore[arg-type]
    if not settings.vllm_url.startswith(("http://", "https://")):
        raise SettingsError(f"--vllm-url must be an http(s) URL, got {settings.vllm_url!r}")
    positive = ("poll_interval", "probe_timeout", "connect_timeout", "upstream_timeout",
                "stream_idle_timeout", "max_body_bytes", "canary_interval", "canary_concurrency",
                "canary_max_tokens")  # fmt: skip
    for name in positive:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"--{name.replace('_', '-')} must be positive")
    if settings.canary_prompt_file is not None and not settings.canary_prompt_file.is_file():
        raise SettingsError(f"--canary-prompt-file {settings.canary_prompt_file} does not exist")
    return settings


class SettingsError(Exception):
    """A flag or environment variable with an unusable value."""
