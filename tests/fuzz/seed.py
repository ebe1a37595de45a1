"""The fuzz targets' first inputs, written into a corpus folder per target:

    .venv/bin/python -m tests.fuzz.seed tests/fuzz/corpus

`frames` and `lane`: vLLM's token chunks as vLLM 0.33.0 frames them (tests/test_lane.py's
streams: reasoning, content, escapes, non-ASCII, a finish, usage, [DONE]), whole and cut;
`head_refusal`: a few draws; `protocol`: requests as clients write them (Content-Length,
chunked with trailers, pipelined, HTTP/1.0, Upgrade, Expect, codings). libFuzzer grows the
corpus from them (campaign.py keeps it minimized).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from tests import test_lane
from tests.bench.bench_hot_path import frame


def _streams() -> list[list[bytes]]:
    tokens = test_lane.thinking(6)
    for texts in test_lane.ODD_TEXTS.values():
        tokens += [("content", text) for text in texts]
    return [test_lane.vllm_stream(tokens), test_lane.vllm_stream(test_lane.thinking(40), "stop")]


def frames() -> list[bytes]:
    seeds = []
    for events in _streams():
        framed = [frame(event) for event in events[1:]]
        seeds += [framed[0], b"".join(framed[:3]), b"".join(framed[:-1]), framed[0][:-2],
                  framed[0].upper(), framed[1].replace(b"\r\n", b";x\r\n", 1)]  # fmt: skip
    return seeds


def lane() -> list[bytes]:
    seeds = []
    for events in _streams():
        framed = [frame(event) for event in events[2:]] + [b"0\r\n\r\n"]
        seeds.append(b"\xff".join(framed))
        seeds.append(
            b"S" + b"\xff".join(b"".join(framed[i : i + 3]) for i in range(0, len(framed), 3))
        )
        whole = b"".join(framed)
        seeds.append(b"\xff".join(whole[i : i + 97] for i in range(0, len(whole), 97)))
    return seeds


def head_refusal() -> list[bytes]:
    return [bytes(range(n, n + 24)) for n in (0, 40, 80, 200)] + [b"\x01" * 30, b"\xfe" * 30]


BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def protocol() -> list[bytes]:
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Length: %d\r\n\r\n%s" % (
        len(BODY), BODY)  # fmt: skip
    chunked = (b"POST /v1/responses?a=1 HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;x=y\r\nhello\r\n0\r\nX-T: 1\r\n\r\n")  # fmt: skip
    get = b"GET /v1/models HTTP/1.1\r\nHost: s\r\n\r\n"
    requests = [
        post, chunked, get + get, get.replace(b"1.1", b"1.0"), post + chunked,
        post.replace(b"Host: s\r\n", b"Host: s\r\nExpect: 100-continue\r\n"),
        post.replace(b"Host: s\r\n", b"Host: s\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"),
        chunked.replace(b"chunked", b"gzip, chunked"),
        post.replace(b"Host: s\r\n", b"Host: s\r\nTransfer-Encoding: chunked\r\n"),
        b"HEAD /v1/models HTTP/1.1\r\nHost: s\r\n\r\n" + get,
    ]  # fmt: skip
    return [bytes([control]) + request for request in requests for control in (0, 0x31, 0xA4)]


SEEDS = {"frames": frames, "lane": lane, "head_refusal": head_refusal, "protocol": protocol}


def main(out: Path) -> None:
    for name, make in SEEDS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for seed in make():
            (folder / hashlib.sha1(seed).hexdigest()).write_bytes(seed)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
