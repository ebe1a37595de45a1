#!/usr/bin/env python3
"""Write helm/mla-serve/values.schema.json (run after editing; tests check it is current).

JSON Schema cannot multiply, so the layout rules that involve products of the parallel sizes
(DCP against TP x PCP, the NVLink domain, even splits over nodes) are written out here as
if/then clauses over the finite set of sizes the chart accepts. Each clause puts its demand on
the one value a user would change, so Helm's message names it, e.g.

    at '/parallelism/decodeContext': value must be one of 1, 4

Usage: python helm/tools/gen_schema.py [--check]
"""

from __future__ import annotations

import sys
from itertools import product
from pathlib import Path
from typing import Any

import generated

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "mla-serve" / "values.schema.json"

# Parallel sizes are powers of two: heads, experts and KV shards only split evenly then.
SIZES = [1, 2, 4, 8, 16, 32, 64]
# GPUs on one node: 4 on a GB300/GB200 compute tray, 8 on HGX B200/B300/H200.
GPUS_PER_NODE = [1, 2, 4, 8]
MAX_DATA = 256

ARCHES = ["amd64", "arm64"]  # the platforms `make image` builds (linux/amd64, linux/arm64)
CUDAGRAPH_MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
# vLLM 0.33.0 vllm/config/cache.py CacheDType.
KV_CACHE_DTYPES = [
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
]

Schema = dict[str, Any]

# The sidecar's --loop-action values (mla_serve/sidecar/loops.py ACTIONS).
LOOP_ACTIONS = ["off", "observe", "stop"]


def obj(properties: dict[str, Schema], required: list[str] | None = None, **extra: Any) -> Schema:
    out: Schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = required
    out.update(extra)
    return out


def string(**extra: Any) -> Schema:
    return {"type": "string", **extra}


def integer(minimum: int | None = None, **extra: Any) -> Schema:
    out: Schema = {"type": "integer"}
    if minimum is not None:
        out["minimum"] = minimum
    out.update(extra)
    return out


def nullable(schema: Schema) -> Schema:
    kind = schema["type"]
    return {**schema, "type": [kind, "null"]}


BOOL: Schema = {"type": "boolean"}
ANY_OBJECT: Schema = {"type": "object"}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY: Schema = {
    "type": ["string", "integer"],
    "pattern": r"^[0-9]+(\.[0-9]+)?([EPTGMk]i?|m)?$",
}
DURATION: Schema = string(pattern=r"^([0-9]+(ms|s|m|h|d|w|y))+$")
DNS_LABEL = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"
ENV_LIST: Schema = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": string(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")},
    },
}
RESOURCES: Schema = obj(
    {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY},
    }
)
PEERS: Schema = {"type": "array", "items": ANY_OBJECT}


def size(description: str) -> Schema:
    return {"type": "integer", "enum": SIZES, "description": description}


def parallelism() -> Schema:
    return obj(
        {
            "tensor": size("--tensor-parallel-size"),
            "prefillContext": size("--prefill-context-parallel-size"),
            "decodeContext": size("--decode-context-parallel-size"),
            "pipeline": size("--pipeline-parallel-size"),
            "data": integer(1, maximum=MAX_DATA, description="--data-parallel-size"),
            "expert": {**BOOL, "description": "--enable-expert-parallel"},
        },
        required=["tensor", "prefillContext", "decodeContext", "pipeline", "data", "expert"],
    )


Path_ = tuple[str, ...]


class Leaf:
    def __init__(self, schema: Schema) -> None:
        self.schema = schema


def nest(items: dict[Path_, Schema]) -> Schema:
    """{("a", "b"): S} -> {"properties": {"a": {"properties": {"b": S}, "required": ["b"]}}, ...}"""
    tree: dict[str, Any] = {}
    for path, schema in items.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = Leaf(schema)

    def build(node: dict[str, Any]) -> Schema:
        props = {
            key: child.schema if isinstance(child, Leaf) else build(child)
            for key, child in node.items()
        }
        return {"properties": props, "required": sorted(props)}

    return build(tree)


def when(condition: dict[Path_, Any], demand: dict[Path_, Schema]) -> Schema:
    """if every path == value in condition then every path satisfies its schema in demand."""
    return {
        "if": nest({path: {"const": value} for path, value in condition.items()}),
        "then": nest(demand),
    }


