"""Pieces of the sidecar's hardening that need no server: SSE splitting, path
normalization, and the incremental vLLM log reader."""

from __future__ import annotations

import json
import random

import pytest

from mla_serve.engine import vllm_log
from mla_serve.sidecar.passthrough import routes, sse


def _events(end: bytes) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]} for i in range(20)]
    big = {"choices": [{"index": 0, "delta": {"reasoning": "z" * 70_000}}]}
    body = [b"data: " + json.dumps(c).encode() + end for c in chunks]
    body.insert(5, b"data: " + json.dumps(big).encode() + end)
    body.insert(9, b": comment" + end + b"event: ping" + end[: len(end) // 2] + b"data: {}" + end)
    return b"".join(body) + b"data: [DONE]" + end


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_splitter_is_byte_transparent_in_any_read_sizes(end: bytes) -> None:
    data = _events(end)
    rng = random.Random(12)
    for limit in (1 << 20, 4096):  # 4096: the big event goes through unparsed
        for _ in range(30):
            splitter = sse.Splitter(limit)
            out, parsed, at = b"", b"", 0
            while at < len(data):
                size = rng.choice([1, 1, 1, 2, 3, 50, 4096, 70_000])
                before, events, after = splitter.feed(data[at : at + size])
                out += before + events + after
                parsed += events
                at += size
            assert splitter.rest() == b""  # every event end was seen, the last one too
            assert out == data
            texts = [sse.data_of(event) for _, event in sse.split_events(parsed)]
            assert texts[-1] == b"[DONE]"
            classified = sum(1 for t in texts if t and t.startswith(b'{"choices"'))
            # The big event is parsed when it fits the limit or arrives whole in one read.
            assert classified + splitter.oversized == 21
            assert splitter.oversized == 0 or limit < 70_000
            assert splitter.size <= limit


def test_a_partial_event_is_buffered_linearly() -> None:
    splitter = sse.Splitter(1 << 30)
    piece = b"x" * 1000
    splitter.feed(b"data: ")
    for _ in range(2000):  # 2 MB one byte-run at a time: pieces, not one growing buffer
        assert splitter.feed(piece) == (b"", b"", b"")
    assert len(splitter.pieces) == 2001 and splitter.size == 2_000_006


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/v1/../metrics", "/metrics"),
        ("/v1/./chat/completions", "/v1/chat/completions"),
        ("//v1//chat//completions/", "/v1/chat/completions"),
        ("/v1/chat/completions/../../sleep", "/v1/sleep"),
        ("/../../..", "/"),
        ("/v1/%2e%2e/sleep", None),  # still encoded after one decoding: refused
        ("/v1/chat\x00", None),
        ("v1/models", None),
    ],
)
def test_normalize(raw: str, expected: str | None) -> None:
    assert routes.normalize(raw) == expected


def test_allow_list_with_one_segment_wildcards() -> None:
    allowed = routes.Routes(routes.OPENAI_ROUTES + routes.parse_extra("/v1/x/*/y"))
    assert allowed.allows("/v1/responses/resp_1") and allowed.allows("/v1/responses/r/cancel")
    assert allowed.allows("/v1/x/abc/y")
    assert not allowed.allows("/v1/responses/a/b") and not allowed.allows("/v1/x/y")
    assert not allowed.allows("/v1/load_lora_adapter") and not allowed.allows("/metrics")
    for bad in ("../admin", "/v1/../admin", "/v1/**"):
        with pytest.raises(ValueError):
            routes.parse_extra(bad)


CONFIG = "INFO config: compilation_config={'cudagraph_mode': <CUDAGraphMode.PIECEWISE: 1>}\n"
CAPTURE = "(Worker_TP{rank} pid=1) INFO Graph capturing finished in 9 secs, took 0.50 GiB\n"


