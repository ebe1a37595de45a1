"""Render helm/mla-serve with Helm's own engine (helm-python-sdk: Helm v4, no binary)."""

from __future__ import annotations

import argparse
import copy
import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

from mla_serve.sidecar import settings as settings_

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "mla-serve"
PROFILES_DIR = CHART / "profiles"
HERE = Path(__file__).resolve().parent
VALUES_DIR = HERE / "values"
GOLDEN_DIR = HERE / "golden"

RELEASE = "mla"
NAMESPACE = "serving"
NOTES = "mla-serve/templates/NOTES.txt"
UPDATE_GOLDEN = os.environ.get("MLA_SERVE_UPDATE_GOLDEN") == "1"

PROFILES = sorted(path.stem for path in PROFILES_DIR.glob("*.yaml"))

# Rendered cases: value files layered like `helm install -f A -f B` (later files win).
CASES: dict[str, list[Path]] = {
    "default": [],
    **{f"profile-{name}": [PROFILES_DIR / f"{name}.yaml"] for name in PROFILES},
    "monitoring-dsv4-flash": [PROFILES_DIR / "dsv4-flash.yaml", VALUES_DIR / "monitoring.yaml"],
    "passthrough-off-b200-tp2-pcp2": [
        PROFILES_DIR / "b200-tp2-pcp2.yaml",
        VALUES_DIR / "passthrough-off.yaml",
    ],
    "multinode-nvl72": [PROFILES_DIR / "gb300-tp4.yaml", VALUES_DIR / "multinode-nvl72.yaml"],
    "multinode-dp": [PROFILES_DIR / "dsv4-flash.yaml", VALUES_DIR / "multinode-dp.yaml"],
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of -f files: maps merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_values(files: list[Path]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path in files:
        values = merge(values, yaml.safe_load(path.read_text()) or {})
    return values


def case_values(case: str) -> dict[str, Any]:
    return load_values(CASES[case])


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, with the chart's schema and `fail` checks applied."""
    return chart().render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


@functools.cache
def render_case(case: str) -> dict[str, str]:
    return render(case_values(case))


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects, in template order (NOTES.txt left out)."""
    docs: list[dict[str, Any]] = []
    for name in sorted(rendered):
        if name == NOTES:
            continue
        for doc in yaml.safe_load_all(rendered[name]):
            if doc:
                docs.append(doc)
    return docs


def case_documents(case: str) -> list[dict[str, Any]]:
    return documents(render_case(case))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return [d["kind"] for d in docs]


def golden_text(rendered: dict[str, str]) -> str:
    """Like `helm template`: every non-empty manifest under a `# Source:` line."""
    parts = []
    for name in sorted(rendered):
        body = rendered[name].strip()
        if name == NOTES or not body:
            continue
        parts.append(f"---\n# Source: {name}\n{body}\n")
    return "".join(parts)


def promtool() -> str | None:
    return shutil.which("promtool")


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def vllm_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == "vllm")


def sidecar_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == "sidecar")


def sidecar_settings(values: dict[str, Any]) -> settings_.Settings:
    """The rendered sidecar's flags, read back by the sidecar's own parser and settings."""
    pod = find(documents(render(values)), "Deployment")["spec"]["template"]["spec"]
    container = sidecar_container(pod)
    assert container["command"] == ["mla-serve", "sidecar"]
    parser = argparse.ArgumentParser()
    settings_.add_arguments(parser)
    return settings_.from_arguments(parser.parse_args(container["args"]), environ={})


def flags(container: dict[str, Any]) -> dict[str, str | None]:
    """--name=value (or bare --name) arguments of a container, by name."""
    out: dict[str, str | None] = {}
    for arg in container.get("args", []):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out[name] = value if value else None
    return out
