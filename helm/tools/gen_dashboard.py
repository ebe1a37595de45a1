#!/usr/bin/env python3
"""Write helm/mla-serve/files/dashboard.json, the Grafana dashboard the chart ships.

Every query selects on the labels the chart's PodMonitor/ServiceMonitor add
(mla_serve_release, mla_serve_role), like the alert rules.

Usage: python helm/tools/gen_dashboard.py [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import generated

DASHBOARD = Path("files") / "dashboard.json"  # in the chart

SEL = 'namespace="$namespace", mla_serve_release="$release"'
LEADER = SEL + ', mla_serve_role="leader"'
RATE = "$__rate_interval"

Panel = dict[str, Any]


class Layout:
    """Places panels left to right, 24 columns wide."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_height = 0
        self.next_id = 1
        self.panels: list[Panel] = []

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: Panel, w: int, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["datasource"] = {"type": "prometheus", "uid": "${datasource}"}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = 0
        self.row_height = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {
        "refId": ref,
        "expr": expr,
        "legendFormat": legend,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        **extra,
    }


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str) -> Panel:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
    }


def stat(title: str, description: str, expr: str, unit: str, steps: list[Any]) -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "targets": [target(expr, instant=True)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {"colorMode": "background", "reduceOptions": {"calcs": ["lastNotNull"]}},
    }


def table(title: str, description: str, expr: str, columns: list[str]) -> Panel:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "targets": [target(expr, format="table", instant=True)],
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "Value": True, "__name__": True},
                    "indexByName": {name: i for i, name in enumerate(columns)},
                },
            }
        ],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
    }


RED_GREEN = [{"color": "red", "value": None}, {"color": "green", "value": 1}]


