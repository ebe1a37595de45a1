"""Render helm/mla-serve with Helm's own engine (helm-python-sdk: Helm v4, no binary)."""

from __future__ import annotations

import argparse
import copy
import functools
import os
import shutil
import subprocess
from collections.abc import Callable
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
    "hopper-gb300-tp4": [PROFILES_DIR / "gb300-tp4.yaml", VALUES_DIR / "hopper.yaml"],
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


# ---- goldens: what each case is about ----------------------------------------------------------
# A golden holds the part of a render its case is about (a profile's vLLM command line, the
# alert rules, the multi-node objects...), and the default install whole, so a change anywhere
# still shows there. The chart's own version and appVersion (the image tag, the version labels,
# NOTES' first line) are written as <version> and <appVersion>: a new release or a new
# mla-serve version rewrites no golden.


def versionless(text: str) -> str:
    """`text` with Chart.yaml's appVersion and the chart label `<name>-<version>` written as
    placeholders."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = text.replace(str(meta["appVersion"]), "<appVersion>")
    return text.replace(f"{meta['name']}-{meta['version']}", f"{meta['name']}-<version>")


def notes_paragraph(notes: str, starts: str) -> str:
    """The paragraph of NOTES.txt (blank-line separated) that begins with `starts`."""
    for paragraph in notes.strip().split("\n\n"):
        if paragraph.startswith(starts):
            return paragraph + "\n"
    raise AssertionError(f"NOTES.txt has no paragraph beginning {starts!r}")


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each pod template of the workload: `server` (Deployment) or `leader` and `worker` (LWS)."""
    for doc in docs:
        if doc["kind"] == "Deployment":
            return {"server": doc["spec"]["template"]}
        if doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
    raise AssertionError("no Deployment or LeaderWorkerSet rendered")


def command_lines(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pod template: where it runs and the vLLM command line with its resources and its
    start-up budget (the startup probe)."""
    out: dict[str, Any] = {}
    for role, template in _pods(docs).items():
        spec = template["spec"]
        vllm = vllm_container(spec)
        out[role] = {
            "annotations": template["metadata"].get("annotations", {}),
            "nodeSelector": spec.get("nodeSelector", {}),
            "resourceClaims": spec.get("resourceClaims", []),
            "vllm": {
                "command": vllm["command"],
                "args": vllm["args"],
                "resources": vllm["resources"],
                "startupProbe": vllm.get("startupProbe"),
            },
        }
    return out


def _specs(docs: list[dict[str, Any]], *wanted: str) -> dict[str, Any]:
    """`kind/name: spec` of every object of the wanted kinds."""
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"] for d in docs if d["kind"] in wanted}


def _profile(docs: list[dict[str, Any]], notes: str) -> dict[str, Any]:
    return {"summary": notes_paragraph(notes, "mla-serve "), **command_lines(docs)}


def _monitoring(docs: list[dict[str, Any]], notes: str) -> dict[str, Any]:
    dashboards = {
        f"ConfigMap/{d['metadata']['name']}": {
            "labels": d["metadata"].get("labels", {}),
            # the dashboard itself: helm/tools/gen_dashboard.py, held by `make check-generated`
            "data": sorted(d.get("data", {})),
        }
        for d in docs
        if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    }
    return {**_specs(docs, "PrometheusRule", "PodMonitor"), **dashboards}


def _passthrough_off(docs: list[dict[str, Any]], notes: str) -> dict[str, Any]:
    (deployment,) = (d for d in docs if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    return {
        "api": notes_paragraph(notes, "Call the OpenAI API"),
        **_specs(docs, "Service", "NetworkPolicy", "ServiceMonitor"),
        "Deployment": {
            "replicas": deployment["spec"]["replicas"],
            "strategy": deployment["spec"]["strategy"],
            "initContainers": [
                {"name": c["name"], "command": c["command"], "env": c.get("env", [])}
                for c in spec.get("initContainers", [])
            ],
            "vllm env": vllm_container(spec).get("env", []),
            "volumes": spec["volumes"],
        },
    }


def _multinode(docs: list[dict[str, Any]], notes: str) -> dict[str, Any]:
    (lws,) = (d for d in docs if d["kind"] == "LeaderWorkerSet")
    return {
        "summary": notes_paragraph(notes, "mla-serve "),
        "LeaderWorkerSet": {
            **{k: v for k, v in lws["spec"].items() if k != "leaderWorkerTemplate"},
            "size": lws["spec"]["leaderWorkerTemplate"]["size"],
        },
        **_specs(docs, "ComputeDomain", "PersistentVolumeClaim"),
        **command_lines(docs),
    }


# What each case's golden holds (tests/helm/golden/<case>.yaml); `default` is the whole render.
ASPECTS: dict[str, Callable[[list[dict[str, Any]], str], dict[str, Any]]] = {
    **{f"profile-{name}": _profile for name in PROFILES},
    "monitoring-dsv4-flash": _monitoring,
    "passthrough-off-b200-tp2-pcp2": _passthrough_off,
    "multinode-nvl72": _multinode,
    "multinode-dp": _multinode,
    "hopper-gb300-tp4": _profile,
}


class _GoldenDumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types here
    """Block style for text of several lines (NOTES paragraphs), so a golden reads as text."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_GoldenDumper.add_representer(str, _text)


def goldens(case: str) -> dict[str, str]:
    """File name under tests/helm/golden -> its text, for one case."""
    rendered = render_case(case)
    notes = rendered[NOTES].strip() + "\n"
    if case == "default":
        return {
            "default.yaml": versionless(golden_text(rendered)),
            "default.NOTES.txt": versionless(notes),
        }
    aspect = ASPECTS[case](documents(rendered), versionless(notes))
    text = yaml.dump(aspect, Dumper=_GoldenDumper, sort_keys=False, width=100, allow_unicode=True)
    return {f"{case}.yaml": versionless(text)}


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
