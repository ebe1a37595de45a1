"""`/metrics`: the sidecar's Prometheus series, prefix `mla_serve_`.

Gauges are computed at scrape time from the sidecar's current view (vLLM
snapshot, fix report, engine ranks), so a scrape never shows a stale mix.
Naming follows Prometheus' rules: base units (seconds, bytes), `_info` gauges
of value 1 carrying labels, `_total` for counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mla_serve.sidecar.engine import Rank
from mla_serve.sidecar.fixes import FixReport
from mla_serve.sidecar.vllm_monitor import VllmSnapshot


@dataclass(frozen=True)
class View:
    """Everything a scrape reports, taken at one instant."""

    vllm: VllmSnapshot
    fixes: FixReport
    ranks: list[Rank]
    ready: bool


class SidecarCollector(Collector):
    def __init__(self, view: Callable[[], View]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        yield _gauge("mla_serve_vllm_up", "1 when vLLM's /health answers 200.", int(view.vllm.up))
        yield _gauge("mla_serve_ready", "1 when the sidecar's /readyz passes.", int(view.ready))
        yield from _fixes(view.fixes)
        yield from _engine(view.ranks)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _fixes(report: FixReport) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mla_serve_fix_info",
        "Sparse-MLA fixes in the image: status patched, upstream or not-affected.",
        labels=["fix", "status", "vllm_version"],
    )
    for fix in report.fixes:
        info.add_metric([str(fix["id"]), str(fix["status"]), str(report.vllm_version)], 1)
    yield info
    if report.path is not None and report.checked_at is not None:  # fail closed: 0 unless verified
        yield _gauge(
            "mla_serve_manifest_verified",
            "1 when the patched vLLM files and probes match the fix manifest.",
            int(report.verified is True),
        )


def _engine(ranks: list[Rank]) -> Iterator[Metric]:
    mode = GaugeMetricFamily(
        "mla_serve_cudagraph_mode_info",
        "CUDA graph mode each engine rank runs, after backend downgrades.",
        labels=["mode", "rank"],
    )
    sizes = GaugeMetricFamily(
        "mla_serve_cudagraph_capture_sizes",
        "Number of batch sizes captured as CUDA graphs.",
        labels=["rank"],
    )
    duration = GaugeMetricFamily(
        "mla_serve_cudagraph_capture_duration_seconds",
        "Wall time of CUDA graph capture.",
        labels=["rank"],
    )
    memory = GaugeMetricFamily(
        "mla_serve_cudagraph_capture_memory_bytes",
        "GPU memory taken by CUDA graph capture.",
        labels=["rank"],
    )
    workspace = GaugeMetricFamily(
        "mla_serve_sparse_mla_workspace_bytes",
        "FlashInfer sparse-MLA workspace per rank: allocated, and the sizing model's figure.",
        labels=["rank", "kind"],
    )
    scratch = GaugeMetricFamily(
        "mla_serve_attention_workspace_bytes",
        "vLLM's shared attention workspace per rank, at its size locked after graph capture.",
        labels=["rank"],
    )
    backend = GaugeMetricFamily(
        "mla_serve_attention_backend_info",
        "Attention backends each engine rank selected.",
        labels=["backend", "rank"],
    )
    for rank in ranks:
        label = str(rank.rank)
        if rank.get("cudagraph_mode") is not None:
            mode.add_metric([str(rank.get("cudagraph_mode")), label], 1)
        if rank.get("cudagraph_capture_sizes") is not None:
            sizes.add_metric([label], len(rank.get("cudagraph_capture_sizes")))
        if rank.get("capture_seconds") is not None:
            duration.add_metric([label], float(rank.get("capture_seconds")))
        if rank.get("capture_bytes") is not None:
            memory.add_metric([label], float(rank.get("capture_bytes")))
        if rank.get("sparse_mla_workspace_bytes") is not None:
            workspace.add_metric([label, "actual"], float(rank.get("sparse_mla_workspace_bytes")))
        if rank.get("attention_workspace_bytes") is not None:
            scratch.add_metric([label], float(rank.get("attention_workspace_bytes")))
        if rank.predicted_workspace_bytes is not None:
            workspace.add_metric([label, "predicted"], float(rank.predicted_workspace_bytes))
        for name in rank.get("attention_backends") or []:
            backend.add_metric([str(name), label], 1)
    yield from (mode, sizes, duration, memory, workspace, scratch, backend)