def dashboard() -> dict[str, Any]:
    lay = Layout()
    lay.row("Length-cap runaways")
    lay.add(
        timeseries(
            "Runaway share of completions (sidecar)",
            "finish_reason=length with no visible answer and no tool call, per model. Alert "
            "MlaServeLengthCapRunaways fires above the configured ratio.",
            [
                target(
                    f"sum by (model) (rate(mla_serve_runaway_completions_total{{{SEL}}}[{RATE}]))"
                    f" / sum by (model) (rate(mla_serve_completions_total{{{SEL}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            "percentunit",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Completions by finished_reason (sidecar)",
            "Every response the pass-through relayed.",
            [
                target(
                    "sum by (finished_reason) "
                    f"(rate(mla_serve_completions_total{{{SEL}}}[{RATE}]))",
                    "{{finished_reason}}",
                )
            ],
            "reqps",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "vLLM finished_reason share",
            "vLLM's own count; 'length' here includes long legitimate answers.",
            [
                target(
                    f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}[{RATE}]))"
                    f" / scalar(sum(rate(vllm:request_success_total{{{SEL}}}[{RATE}])))",
                    "{{finished_reason}}",
                )
            ],
            "percentunit",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Tokens burnt by runaways",
            "Completion tokens of runaway responses: GPU time that produced no answer.",
            [
                target(
                    f"sum by (model) (rate(mla_serve_runaway_tokens_total{{{SEL}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            "short",
        ),
        w=12,
    )
    lay.add(
        timeseries(
            "Canary runaways",
            "The sidecar's own probe requests that ran away (works without client traffic).",
            [
                target(
                    f"sum by (model) (increase(mla_serve_canary_runaway_completions_total{{{SEL}}}"
                    f"[{RATE}]))",
                    "runaway {{model}}",
                ),
                target(
                    f"sum by (model) (increase(mla_serve_canary_completions_total{{{SEL}}}"
                    f"[{RATE}]))",
                    "all {{model}}",
                    ref="B",
                ),
            ],
            "short",
        ),
        w=12,
    )
    lay.row("Reasoning loops (runaway guard)")
    lay.add(
        timeseries(
            "Loops confirmed",
            "Choices whose streamed text became an exact loop (sidecar.loopGuard), by model and "
            "channel, counted when confirmed: long before the request reaches max_tokens. Alert "
            "MlaServeReasoningLoops.",
            [
                target(
                    f"sum by (model, channel) (increase(mla_serve_reasoning_loops_total{{{SEL}}}"
                    f"[{RATE}]))",
                    "{{model}} {{channel}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Tokens saved by stopping loops",
            "max_tokens minus the tokens emitted, for each loop the guard stopped (action stop); "
            "stopped choices per second on the right.",
            [
                target(
                    f"sum by (model) (rate(mla_serve_loop_tokens_saved_total{{{SEL}}}[{RATE}]))",
                    "tokens/s saved {{model}}",
                ),
                target(
                    f"sum by (model) (rate(mla_serve_loop_stops_total{{{SEL}}}[{RATE}]))",
                    "stops/s {{model}}",
                    ref="B",
                ),
            ],
            "short",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Runaways by cause",
            "Length-cap runaways split: loop (the guard saw an exact loop) or long_reasoning "
            "(reasoning that never ended without repeating itself).",
            [
                target(
                    f"sum by (cause) (increase(mla_serve_runaways_by_cause_total{{{SEL}}}"
                    f"[{RATE}]))",
                    "{{cause}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Tokens emitted before a loop was confirmed",
            "Median and 95th percentile of the tokens a choice had streamed when its loop was "
            "confirmed: how early the guard acts.",
            [
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(mla_serve_loop_detection_tokens_bucket{{{SEL}}}[{RATE}])))",
                    "p50",
                ),
                target(
                    "histogram_quantile(0.95, sum by (le) "
                    f"(rate(mla_serve_loop_detection_tokens_bucket{{{SEL}}}[{RATE}])))",
                    "p95",
                    ref="B",
                ),
            ],
            "short",
        ),
        w=24,
    )

    lay.row("Requests vLLM failed")
    lay.add(
        timeseries(
            "Errors the sidecar returned because vLLM failed",
            "Requests answered 503 (unreachable), 504 (timeout: no response head in time) or 502 "
            "(broken before the head) by the pass-through, per reason. Alert "
            "MlaServeUpstreamFailures.",
            [
                target(
                    f"sum by (reason) (increase(mla_serve_upstream_failures_total{{{SEL}}}"
                    f"[{RATE}]))",
                    "{{reason}}",
                )
            ],
            "short",
        ),
        w=24,
    )

    lay.row("Engine and fixes")
    lay.add(
        stat(
            "Ready replicas",
            "Leaders whose sidecar /readyz passes.",
            f"sum(mla_serve_ready{{{LEADER}}})",
            "none",
            RED_GREEN,
        ),
        w=4,
        h=5,
    )
    lay.add(
        stat(
            "vLLM up",
            "Leaders whose vLLM /health answers 200.",
            f"sum(mla_serve_vllm_up{{{LEADER}}})",
            "none",
            RED_GREEN,
        ),
        w=4,
        h=5,
    )
    lay.add(
        stat(
            "Fix manifest verified",
            "1 when every pod's patched vLLM files and probes match the manifest.",
            f"min(mla_serve_manifest_verified{{{SEL}}})",
            "none",
            RED_GREEN,
        ),
        w=4,
        h=5,
    )
    lay.add(
        table(
            "Fixes in the image",
            "mla_serve_fix_info: each fix and its status for the running vLLM release.",
            f"max by (fix, status, vllm_version) (mla_serve_fix_info{{{SEL}}})",
            ["fix", "status", "vllm_version"],
        ),
        w=12,
        h=10,
    )
    lay.add(
        table(
            "CUDA graph mode per rank",
            "The mode each rank really runs (after vLLM's backend downgrades).",
            f"max by (pod, rank, mode) (mla_serve_cudagraph_mode_info{{{SEL}}})",
            ["pod", "rank", "mode"],
        ),
        w=12,
        h=5,
    )
    lay.add(
        timeseries(
            "CUDA graph capture time",
            "Seconds each rank spent capturing CUDA graphs at start-up.",
            [
                target(
                    f"max by (pod, rank) (mla_serve_cudagraph_capture_duration_seconds{{{SEL}}})",
                    "{{pod}} r{{rank}}",
                )
            ],
            "s",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "CUDA graph memory",
            "Bytes the captured graphs hold per rank (vLLM's own measure).",
            [
                target(
                    f"max by (pod, rank) (mla_serve_cudagraph_capture_memory_bytes{{{SEL}}})",
                    "{{pod}} r{{rank}}",
                )
            ],
            "bytes",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Sparse-MLA workspace: actual vs predicted",
            "FlashInfer TRTLLM workspace per rank; actual below predicted overflows on long "
            "prompts (alert MlaServeSparseMlaWorkspaceUndersized).",
            [
                target(
                    f"max by (pod, rank, kind) (mla_serve_sparse_mla_workspace_bytes{{{SEL}}})",
                    "{{pod}} r{{rank}} {{kind}}",
                )
            ],
            "bytes",
        ),
        w=8,
    )

    lay.row("Load")
    lay.add(
        timeseries(
            "KV cache usage",
            "vllm:kv_cache_usage_perc per engine.",
            [
                target(
                    f"max by (pod, engine) (vllm:kv_cache_usage_perc{{{SEL}}})",
                    "{{pod}} e{{engine}}",
                )
            ],
            "percentunit",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Requests running / waiting",
            "vllm:num_requests_running and vllm:num_requests_waiting.",
            [
                target(f"sum by (pod) (vllm:num_requests_running{{{SEL}}})", "running {{pod}}"),
                target(
                    f"sum by (pod) (vllm:num_requests_waiting{{{SEL}}})",
                    "waiting {{pod}}",
                    ref="B",
                ),
            ],
            "short",
        ),
        w=8,
    )
    lay.add(
        timeseries(
            "Generation throughput",
            "Output tokens per second.",
            [
                target(
                    f"sum by (pod) (rate(vllm:generation_tokens_total{{{SEL}}}[{RATE}]))",
                    "{{pod}}",
                )
            ],
            "short",
        ),
        w=8,
    )
    for title, metric in (
        ("Time to first token", "vllm:time_to_first_token_seconds"),
        ("Inter-token latency", "vllm:inter_token_latency_seconds"),
        ("Queue time", "vllm:request_queue_time_seconds"),
    ):
        lay.add(
            timeseries(
                title,
                f"p50 and p95 of {metric}.",
                [
                    target(
                        f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}"
                        f"[{RATE}])))",
                        f"p{int(q * 100)}",
                        ref=ref,
                    )
                    for q, ref in ((0.5, "A"), (0.95, "B"))
                ],
                "s",
            ),
            w=8,
        )

    return {
        "title": "mla-serve",
        "uid": "mla-serve",
        "description": "vLLM sparse-MLA serving: runaways, engine state and fixes, load.",
        "tags": ["mla-serve", "vllm"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(mla_serve_ready, namespace)",
                        "refId": "namespace",
                    },
                    "refresh": 2,
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "release",
                    "label": "Release",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": 'label_values(mla_serve_ready{namespace="$namespace"}, '
                        "mla_serve_release)",
                        "refId": "release",
                    },
                    "refresh": 2,
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "panels": lay.panels,
    }


def main() -> int:
    return generated.main(
        lambda chart: {chart / DASHBOARD: json.dumps(dashboard(), indent=2) + "\n"},
        (__doc__ or "").splitlines()[0],
        Path(__file__).name,
    )


if __name__ == "__main__":
    sys.exit(main())