def layout_rules() -> list[Schema]:
    rules: list[Schema] = []
    # vLLM ParallelConfig: without PCP, DCP reuses the TP ranks (tp % dcp == 0); with PCP, DCP is
    # disabled, spans the PCP axis, or spans the full TP x PCP axis.
    for dcp in SIZES[1:]:
        rules.append(
            when(
                {("parallelism", "prefillContext"): 1, ("parallelism", "decodeContext"): dcp},
                {("parallelism", "tensor"): {"enum": [t for t in SIZES if t % dcp == 0]}},
            )
        )
    for pcp, tp in product(SIZES[1:], SIZES):
        allowed = sorted({1, pcp, tp * pcp})
        rules.append(
            when(
                {("parallelism", "prefillContext"): pcp, ("parallelism", "tensor"): tp},
                {("parallelism", "decodeContext"): {"enum": allowed}},
            )
        )
    # vLLM 0.33.0's PCP manager (vllm/v1/worker/gpu/pcp_manager.py) refuses DCP over PCP with
    # any DCP communication backend but ag_rs.
    rules.append(
        {
            "if": nest(
                {
                    ("parallelism", "prefillContext"): {"minimum": 2},
                    ("parallelism", "decodeContext"): {"minimum": 2},
                }
            ),
            "then": {
                "properties": {
                    "vllm": {"properties": {"dcpCommBackend": {"not": {"const": "a2a"}}}}
                }
            },
        }
    )
    # The TP x PCP group runs a collective in every layer: it must sit inside one NVLink domain,
    # i.e. one node, unless a ComputeDomain extends NVLink across the trays of an NVL72 rack.
    for tp, pcp in product(SIZES, SIZES):
        group = tp * pcp
        if group <= 1:
            continue
        # Either the node is big enough or NVLink spans nodes: Helm prints both alternatives.
        rule = when(
            {("parallelism", "tensor"): tp, ("parallelism", "prefillContext"): pcp},
            {},
        )
        rule["then"] = {
            "anyOf": [
                nest({("gpu", "perNode"): {"minimum": group}}),
                nest({("multiNode", "computeDomain", "enabled"): {"const": True}}),
            ]
        }
        rules.append(rule)
    # A layout larger than one node must give every node the same number of GPUs (vLLM:
    # --nnodes must divide the world size). tensor x prefillContext x pipeline is a power of two,
    # so only the data-parallel size can break the split: with g GPUs per node and a model group
    # of w < g GPUs, data must be <= g / w (one node) or a multiple of g / w (whole nodes).
    for tp, pcp, pp in product(SIZES, SIZES, SIZES):
        group = tp * pcp * pp
        for per_node in GPUS_PER_NODE:
            if group >= per_node:
                continue
            step = per_node // group
            rules.append(
                when(
                    {
                        ("parallelism", "tensor"): tp,
                        ("parallelism", "prefillContext"): pcp,
                        ("parallelism", "pipeline"): pp,
                        ("gpu", "perNode"): per_node,
                    },
                    {
                        ("parallelism", "data"): {
                            "anyOf": [{"maximum": step}, {"multipleOf": step}],
                        }
                    },
                )
            )
    return rules


