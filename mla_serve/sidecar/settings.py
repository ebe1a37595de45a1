"""The sidecar's settings: each one a typed field declared once, with its help.

A field's command-line flag is `--` and its name with dashes, its environment variable
`MLA_SERVE_` and its name in capitals; both, its type, its default and its help come from the
field itself (`setting`), so `add_arguments`, `from_arguments`, `mla-serve sidecar --help` and
the code that reads `settings.<name>` cannot disagree. Flags win over environment variables,
which win over defaults. What a field's value means for the code is derived here too
(`routes`, `trusted_proxies`, `lane`, `loop_policy`), once, at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the guard (and prometheus_client) load when the sidecar starts, not per CLI
    from mla_serve.sidecar.guard.loops import LoopPolicy

from mla_serve.sidecar.passthrough import routes as routes_

ENV_PREFIX = "MLA_SERVE_"
MiB = 1024 * 1024


def setting(
    default: Any,
    help: str,
    *,
    positive: bool = False,
    choices: tuple[str, ...] = (),
    cli_default: Any = None,
) -> Any:
    """A settings field: its default, its help (the flag's text), and what it must be."""
    metadata = {"help": help, "positive": positive, "choices": choices, "cli_default": cli_default}
    return dataclasses.field(default=default, metadata=metadata)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Settings:
    # -- where --------------------------------------------------------------------------
    vllm_url: str = setting("http://127.0.0.1:8000", "vLLM's base URL (http:// or https://)")
    host: str = setting("0.0.0.0", "address to listen on")  # noqa: S104 - a sidecar serves the pod
    port: int = setting(8080, "pass-through port: vLLM's OpenAI routes only")
    # None (library use, tests): /livez /readyz … on `port` too; the CLI's default is 8081, so
    # the port a Service exposes carries only the pass-through.
    admin_port: int | None = setting(
        None,
        "port of /livez /readyz /startupz /status /metrics (the same as --port serves both)",
        cli_default=8081,
    )
    admin_host: str | None = setting(None, "address of the admin port (default: --host)")
    vllm_api_key: str | None = setting(
        None, "vLLM's API key, sent on /v1/models checks and canary requests (prefer the env)"
    )
    # -- what the engine runs ------------------------------------------------------------
    state_dir: Path | None = setting(None, "directory the engine plugin writes to")
    manifest: Path | None = setting(None, "fix manifest to verify (the image's)")
    vllm_tree: Path | None = setting(None, "vLLM tree the manifest describes (default: installed)")
    vllm_log: Path | None = setting(None, "vLLM log file, read when the plugin is absent")
    model: str | None = setting(None, "served model name readiness requires (default: any)")
    poll_interval: float = setting(1.0, "seconds between vLLM checks", positive=True)
    probe_timeout: float = setting(2.0, "timeout of each vLLM check, seconds", positive=True)
    manifest_interval: float = setting(60.0, "seconds between manifest checks", positive=True)
    # -- the pass-through ---------------------------------------------------------------
    connect_timeout: float = setting(5.0, "pass-through: connect to vLLM, seconds", positive=True)
    upstream_timeout: float = setting(
        600.0, "pass-through: wait for vLLM's response headers, 504 after (seconds)", positive=True
    )
    stream_idle_timeout: float = setting(
        300.0, "pass-through: longest silence in a response body after its headers (seconds)",
        positive=True,
    )  # fmt: skip
    response_deadline: float = setting(
        300.0, "pass-through: a vLLM response that is not an event stream must end within this "
        "long after its headers, cut off after (seconds)", positive=True,
    )  # fmt: skip
    max_body_bytes: int = setting(16 * MiB, "pass-through: request size cap, 413 past it",
                                  positive=True)  # fmt: skip
    max_inflight_body_bytes: int = setting(
        64 * MiB, "pass-through: request body bytes held at once over all requests, 503 past it",
        positive=True,
    )  # fmt: skip
    max_json_values: int = setting(
        1_000_000, "pass-through: JSON values in a chat/completions body, 413 past it",
        positive=True,
    )  # fmt: skip
    max_event_bytes: int = setting(
        4 * MiB, "pass-through: largest response event or body classified; bigger ones pass "
        "unparsed", positive=True,
    )  # fmt: skip
    body_timeout: float = setting(
        60.0, "pass-through: longest silence while reading a request body, 408 after (seconds)",
        positive=True,
    )  # fmt: skip
    body_deadline: float = setting(
        300.0, "pass-through: a request body (and its trailers) must arrive whole within this "
        "long after its headers, 408 after (seconds)", positive=True,
    )  # fmt: skip
    write_timeout: float = setting(
        60.0, "longest time a client may take none of the response bytes waiting for it; then "
        "it is disconnected and its vLLM request aborted (seconds)", positive=True,
    )  # fmt: skip
    max_header_bytes: int = setting(32 * 1024, "request line and headers, 431 past it",
                                    positive=True)  # fmt: skip
    max_headers: int = setting(100, "request headers (and trailer fields), 431 past it",
                               positive=True)  # fmt: skip
    header_timeout: float = setting(
        30.0, "seconds a client may take to send its request headers (or trailers)",
        positive=True,
    )  # fmt: skip
    max_connections: int = setting(1024, "open connections per port, 503 past it", positive=True)
    drain_timeout: float = setting(
        30.0, "on SIGTERM: stop accepting, finish in-flight requests for at most this long "
        "(seconds)", positive=True,
    )  # fmt: skip
    extra_routes: str | None = setting(
        None, "more vLLM paths to pass through, comma-separated, `*` for one segment"
    )
    trusted_proxies: str | None = setting(
        None, "addresses/CIDRs whose X-Forwarded-For is kept (appended to); others' is replaced"
    )
    lane: str = setting(
        "auto", "reads of vLLM's token chunks in C (the sidecar's _lane extension): auto (when "
        "built; the image has it), on (refuse to start without it), or off (every read in "
        "Python, the same effects)", choices=("auto", "on", "off"),
    )  # fmt: skip
    # -- the optional canary: a long-prefix prompt sent periodically, counted apart ------------
    canary_prompt_file: Path | None = setting(None, "canary prompt; the canary is off when unset")
    canary_model: str | None = setting(None, "canary model (default: the first served)")
    canary_interval: float = setting(300.0, "seconds between canary rounds", positive=True)
    canary_concurrency: int = setting(8, "requests per canary round", positive=True)
    canary_max_tokens: int = setting(2048, "max_tokens of the canary's requests", positive=True)
    # -- the runaway guard (guard/loops.py): what a loop is, what to do, vLLM-side defaults ----
    loop_action: str = setting(
        "observe", "runaway guard: off, observe (count loops) or stop (end looping streams)"
    )
    loop_model_actions: str | None = setting(
        None, "per-model override of --loop-action, MODEL=ACTION[,MODEL=ACTION…]"
    )
    loop_min_repeats: int = setting(
        4, "a loop: its unit repeats at least this many times in a row", positive=True
    )
    loop_window_chars: int = setting(
        4096, "text tail kept per choice; longest loop unit = window / min repeats", positive=True
    )
    loop_min_chars: int = setting(1024, "a loop covers at least this many characters",
                                  positive=True)  # fmt: skip
    default_repetition_detection: str | None = setting(
        None, "vLLM repetition_detection JSON set on requests without one (off)"
    )
    default_thinking_token_budget: int | None = setting(
        None, "vLLM thinking_token_budget set on requests without one; needs a reasoning parser "
        "(off)",
    )  # fmt: skip

    # -- what the values mean, derived once --------------------------------------------------
    @cached_property
    def routes(self) -> tuple[str, ...]:
        """The paths the pass-through forwards: vLLM's OpenAI routes and --extra-routes."""
        return routes_.OPENAI_ROUTES + routes_.parse_extra(self.extra_routes or "")

    @cached_property
    def trusted_networks(self) -> tuple[Network, ...]:
        items = [i.strip() for i in (self.trusted_proxies or "").split(",") if i.strip()]
        try:
            return tuple(ipaddress.ip_network(item, strict=False) for item in items)
        except ValueError as error:
            raise SettingsError(f"--trusted-proxies: {error}") from None

    @cached_property
    def lane_on(self) -> bool:
        """Whether token chunks are read in C; SettingsError for `on` where it is not built."""
        from mla_serve.sidecar.passthrough import lane

        if self.lane == "on" and not lane.BUILT:
            raise SettingsError("--lane on: the C lane (_lane) is not built in this install; "
                                "build with a C compiler, or use --lane auto or off")  # fmt: skip
        return self.lane != "off" and lane.BUILT

    @cached_property
    def loop_policy(self) -> LoopPolicy:
        """The guard's policy; SettingsError when the loop settings are unusable."""
        return _loop_policy(self)

    def check(self) -> Settings:
        """Every rule a value must follow, with the flag's name; SettingsError otherwise."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if field.metadata.get("positive") and value is not None and value <= 0:
                raise SettingsError(f"{flag} must be positive")
            choices = field.metadata.get("choices")
            if choices and value not in choices:
                raise SettingsError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if not self.vllm_url.startswith(("http://", "https://")):
            raise SettingsError(f"--vllm-url must be an http(s) URL, got {self.vllm_url!r}")
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise SettingsError("--max-inflight-body-bytes must be at least --max-body-bytes")
        for name in ("port", "admin_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise SettingsError(f"--{name.replace('_', '-')} must be a TCP port, got {port}")
        try:
            self.routes  # noqa: B018 - derived now: a bad value refuses to start
        except ValueError as error:
            raise SettingsError(f"--extra-routes: {error}") from None
        self.trusted_networks  # noqa: B018
        self.lane_on  # noqa: B018
        if self.canary_prompt_file is not None and not self.canary_prompt_file.is_file():
            raise SettingsError(f"--canary-prompt-file {self.canary_prompt_file} does not exist")
        self.loop_policy  # noqa: B018 - refuses unusable guard settings now, not at a request
        return self


def _kind(field: dataclasses.Field[Any]) -> type:
    """The field's value type (`int` of `int | None`)."""
    hint = typing.get_type_hints(Settings)[field.name]
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint  # type: ignore[no-any-return]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(Settings):
        cli_default = field.metadata["cli_default"]
        default = cli_default if cli_default is not None else field.default
        text = field.metadata["help"]
        # A help that says what its default means ("(default: any)", "(off)") says it once.
        if not re.search(r"\((default\b|off\))", text):
            text += f" (default {'unset' if default is None else default})"
        text += f"; env {env_of(field.name)}"
        parser.add_argument(flag_of(field.name), type=_kind(field), default=None, help=text)


def from_arguments(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """The settings from parsed flags, then the environment, then the defaults; checked."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, object] = {}
    for field in dataclasses.fields(Settings):
        value = getattr(args, field.name, None)
        env = env_of(field.name)
        if value is None and environ.get(env):
            kind = _kind(field)
            try:
                value = kind(environ[env])
            except ValueError:
                raise SettingsError(
                    f"{env}={environ[env]!r} is not a valid {kind.__name__}"
                ) from None
        if value is None:
            value = field.metadata["cli_default"]
        if value is not None:
            values[field.name] = value
    return Settings(**values).check()  # type: ignore[arg-type]


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


class SettingsError(Exception):
    """A flag or environment variable with an unusable value."""
