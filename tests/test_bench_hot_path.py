"""bench_hot_path (in `make bench`) runs here in a second: its figures exist, and its checks
catch a pass-through that changes vLLM's bytes or miscounts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla_serve.sidecar.passthrough.response import Reader
from tests.bench import bench_hot_path


def test_the_hot_path_bench_measures_real_streams(tmp_path: Path) -> None:
    out = tmp_path / "hot_path.json"
    assert bench_hot_path.main(["--repeats", "1", "--scale", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["streams"] >= 10 and not result["problems"]
    assert result["token_reads"] > 0.8 * result["reads"]  # vLLM's token chunks take the match
    for key in ("us_per_request_request_side", "us_per_token_chunk"):
        assert 0 < result[key]["best"] <= result[key]["max"]
    # a token chunk's whole read three ways: Python, msgspec in the shape's place, the C lane
    for way in ("python", "msgspec", "lane"):
        figures = result["us_per_token_read"][way]
        assert 0 < figures["best"] <= figures["max"]
    # vLLM's token chunks, a read each, in C: all but a stream's first (its shape learnt)
    # and where the guard's answer needs Python (a loop found, the text no longer kept)
    assert result["lane_took"] > 0.8


def test_the_hot_path_bench_fails_on_changed_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Reader._event

    def dropping(self: Reader, raw: bytes, data: bytes, whole: bool = False) -> bytes:
        kept = original(self, raw, data, whole)
        return b"" if b'"usage"' in raw else kept  # a usage event the client asked for, lost

    monkeypatch.setattr(Reader, "_event", dropping)
    assert bench_hot_path.main(["--repeats", "1", "--scale", "1"]) == 1
