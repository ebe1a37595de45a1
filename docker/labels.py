#!/usr/bin/env python3
"""What the image's labels say about its fixes, and the proof that they say the truth.

  labels.py build-args VLLM_VERSION
      (on the build host, with the checkout's `mla_serve` importable) prints the
      KEY=VALUE build args the labels are made of: SERIES_DIGEST, FIXES
      (`fix=status,...` in catalog order) and MLA_SERVE_VERSION.
  labels.py check --manifest FILE --vllm-version V --series-digest D --fixes F
      (inside the image, after `apply` and `verify`) fails unless the manifest is
      for release V, records series digest D and exactly the fix statuses F with
      every probe bearing its status out (PROBE_PROVES), and unless mla-serve's engine
      plugin is registered with vLLM; prints the fixes the image carries.
Standard library only in `check`: it runs under the base image's Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata, util
from pathlib import Path
from typing import Any

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "mla_serve"


# The probe words that bear a status out (mla_serve.patching.probes.proves): `affected` (the
# bug is there, no backport) fails; `not-affected` by a GPU verdict may find the code there
# but unreachable (`apply` has checked that the verdict exists); the rest pass.
PROBE_PROVES = {"affected": {"fail", "unreachable"}, "not-affected": {"pass", "unreachable"}}


def release(version: str) -> str:
    return version.split("+", 1)[0]  # 0.33.0+cu130 is release 0.33.0, as the engine reads it


def fixes_text(pairs: list[tuple[str, str]]) -> str:
    return ",".join(f"{fix}={status}" for fix, status in pairs)


def build_args(version: str) -> dict[str, str]:
    from mla_serve import __version__
    from mla_serve.patching import catalog as catalog_

    catalog = catalog_.load()
    name = catalog.release_of(version)
    return {
        "SERIES_DIGEST": catalog.series(name).digest,
        "FIXES": fixes_text([(fix.id, fix.on(name).status.value) for fix in catalog.fixes]),
        "MLA_SERVE_VERSION": __version__,
    }


def problems(document: dict[str, Any], version: str, digest: str, fixes: str) -> list[str]:
    """Every way the manifest disagrees with what the labels will say."""
    found: list[str] = []
    if not digest or not fixes:
        found.append(
            "SERIES_DIGEST and FIXES build args are required (`make image` sets them from "
            "`docker/labels.py build-args VLLM_VERSION`)"
        )
    if document.get("release") != release(version):
        found.append(
            f"VLLM_VERSION is {version} but the installed vLLM is {document.get('vllm_version')}"
        )
    if digest and document.get("series", {}).get("digest") != digest:
        found.append(
            f"series digest {document.get('series', {}).get('digest')} applied, labels say {digest}"
        )
    recorded = fixes_text([(fix["id"], fix["status"]) for fix in document.get("fixes", [])])
    if fixes and recorded != fixes:
        found.append(f"fixes applied: {recorded}; labels say: {fixes}")
    for fix in document.get("fixes", []):
        if fix.get("probe") not in PROBE_PROVES.get(fix.get("status"), {"pass"}):
            found.append(f"fix {fix['id']}: probe {fix.get('probe')}: {fix.get('probe_detail')}")
    return found


def installation_problems() -> list[str]:
    """mla-serve's package and plugin, as vLLM will find them."""
    found: list[str] = []
    plugins = [e for e in metadata.entry_points(group=PLUGIN_GROUP) if e.name == PLUGIN_NAME]
    if not plugins:
        found.append(f"no {PLUGIN_GROUP} entry point {PLUGIN_NAME!r}: the engine plugin is missing")
    spec = util.find_spec("mla_serve")
    files = metadata.files("mla-serve") or []
    ours = {str(Path(str(f.locate())).resolve()) for f in files if str(f).endswith(".py")}
    if spec is None or spec.origin is None or str(Path(spec.origin).resolve()) not in ours:
        found.append(
            f"`import mla_serve` finds {spec.origin if spec else None}, not mla-serve's package"
        )
    return found


def table(document: dict[str, Any]) -> str:
    width = max(len(fix["id"]) for fix in document["fixes"])
    lines = [
        f"vLLM {document['vllm_version']} (release {document['release']}), series "
        f"{document['series']['directory']} digest {document['series']['digest'][:12]}, "
        f"{len(document['files'])} file(s) touched"
    ]
    lines += [
        f"  {fix['id']:{width}}  {fix['status']:12}  probe {fix['probe']}"
        for fix in document["fixes"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    top = argparse.ArgumentParser(prog="labels.py", description=__doc__.split("\n\n")[0])
    actions = top.add_subparsers(dest="action", required=True)
    args_parser = actions.add_parser("build-args")
    args_parser.add_argument("vllm_version")
    check = actions.add_parser("check")
    check.add_argument("--manifest", type=Path, required=True)
    check.add_argument("--vllm-version", required=True)
    check.add_argument("--series-digest", default="")
    check.add_argument("--fixes", default="")
    args = top.parse_args(argv)

    if args.action == "build-args":
        for key, value in build_args(args.vllm_version).items():
            print(f"{key}={value}")
        return 0

    document = json.loads(args.manifest.read_text(encoding="utf-8"))
    print(table(document))
    found = problems(document, args.vllm_version, args.series_digest, args.fixes)
    found += installation_problems()
    for problem in found:
        print(f"labels.py: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
