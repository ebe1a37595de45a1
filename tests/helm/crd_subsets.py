"""Strict schemas for the parts of LeaderWorkerSet and ComputeDomain the chart renders.

kubernetes-validate knows only built-in kinds, and no package on PyPI or npm ships the schemas of
these two (kubernetes-sigs/lws and NVIDIA's k8s-dra-driver-gpu publish their CRDs only in their
repositories and Helm charts), so these subsets, written from each project's v1 / v1beta1 API,
cover every field the chart writes, with unknown fields rejected; the embedded core types (pod
templates) are checked by kubernetes-validate itself. The prometheus-operator's kinds are
checked against its own schema instead (tests/helm/crd_schemas.py).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def strict(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": required or [],
    }


STR: Schema = {"type": "string", "minLength": 1}
INT: Schema = {"type": "integer"}
ANY: Schema = {"type": "object"}
DURATION: Schema = {
    "type": "string",
    # Prometheus' duration: 1h30m, 15s, 0
    "pattern": r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$",
}
LABEL_NAME: Schema = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
METADATA: Schema = strict(
    {"name": STR, "namespace": STR, "labels": ANY, "annotations": ANY}, required=["name"]
)


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        required=["apiVersion", "kind", "metadata", "spec"],
    )


# leaderworkerset.x-k8s.io/v1 (kubernetes-sigs/lws api/leaderworkerset/v1).
LEADER_WORKER_SET = resource(
    "leaderworkerset.x-k8s.io/v1",
    "LeaderWorkerSet",
    strict(
        {
            "replicas": {"type": "integer", "minimum": 0},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "rolloutStrategy": strict(
                {
                    "type": {"enum": ["RollingUpdate"]},
                    "rollingUpdateConfiguration": strict(
                        {
                            "maxSurge": {"type": ["integer", "string"]},
                            "maxUnavailable": {"type": ["integer", "string"]},
                        }
                    ),
                },
                required=["type"],
            ),
            "leaderWorkerTemplate": strict(
                {
                    "size": {"type": "integer", "minimum": 1},
                    "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                    "leaderTemplate": ANY,  # a PodTemplateSpec: kubernetes-validate checks it
                    "workerTemplate": ANY,
                },
                required=["size", "workerTemplate"],
            ),
        },
        required=["leaderWorkerTemplate"],
    ),
)

# resource.nvidia.com/v1beta1 (NVIDIA k8s-dra-driver-gpu).
COMPUTE_DOMAIN = resource(
    "resource.nvidia.com/v1beta1",
    "ComputeDomain",
    strict(
        {
            "numNodes": {"type": "integer", "minimum": 0},
            "channel": strict(
                {
                    "allocationMode": {"enum": ["All", "Single"]},
                    "resourceClaimTemplate": strict({"name": STR}, required=["name"]),
                },
                required=["resourceClaimTemplate"],
            ),
        },
        required=["channel", "numNodes"],
    ),
)

CRD_SCHEMAS: dict[str, Schema] = {
    "LeaderWorkerSet": LEADER_WORKER_SET,
    "ComputeDomain": COMPUTE_DOMAIN,
}
