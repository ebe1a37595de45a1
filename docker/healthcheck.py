#!/usr/bin/env python3
"""The image's HEALTHCHECK: one command for both roles the image runs.

It finds the server this container runs from /proc (the entrypoint execs it, so it
is PID 1, or PID 1's child under `docker run --init`) and asks it:
- `vllm serve`: GET /health on its --port (default 8000);
- `mla-serve sidecar`: GET /livez on its --port, else $MLA_SERVE_PORT (default 8080).
The host is the server's own --host when it names one address, else 127.0.0.1.
A container running neither (a one-off command) counts as healthy.
Standard library only: it runs under whatever Python the base image has.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

WILDCARD = {"", "0.0.0.0", "::", "[::]"}  # noqa: S104 - names, not a bind


@dataclass(frozen=True)
class Target:
    role: str
    url: str
    tls: bool = False


def option(argv: list[str], name: str) -> str | None:
    """The last value of `--name VALUE` or `--name=VALUE` (the last one wins, as in argparse)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _url(host: str | None, port: str, path: str, tls: bool = False) -> str:
    host = "127.0.0.1" if host is None or host in WILDCARD else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}{path}"


def target(argv: list[str], environ: dict[str, str]) -> Target | None:
    """What to ask, if this command line is one of the image's servers."""
    names = [os.path.basename(arg) for arg in argv]
    for index, name in enumerate(names[:-1]):
        if name == "vllm" and argv[index + 1] == "serve":
            tls = option(argv, "--ssl-certfile") is not None
            port = option(argv, "--port") or "8000"
            return Target("vllm", _url(option(argv, "--host"), port, "/health", tls), tls)
        if name == "mla-serve" and argv[index + 1] == "sidecar":
            port = option(argv, "--port") or environ.get("MLA_SERVE_PORT") or "8080"
            host = option(argv, "--host") or environ.get("MLA_SERVE_HOST")
            return Target("sidecar", _url(host, port, "/livez"))
    if "vllm.entrypoints.openai.api_server" in argv:
        tls = option(argv, "--ssl-certfile") is not None
        port = option(argv, "--port") or "8000"
        return Target("vllm", _url(option(argv, "--host"), port, "/health", tls), tls)
    return None


def _read_environ(process: Path) -> dict[str, str]:
    try:
        raw = (process / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def find(proc: Path = Path("/proc")) -> Target | None:
    """The server with the lowest PID (PID 1 first)."""
    pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        found = target(argv, _read_environ(proc / str(pid))) if argv else None
        if found:
            return found
    return None


def check(found: Target, timeout: float = 5.0) -> tuple[bool, str]:
    context = ssl._create_unverified_context() if found.tls else None  # noqa: S323 - loopback
    try:
        with urllib.request.urlopen(found.url, timeout=timeout, context=context) as response:  # noqa: S310
            return response.status == 200, f"{found.role} {found.url}: {response.status}"
    except urllib.error.HTTPError as error:
        return False, f"{found.role} {found.url}: {error.code}"
    except (OSError, ValueError) as error:
        return False, f"{found.role} {found.url}: {error}"


def main() -> int:
    found = find()
    if found is None:
        print("no vLLM or sidecar server in this container; nothing to check")
        return 0
    healthy, detail = check(found)
    print(detail)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
