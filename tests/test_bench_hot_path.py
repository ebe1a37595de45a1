"""bench_hot_path (in `make bench`) runs here in a second: its figures exist, and its checks
catch a pass-through that changes vLLM's bytes or miscounts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_serve.sidecar.passthrough import proxy
from tests.bench import bench_hot_path


def test_the_hot_path_bench_measures_real_streams(tmp_path: Path) -> None:
    out = tmp_path / "hot_path.json"
    assert bench_hot_path.main(["--repeats", "1", "--scale", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["streams"] >= 10 and not result["problems"]
    assert result["token_reads"] > 0.8 * result["reads"]  # vLLM's token chunks take the match
    for key in ("us_per_request_request_side", "us_per_token_chunk"):
        assert 0 < result[key]["best"] <= result[key]["max"]
    # a token chunk's whole read both ways: Python, and the C lane (built for the tests)
    for way in ("python", "lane"):
        figures = result["us_per_token_read"][way]
        assert 0 < figures["best"] <= figures["max"]
    assert result["lane_took"] > 0.9  # vLLM's token chunks, a read each: nearly all in C


def test_the_hot_path_bench_fails_on_changed_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    original = proxy.Proxy._one

    def dropping(self: proxy.Proxy, event: bytes, *args: object) -> bytes:
        kept = original(self, event, *args)  # type: ignore[arg-type]
        return b"" if b'"usage"' in event else kept  # a usage event the client asked for, lost

    monkeypatch.setattr(proxy.Proxy, "_one", dropping)
    assert bench_hot_path.main(["--repeats", "1", "--scale", "1"]) == 1
