"""Read a /metrics page the way Prometheus does: with prometheus_client's own parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(url: str) -> Samples:
    """Every sample of `url`/metrics by sample name (counters with their `_total`)."""
    found: Samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def count(url: str, name: str, **labels: str) -> float:
    """One counter sample's value; 0 before the labelled series exists."""
    return next((value for found, value in samples(url).get(name, []) if found == labels), 0.0)
