"""`/metrics`: the sidecar's Prometheus series, prefix `mla_serve_`.

Gauges are computed at scrape time from the sidecar's current view (vLLM
snapshot, fix report, engine ranks), so a scrape never shows a stale mix. The
engine series are generated from the table `mla_serve.engine.contract.FIGURES`.
Naming follows Prometheus' rules: base units (seconds, bytes), `_info` gauges
of value 1 carrying labels, `_total` for counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mla_serve.engine.contract import FIGURES, Figure, check_table
from mla_serve.engine.ranks import Engine, Rank
from mla_serve.patching.catalog import Status
from mla_serve.sidecar.admin.fixes import FixReport
from mla_serve.sidecar.admin.vllm_monitor import VllmSnapshot

check_table()  # the sidecar refuses to start on a table that disagrees with the record


@dataclass(frozen=True)
class View:
    """Everything a scrape reports, taken at one instant."""

    vllm: VllmSnapshot
    fixes: FixReport
    engine: Engine
    ready: bool


class SidecarCollector(Collector):
    def __init__(self, view: Callable[[], View]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        yield _gauge("mla_serve_vllm_up", "1 when vLLM's /health answers 200.", int(view.vllm.up))
        yield _gauge("mla_serve_ready", "1 when the sidecar's /readyz passes.", int(view.ready))
        yield from _fixes(view.fixes)
        yield from _engine(view.engine.ranks)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


# Every status the catalog derives, in its order: "patched, upstream, not-affected or affected".
_STATUSES = [status.value for status in Status]
FIX_INFO_HELP = (
    f"Sparse-MLA fixes in the image: status {', '.join(_STATUSES[:-1])} or {_STATUSES[-1]}."
)


def _fixes(report: FixReport) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mla_serve_fix_info",
        FIX_INFO_HELP,
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
    """Every engine series of `contract.FIGURES`, in the table's order; a family fed by
    several figures (actual and predicted workspace) holds each rank's samples together."""
    families: dict[str, tuple[GaugeMetricFamily, list[Figure]]] = {}
    for figure in FIGURES:
        series = figure.series
        if series is not None:
            family = families.get(series.name)
            if family is None:
                gauge = GaugeMetricFamily(series.name, series.help, labels=list(series.labels))
                family = families[series.name] = (gauge, [])
            family[1].append(figure)
    for gauge, figures in families.values():
        for rank in ranks:
            for figure in figures:
                _add(gauge, figure, rank)
        yield gauge


def _add(gauge: GaugeMetricFamily, figure: Figure, rank: Rank) -> None:
    """The samples of one rank's figure, by its series' rule (see contract.Series)."""
    series = figure.series
    value = rank.value(figure.name)
    if series is None or value is None:
        return
    fixed = {"rank": str(rank.rank), **dict(series.constants)}
    if series.sample == "info":
        for text in value if isinstance(value, tuple) else (value,):
            labels = {**fixed, str(series.info_label): str(text)}
            gauge.add_metric([labels[name] for name in series.labels], 1)
        return
    values = [fixed[name] for name in series.labels]
    if series.sample == "count":
        assert isinstance(value, tuple)
        gauge.add_metric(values, len(value))
    else:
        assert isinstance(value, int | float)
        gauge.add_metric(values, float(value))
