"""Strict schemas for the parts of custom resources the chart renders.

kubernetes-validate knows only built-in kinds. For the CRD kinds (LeaderWorkerSet, ComputeDomain,
PodMonitor, ServiceMonitor, PrometheusRule) these schemas cover every field the chart writes,
with unknown fields rejected, following each project's v1/v1beta1 API; the embedded core types
(pod templates, label selectors) are checked by kubernetes-validate itself, and the rules by
promtool.
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

# monitoring.coreos.com/v1 (prometheus-operator).
RELABELING = strict(
    {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "targetLabel": LABEL_NAME,
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
        "regex": STR,
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
    }
)
ENDPOINT = strict(
    {
        "port": STR,
        "path": {"type": "string", "pattern": "^/"},
        "interval": DURATION,
        "relabelings": {"type": "array", "items": RELABELING},
    },
    required=["port"],
)
NAMESPACE_SELECTOR = strict(
    {"matchNames": {"type": "array", "items": STR}, "any": {"type": "boolean"}}
)
POD_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    strict(
        {
            "selector": ANY,  # a LabelSelector: kubernetes-validate checks it
            "namespaceSelector": NAMESPACE_SELECTOR,
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
        },
        required=["selector", "podMetricsEndpoints"],
    ),
)
SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    strict(
        {
            "selector": ANY,
            "namespaceSelector": NAMESPACE_SELECTOR,
            "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
        },
        required=["selector", "endpoints"],
    ),
)
RULE = strict(
    {
        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
        "record": STR,
        "expr": STR,
        "for": DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    required=["expr"],
)
PROMETHEUS_RULE = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    strict(
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "name": STR,
                        "interval": DURATION,
                        "rules": {"type": "array", "minItems": 1, "items": RULE},
                    },
                    required=["name", "rules"],
                ),
            }
        },
        required=["groups"],
    ),
)

CRD_SCHEMAS: dict[str, Schema] = {
    "LeaderWorkerSet": LEADER_WORKER_SET,
    "ComputeDomain": COMPUTE_DOMAIN,
    "PodMonitor": POD_MONITOR,
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
}
