"""`mla-serve sidecar`: serve the sidecar with uvicorn."""

from __future__ import annotations

import argparse

from mla_serve.sidecar import settings as settings_


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sidecar = commands.add_parser(
        "sidecar",
        help="serve health, status, metrics and the OpenAI pass-through next to vLLM",
        description="Serve vLLM's OpenAI routes (--port) and /livez /readyz /startupz /status "
        "/metrics (--admin-port) next to a vLLM server. Every flag can also be set by the "
        "environment variable named in its help.",
    )
    settings_.add_arguments(sidecar)
    sidecar.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    sidecar.add_argument(
        "--http",
        default="auto",
        choices=("auto", "httptools", "h11"),
        help="HTTP parser (default: httptools when installed, as in vLLM's image)",
    )
    sidecar.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from mla_serve.sidecar import serve

    settings = settings_.from_arguments(args)
    try:
        serve.run(settings, log_level=args.log_level, http=args.http)
    except OSError as error:  # a port in use, an address not on this host
        raise settings_.SettingsError(f"cannot listen: {error.strerror or error}") from None
    return 0


ERRORS = (settings_.SettingsError,)
