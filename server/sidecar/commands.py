"""`mla-serve sidecar`: serve the sidecar with uvicorn."""

from __future__ import annotations

import argparse

from server.sidecar import settings as settings_


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sidecar = commands.add_parser(
        "sidecar",
        help="serve health, status, metrics and the OpenAI pass-through next to vLLM",
        description="Serve /livez /readyz /startupz /status /metrics next to a vLLM server. "
        "Every flag can also be set by the environment variable named in its help.",
    )
    settings_.add_arguments(sidecar)
    sidecar.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    sidecar.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from server.sidecar.app import create_app

    settings = settings_.from_arguments(args)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=False,
    )
    return 0


ERRORS = (settings_.SettingsError,)
