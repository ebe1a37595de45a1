"""The custom resources the chart renders, checked against their projects' own schemas where a
registry package ships them.

- PodMonitor, ServiceMonitor, PrometheusRule (monitoring.coreos.com/v1): the npm package
  `@kubernetes-models/prometheus-operator`, whose validators are generated from the
  prometheus-operator's Go API types (the same types its CRDs are generated from). It is
  installed once into .cache/npm with npm, from the registry npm is configured with, and run by
  node (tests/helm/crd_validate.mjs). Beyond the schema's own findings (types, enums, patterns,
  required fields) a field the schema never reads is reported as unknown, as an API server with
  strict field validation refuses it.
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) and ComputeDomain (resource.nvidia.com/v1beta1):
  no package on PyPI or npm ships their schemas (the projects, kubernetes-sigs/lws and NVIDIA's
  k8s-dra-driver-gpu, publish their CRDs only in their repositories and Helm charts), so these
  two keep the strict hand-written subsets of tests/helm/crd_subsets.py.

Without node and npm the prometheus-operator kinds cannot be checked: the tests skip, and fail
under CI (.ci/run installs Debian's `nodejs` and `npm` where they are missing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.helm.helm_support import REPO

PACKAGE = "@kubernetes-models/prometheus-operator"
VERSION = "6.0.0"
KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
SCRIPT = Path(__file__).resolve().parent / "crd_validate.mjs"
CACHE = Path(os.environ.get("MLA_SERVE_CACHE", REPO / ".cache")) / "npm"
INSTALL = CACHE / f"prometheus-operator-{VERSION}"


class SchemaUnavailable(RuntimeError):
    """node or npm is missing, or the package could not be installed; the message says which."""


def tools() -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise SchemaUnavailable("node and npm are needed (Debian's `nodejs` and `npm`)")
    return node, npm


def install() -> Path:
    """The package's install folder, installed with npm on first use (its download cached in
    .cache/npm/cache); the registry is whichever npm is configured with."""
    _, npm = tools()
    marker = INSTALL / "node_modules" / "@kubernetes-models" / "prometheus-operator"
    if (marker / "package.json").is_file():
        return INSTALL
    INSTALL.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            npm, "install", "--prefix", str(INSTALL), "--cache", str(CACHE / "cache"),
            "--no-save", "--no-package-lock", "--ignore-scripts", "--no-audit", "--no-fund",
            "--loglevel=error", f"{PACKAGE}@{VERSION}",
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if result.returncode != 0 or not (marker / "package.json").is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise SchemaUnavailable(f"npm install {PACKAGE}@{VERSION} failed: {' '.join(tail)}")
    return INSTALL


def validate(docs: list[dict[str, Any]]) -> list[dict[str, list[str]]]:
    """Per document: the schema's `errors` and the `unknown` fields (paths like
    /spec/podMetricsEndpoints/0/intervl)."""
    node, _ = tools()
    root = install()
    result = subprocess.run(
        [node, str(SCRIPT), str(root)],
        input=json.dumps(docs), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SchemaUnavailable(f"node {SCRIPT.name}: {result.stderr.strip()[-500:]}")
    findings: list[dict[str, list[str]]] = json.loads(result.stdout)
    return findings
