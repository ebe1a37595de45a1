"""The pass-through's event decoder (`classify.loads`) is json.loads, value for value and error
for error: on vLLM's own recorded chunks and on the malformed and odd inputs a stream can
carry."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import pytest

from mla_serve.sidecar.passthrough.classify import loads as _loads
from tests.bench.passthrough.replay import RECORDINGS

ROOT = Path(__file__).resolve().parents[1]
RECORDED = sorted(glob.glob(str(ROOT / RECORDINGS)))


def outcome(decode: Any, data: bytes) -> tuple[str, Any]:
    try:
        return "value", decode(data)
    except RecursionError:
        return "RecursionError", None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
        return type(error).__name__, str(error)


def test_vllms_recorded_chunks_decode_as_json_loads_does() -> None:
    assert RECORDED, "the recorded vLLM streams are part of the repository"
    seen = 0
    for path in RECORDED:
        for stream in json.loads(Path(path).read_text())["streams"]:
            for _, text in stream["chunks"]:
                for event in text.encode().split(b"\n\n")[:-1]:
                    if event.startswith(b"data: {"):
                        data = event[6:]
                        assert outcome(_loads, data) == outcome(json.loads, data)
                        seen += 1
    assert seen > 1000


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": 1}',
        b'{"a": 1}\n\n',
        b'{"a": 1} \t\r\n',
        b'{"a": 1} x',
        b'{"a": 1}{"b": 2}',
        b"{",
        b"{}",
        b'{"a": "\xed\xa0\x80"}',  # an encoded surrogate: json.loads passes it (surrogatepass)
        b'{"a": "\xff"}',  # not UTF-8
        b'{"a": "caf\xc3\xa9 \\ud83d\\ude00"}',
        b'{"a": NaN, "b": -Infinity}',
        b'{"a": 1, "a": 2}',
        b"{" + b'"a":[' * 100_000 + b"]" * 100_000 + b"}",
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32-le"),
        b' {"a": 1}',
        b"\xef\xbb\xbf{}",
        b"[1]",
        b"",
    ],
)
def test_odd_and_malformed_data_decode_as_json_loads_does(data: bytes) -> None:
    assert outcome(_loads, data) == outcome(json.loads, data)