def schema() -> Schema:
    vllm = obj(
        {
            "port": integer(1, maximum=65535),
            "gpuMemoryUtilization": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "maxModelLen": nullable(integer(1)),
            "maxNumBatchedTokens": nullable(integer(1)),
            "maxNumSeqs": nullable(integer(1)),
            "kvCacheDtype": {"type": "string", "enum": ["", *KV_CACHE_DTYPES]},
            "attentionBackend": string(pattern=r"^[A-Z0-9_]*$"),
            # vLLM's DCPCommBackend (vllm/config/parallel.py); "" leaves the model's default
            "dcpCommBackend": {"type": "string", "enum": ["", "ag_rs", "a2a"]},
            "cudagraphMode": {"type": "string", "enum": CUDAGRAPH_MODES},
            "enforceEager": BOOL,
            "enablePrefixCaching": {"type": ["boolean", "null"]},
            "reasoningParser": string(pattern=r"^[a-z0-9_]*$"),
            "toolCallParser": string(pattern=r"^[a-z0-9_]*$"),
            "dtype": string(),
            "quantization": string(),
            "plugins": {
                "type": "array",
                "items": string(minLength=1),
                "anyOf": [{"maxItems": 0}, {"contains": {"const": "mla_serve"}}],
            },
            "disableAccessLogForEndpoints": string(),
            "apiKey": obj({"secretName": string(), "secretKey": string(minLength=1)}),
            "extraArgs": {"type": "array", "items": string()},
            "env": ENV_LIST,
            "resources": RESOURCES,
        },
        required=["port", "gpuMemoryUtilization", "cudagraphMode"],
        # --enforce-eager captures no graph: the intent (and the alert) must say NONE.
        **{
            "if": {"properties": {"enforceEager": {"const": True}}, "required": ["enforceEager"]},
            "then": {"properties": {"cudagraphMode": {"const": "NONE"}}},
        },
    )
    minutes = integer(0, maximum=600)
    top: Schema = obj(
        {
            "nameOverride": string(pattern=DNS_LABEL, maxLength=63),
            "fullnameOverride": string(pattern=DNS_LABEL, maxLength=63),
            "profile": string(pattern=DNS_LABEL, maxLength=63),
            "image": obj(
                {
                    "repository": string(minLength=1),
                    "tag": string(),
                    "digest": string(pattern=r"^(sha256:[a-f0-9]{64})?$"),
                    "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]},
                },
                required=["repository"],
            ),
            "imagePullSecrets": {"type": "array", "items": ANY_OBJECT},
            "model": obj(
                {
                    "name": string(minLength=1),
                    "revision": string(),
                    "servedModelName": string(),
                    "trustRemoteCode": BOOL,
                },
                required=["name"],
            ),
            "hfToken": obj({"secretName": string(), "secretKey": string(minLength=1)}),
            "modelCache": obj(
                {
                    "enabled": BOOL,
                    "mountPath": string(pattern=r"^/"),
                    "existingClaim": string(),
                    "create": obj(
                        {
                            "size": QUANTITY,
                            "storageClassName": string(),
                            "accessModes": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "enum": [
                                        "ReadWriteOnce",
                                        "ReadWriteMany",
                                        "ReadOnlyMany",
                                        "ReadWriteOncePod",
                                    ]
                                },
                            },
                            "keepOnUninstall": BOOL,
                        }
                    ),
                    "prefetch": BOOL,
                    "offline": BOOL,
                }
            ),
            "parallelism": parallelism(),
            "gpu": obj(
                {
                    "product": string(),
                    "productLabel": string(minLength=1),
                    # the nodes' CPU architecture (kubernetes.io/arch): the image's platform
                    "arch": {"type": "string", "enum": ["", *ARCHES]},
                    "perNode": {"type": "integer", "enum": GPUS_PER_NODE},
                    "memoryGiB": {"type": "number", "minimum": 0},
                    "resourceName": string(minLength=1),
                },
                required=["perNode"],
            ),
            "vllm": vllm,
            "sidecar": obj(
                {
                    "port": integer(1, maximum=65535),
                    "adminPort": integer(1, maximum=65535),
                    "passthrough": BOOL,
                    "manifest": string(pattern=r"^/"),
                    "extraRoutes": {
                        "type": "array",
                        "items": string(pattern=r"^/[A-Za-z0-9._~*/-]*$"),
                    },
                    "trustedProxies": {"type": "array", "items": string(minLength=1)},
                    "drain": obj(
                        {
                            "delaySeconds": integer(0, maximum=600),
                            "timeoutSeconds": integer(1, maximum=3600),
                        }
                    ),
                    "canary": obj(
                        {
                            "enabled": BOOL,
                            "intervalSeconds": integer(1),
                            "concurrency": integer(1, maximum=256),
                            "maxTokens": integer(1),
                            "prompt": string(),
                        }
                    ),
                    "loopGuard": obj(
                        {
                            "action": {"enum": LOOP_ACTIONS},
                            "modelActions": {
                                "type": "object",
                                "additionalProperties": {"enum": LOOP_ACTIONS},
                            },
                            "minRepeats": integer(2),
                            "windowChars": integer(64),
                            "minChars": integer(33),
                            "vllmDefaults": obj(
                                {
                                    "repetitionDetection": obj(
                                        {
                                            "maxPatternSize": integer(0),
                                            "minPatternSize": integer(0),
                                            "minCount": integer(0),
                                        }
                                    ),
                                    "thinkingTokenBudget": nullable(integer(0)),
                                }
                            ),
                        }
                    ),
                    "env": ENV_LIST,
                    "resources": RESOURCES,
                }
            ),
            "shm": obj({"sizeLimit": QUANTITY}),
            "startup": obj(
                {
                    "weightLoadMinutes": minutes,
                    "compileMinutes": minutes,
                    "cudaGraphCaptureMinutes": minutes,
                    "periodSeconds": integer(1, maximum=60),
                }
            ),
            "probes": obj(
                {
                    "readiness": obj({"periodSeconds": integer(1), "failureThreshold": integer(1)}),
                    "liveness": obj({"periodSeconds": integer(1), "failureThreshold": integer(1)}),
                    "engineLiveness": BOOL,
                }
            ),
            "replicaCount": integer(0),
            "strategy": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"enum": ["Recreate", "RollingUpdate"]},
                    "rollingUpdate": ANY_OBJECT,
                },
                "additionalProperties": False,
            },
            "terminationGracePeriodSeconds": integer(0),
            "serviceAccount": obj(
                {
                    "create": BOOL,
                    "name": string(),
                    "annotations": STRING_MAP,
                    "automountToken": BOOL,
                }
            ),
            "podLabels": STRING_MAP,
            "podAnnotations": STRING_MAP,
            "nodeSelector": STRING_MAP,
            "tolerations": {"type": "array", "items": ANY_OBJECT},
            "affinity": ANY_OBJECT,
            "topologySpreadConstraints": {"type": "array", "items": ANY_OBJECT},
            "priorityClassName": string(),
            "runtimeClassName": string(),
            "podSecurityContext": ANY_OBJECT,
            "securityContext": ANY_OBJECT,
            "service": obj(
                {
                    "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                    "port": integer(1, maximum=65535),
                    "annotations": STRING_MAP,
                }
            ),
            "podDisruptionBudget": obj(
                {"enabled": BOOL, "maxUnavailable": {"type": ["integer", "string"]}}
            ),
            "networkPolicy": obj({"enabled": BOOL, "apiFrom": PEERS, "metricsFrom": PEERS}),
            "multiNode": obj(
                {
                    "masterPort": integer(1, maximum=65535),
                    "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                    "ipcLock": BOOL,
                    "computeDomain": obj(
                        {
                            "enabled": BOOL,
                            "numNodes": integer(0),
                            "cliqueTopologyKey": string(),
                        }
                    ),
                }
            ),
            "monitoring": obj(
                {
                    "podMonitor": obj(
                        {"enabled": BOOL, "interval": DURATION, "labels": STRING_MAP}
                    ),
                    "serviceMonitor": obj(
                        {"enabled": BOOL, "interval": DURATION, "labels": STRING_MAP}
                    ),
                    "prometheusRule": obj(
                        {
                            "enabled": BOOL,
                            "labels": STRING_MAP,
                            "runbookUrl": string(minLength=1),
                            "runaways": obj(
                                {
                                    "window": DURATION,
                                    "ratio": {
                                        "type": "number",
                                        "exclusiveMinimum": 0,
                                        "maximum": 1,
                                    },
                                    "fallbackLengthRatio": {
                                        "type": "number",
                                        "exclusiveMinimum": 0,
                                        "maximum": 1,
                                    },
                                    "minCompletions": integer(1),
                                    "for": DURATION,
                                }
                            ),
                            "reasoningLoops": obj(
                                {
                                    "window": DURATION,
                                    "minLoops": integer(1),
                                    "ratio": {"type": "number", "minimum": 0},
                                    "for": DURATION,
                                }
                            ),
                            "kvCacheUsage": {
                                "type": "number",
                                "exclusiveMinimum": 0,
                                "maximum": 1,
                            },
                            "queueWaiting": integer(1),
                        }
                    ),
                    "grafanaDashboard": obj(
                        {"enabled": BOOL, "labels": STRING_MAP, "annotations": STRING_MAP}
                    ),
                },
            ),
            "tests": obj(
                {
                    "enabled": BOOL,
                    "prompt": string(minLength=1),
                    "expect": string(),
                    "maxTokens": integer(1),
                    "timeoutSeconds": integer(1),
                }
            ),
        },
        required=["image", "model", "parallelism", "gpu", "vllm"],
    )
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "mla-serve values",
        "description": (
            "Generated by helm/tools/gen_schema.py; edit that file, not this one. Parallel sizes "
            "are powers of two; layout rules are if/then clauses over them."
        ),
        **top,
        "allOf": layout_rules(),
    }


def main() -> int:
    return generated.main(SCHEMA_PATH, schema, __doc__.splitlines()[0], Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