def test_log_is_read_incrementally_and_follows_rotation(tmp_path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text(CONFIG + "noise\n" * 1000)
    log = vllm_log.LogFile(path, max_line=100)
    assert log.refresh()[0].cudagraph_mode == "PIECEWISE"
    offset = log.offset
    with path.open("a") as handle:
        handle.write("x" * 500 + "\n")  # over max_line: skipped, never buffered whole
        handle.write(CAPTURE.format(rank=1)[:30])  # half a line: previewed, kept for later
    figures = log.refresh()
    assert log.offset > offset and log.partial == CAPTURE.format(rank=1)[:30].encode()
    assert [r.rank for r in figures] == [0]
    with path.open("a") as handle:
        handle.write(CAPTURE.format(rank=1)[30:])
    assert [r.rank for r in log.refresh()] == [1]
    path.rename(tmp_path / "vllm.log.1")  # rotation: another file, read from its start
    path.write_text("INFO setting cudagraph_mode=FULL\n")
    (rank,) = log.refresh()
    assert rank.cudagraph_mode == "FULL" and rank.capture_seconds == 9.0
    path.write_text("")  # truncation
    path.write_text("Cudagraph is disabled under eager mode\n")
    assert log.refresh()[0].cudagraph_mode == "NONE"
    path.unlink()
    assert log.refresh()[0].cudagraph_mode == "NONE" and "vllm.log" in str(log.error)


def test_a_negative_capture_memory_is_read_as_vllm_logged_it() -> None:
    """vLLM logs the free-memory difference around the capture; it is negative when another
    process on the GPU freed memory meanwhile (seen on two H200s with stacks sharing the GPUs)."""
    line = (
        "(Worker_TP0_DCP0 pid=2341) INFO 11-30 14:15:06 [model_runner.py:960] "
        "Graph capturing finished in 10 secs, took -1.40 GiB"
    )
    (rank,) = vllm_log.parse(line)
    assert rank.capture_seconds == 10.0
    assert rank.capture_bytes == int(-1.40 * (1 << 30))


def test_interleaved_worker_lines_keep_each_rank_s_capture() -> None:
    """Two workers writing at once interleave: TP0's prefix, TP1's whole line, then TP0's
    message alone (as vLLM 0.29.0 logged it on two H200s with TP2 x DCP2). Each rank keeps its
    own figures."""
    text = (
        "(Worker_TP0_DCP0 pid=2684) (Worker_TP1_DCP1 pid=2685) INFO 11-30 16:13:30 "
        "[model_runner.py:960] Graph capturing finished in 8 secs, took -5.29 GiB\n"
        "INFO 11-30 16:13:30 [model_runner.py:960] Graph capturing finished in 7 secs, "
        "took 0.13 GiB\n"
    )
    figures = {rank.rank: rank for rank in vllm_log.parse(text)}
    assert set(figures) == {0, 1}
    assert figures[1].capture_bytes == int(-5.29 * (1 << 30))
    assert figures[0].capture_bytes == int(0.13 * (1 << 30))
    assert (figures[0].capture_seconds, figures[1].capture_seconds) == (7.0, 8.0)


def test_the_log_follower_knows_what_is_unread_without_reading(tmp_path):
    """`unread` (a stat) decides between a read on the event loop and one in a thread."""
    path = tmp_path / "vllm.log"
    log = vllm_log.LogFile(path)
    assert log.unread() is None  # missing
    path.write_bytes(b"INFO first line\n")
    assert log.unread() is None  # never read: the first read may be large, not inline
    log.refresh()
    assert log.unread() == 0
    with path.open("ab") as handle:
        handle.write(b"INFO a request\n")
    assert log.unread() == len(b"INFO a request\n")
    log.refresh()
    assert log.unread() == 0
    replaced = tmp_path / "rotated.log"
    replaced.write_bytes(b"x\n")
    replaced.replace(path)  # another inode (rotation)
    assert log.unread() is None
    log.refresh()
    path.write_bytes(b"")  # truncated below the offset
    assert log.unread() is None
