"""The C lane (mla_serve/sidecar/passthrough/_lane.c) against the Python path, read for read.

Each case runs the same upstream bytes twice through the code a chat request takes on the
sidecar's own front (exchange.Exchange with a fronts.TransportFront, on an
upstream.Connection, no sockets): once with the lane (the connection's `data_received` is a
`Lane`), once without it (the pool's lane off, every read in Python). The client's bytes
(head and body, dechunked), the completion (every choice's visibility and finish), the loop
guard (tokens, detector text, loop, stop), every metric the sidecar exports and the
response's end must be equal, and the lane must have done reads of its own where the stream
has token chunks. The streams: every stream vLLM 0.28.0, 0.29.0 and 0.33.0 sent on an H200
(the recordings), cut into reads four ways, and vLLM-shaped streams made here for what the
recordings lack: escapes, non-ASCII, whitespace, channel switches, tails the token match
must refuse, odd chunk framing, loops under `observe` and `stop`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

import hatch_build
from mla_serve.sidecar import settings as settings_
from mla_serve.sidecar.guard.loops import LoopGuard, ResponseGuard, TailDetector
from mla_serve.sidecar.passthrough import lane as lane_
from mla_serve.sidecar.passthrough import upstream
from mla_serve.sidecar.passthrough.exchange import admit
from mla_serve.sidecar.passthrough.fronts import TransportFront
from mla_serve.sidecar.passthrough.runaways import Ledger
from mla_serve.sidecar.passthrough.service import PassThrough
from mla_serve.sidecar.settings import Settings, SettingsError
from tests import loop_corpus
from tests.bench import bench_hot_path
from tests.bench.bench_hot_path import frame
from tests.bench.passthrough.replay import RECORDINGS
from tests.hostile.wire import dechunk

PATH = "/v1/chat/completions"
URL = "http://127.0.0.1:8000"
HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)


def test_the_lane_is_built() -> None:
    """`make test` builds it (MLA_SERVE_BUILD_LANE=require): the parity below must not pass
    by running the Python path twice."""
    assert lane_.BUILT, "the C lane (_lane.c) is not built: make test builds it"


def run(
    lane: bool,
    reads: list[bytes],
    action: str = "observe",
    gone_at: int | None = None,
    paused_at: int | None = None,
) -> dict[str, Any]:
    """One request and vLLM's `reads` through the fast path; what everyone could observe."""

    async def go() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        settings = Settings(vllm_url=URL, loop_action=action)
        registry = CollectorRegistry()
        ledger = Ledger(registry, "lane_")
        service = PassThrough(settings, ledger, LoopGuard(settings.loop_policy, registry),
                              registry)  # fmt: skip
        pool = service.pool = upstream.Pool(URL, settings.connect_timeout, lane_on=lane)
        conn = upstream.Connection(pool)
        conn.connection_made(bench_hot_path.VllmTransport())  # type: ignore[arg-type]
        assert (conn.lane is not None) is lane
        pool.idle.append((conn, loop.time()))
        body = json.dumps({
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 4000, "stream_options": {"include_usage": True},
        }).encode()  # fmt: skip
        protocol = bench_hot_path.Protocol(loop, len(body))
        front = TransportFront(protocol, keep_alive=True, http10=False)
        exchange = admit(service, front, b"POST", PATH, b"", protocol.headers, "10.0.0.7",
                                b"http", True)  # fmt: skip
        assert exchange is not None
        front.exchange = exchange
        protocol.fast = front
        exchange.begin(len(body))
        exchange.take_body(body)
        # The client goes away as its `gone_at`th write goes out; its buffer fills as its
        # `paused_at`th does (asyncio calls pause_writing inside write).
        transport, keep = protocol.transport, protocol.transport.write
        paused: list[int] = []  # the transport's writes when the client's buffer filled

        def write(data: bytes) -> None:
            keep(data)
            written = len(transport.out)
            if written == gone_at:
                front.client_gone()
            if written == paused_at:
                paused.append(written)
                protocol.flow.write_paused = True
                front.paused()

        transport.write = write  # type: ignore[method-assign]
        exchange.body_done()
        assert exchange.conn is conn, "the request went out on the pooled connection"
        taken = lane_.taken()
        for data in reads:
            if not conn.closed:
                conn.data_received(data)
        if not conn.closed:
            conn.connection_lost(None)
        taken = lane_.taken() - taken
        reader = exchange.reader
        assert reader is not None
        # what the client gets: the transport's bytes, then what waits for it to read
        wire = b"".join(protocol.transport.out) + b"".join(front.pending)
        head, _, rest = wire.partition(b"\r\n\r\n")
        return {
            "head": head,
            "body": dechunk(rest),
            "completed": protocol.completed,
            "phase": exchange.phase,
            "choices": {i: vars(c) for i, c in reader.completion.choices.items()},
            "guard": guard_state(reader.guard),
            "metrics": sorted(
                (s.name, tuple(sorted(s.labels.items())), s.value)
                for metric in registry.collect()
                for s in metric.samples
                if not s.name.endswith("_created")
            ),
            "taken": taken,
            "written_while_paused": len(protocol.transport.out) - paused[0] if paused else 0,
        }

    return asyncio.run(go())


def guard_state(guard: ResponseGuard | None) -> dict[str, Any] | None:
    if guard is None:
        return None
    watches = {
        index: (watch.tokens, watch.channel, watch.finished, repr(watch.loop),
                watch.detector.tail + "".join(watch.detector.pieces), watch.detector.fresh)
        for index, watch in guard.watches.items()
    }  # fmt: skip
    return {"looping": guard.looping, "stopped": guard.stopped, "watches": watches}


def same(
    reads: list[bytes],
    action: str = "observe",
    gone_at: int | None = None,
    paused_at: int | None = None,
) -> int:
    """Run both ways, assert they agree; the reads the lane did."""
    python = run(False, reads, action, gone_at, paused_at)
    lane = run(True, reads, action, gone_at, paused_at)
    taken = lane.pop("taken")
    assert python.pop("taken") == 0
    assert lane == python
    return int(taken)


def cuts(events: list[bytes], how: str) -> list[bytes]:
    """vLLM's response as reads: head alone then a chunk a read; the head with the first
    chunk; two chunks a read; or cut every 97 bytes, across size lines and events."""
    frames = [frame(event) for event in events] + [b"0\r\n\r\n"]
    if how == "each":
        return [HEAD, *frames]
    if how == "head-with-first":
        return [HEAD + frames[0], *frames[1:]]
    if how == "pairs":
        return [HEAD] + [b"".join(frames[i : i + 2]) for i in range(0, len(frames), 2)]
    data = HEAD + b"".join(frames)
    return [data[i : i + 97] for i in range(0, len(data), 97)]


RECORDED = bench_hot_path.load(RECORDINGS)


def test_the_recordings_are_there() -> None:
    assert len(RECORDED) >= 40  # three releases' streams, chat and completions


@pytest.mark.parametrize("how", ["each", "head-with-first", "pairs", "cut"])
def test_every_recorded_vllm_stream_the_same_either_way(how) -> None:
    taken = 0
    for stream in RECORDED:
        taken += same(cuts(stream["reads"], how))
    if how != "cut":  # cut reads split chunks: those go to Python, as they must
        assert taken > 900, f"the lane did only {taken} reads"


# -- streams made here, in vLLM 0.33.0's shape ---------------------------------------------
ID = "chatcmpl-0123456789abcdef"


def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
              "token_ids": None}  # fmt: skip
    chunk = {"id": ID, "object": "chat.completion.chunk", "created": 1796055444,
             "model": "tiny", "choices": [choice], **extra}  # fmt: skip
    return b"data: %s\n\n" % json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()


def vllm_stream(tokens: list[tuple[str, str]], finish: str = "length") -> list[bytes]:
    """The role chunk, one chunk per (channel, text), the finish, usage, [DONE]."""
    usage = {"prompt_tokens": 5, "total_tokens": 5 + len(tokens), "completion_tokens": len(tokens)}
    return [
        event({"role": "assistant", "content": ""}),
        *(event({channel: text}) for channel, text in tokens),
        event({}, finish),
        b"data: " + json.dumps({"id": ID, "object": "chat.completion.chunk",
                                "created": 1796055444, "model": "tiny", "choices": [],
                                "usage": usage}, separators=(",", ":")).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]  # fmt: skip


def thinking(n: int) -> list[tuple[str, str]]:
    return [("reasoning", f"step{i} ") for i in range(n)]


ODD_TEXTS = {
    "escapes": ["line\n", "tab\t", 'say "hi"', "back\\slash", "\x01ctl", "/"],
    "non-ascii": ["é", "日本語", "😀", "ß" * 40, "\u2028"],
    "whitespace": [" ", "\n\n", "\t", "", " \u3000 "],
    "late-answer": ["   ", "", "x"],
}


@pytest.mark.parametrize("name", sorted(ODD_TEXTS))
@pytest.mark.parametrize("how", ["each", "pairs"])
def test_odd_text_the_same_either_way(name, how) -> None:
    tokens = thinking(12) + [("content", text) for text in ODD_TEXTS[name] * 3]
    assert same(cuts(vllm_stream(tokens), how)) > 0


def test_channel_switches_the_same_either_way() -> None:
    tokens = []
    for i in range(30):
        tokens += [("reasoning", f"r{i} ")] + ([("content", f"c{i} ")] if i % 3 else [])
    assert same(cuts(vllm_stream(tokens), "each")) > 0


def raw_token(string: bytes, channel: bytes = b"content", tail: bytes | None = None) -> bytes:
    """A token chunk with the string's bytes as given (escapes, invalid UTF-8)."""
    head = event({"content": "@"}).split(b'content":"@"')[0]
    if tail is None:
        tail = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    return head + channel + b'":"' + string + tail


TAILS = {
    "no token_ids": b'"},"logprobs":null,"finish_reason":null}]}\n\n',
    "kv_transfer_params": (
        b'"},"logprobs":null,"finish_reason":null}],"kv_transfer_params":null}\n\n'
    ),
    "stop_reason": b'"},"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n',
    "no event end": b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n',
    "trailing bytes": b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\nx',
    "CRLF end": b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\r\n\r\n',
    "second event": b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    + event({"content": "more"}),
}
STRINGS = {
    "escaped unicode": rb"caf\u00e9",
    "surrogate pair": rb"\ud83d\ude00",
    "lone surrogate": rb"\ud800",
    "bad escape": rb"\x41",
    "short unicode escape": rb"\u00e",
    "invalid utf-8": b"\xff\xfe",
    "encoded surrogate": b"\xed\xa0\x80",
    "raw control": b"a\x1fb",
    "raw DEL": b"a\x7fb",
    "escaped quote at end": b'\\"',
    "only backslash": b"\\",
}


@pytest.mark.parametrize("name", sorted(TAILS))
def test_tails_the_match_refuses_or_takes_the_same_either_way(name) -> None:
    events = vllm_stream(thinking(10))
    events[5:5] = [raw_token(b"odd", tail=TAILS[name])] * 2
    for how in ("each", "pairs"):
        same(cuts(events, how))


@pytest.mark.parametrize("name", sorted(STRINGS))
def test_strings_the_same_either_way(name) -> None:
    events = vllm_stream(thinking(10))
    events[5:5] = [raw_token(STRINGS[name]), raw_token(STRINGS[name], b"reasoning")]
    for how in ("each", "pairs"):
        same(cuts(events, how))


FRAMINGS = {
    "uppercase size": lambda e: b"%X\r\n%b\r\n" % (len(e), e),
    "leading zero": lambda e: b"0%x\r\n%b\r\n" % (len(e), e),
    "extension": lambda e: b"%x;x=1\r\n%b\r\n" % (len(e), e),
    "two chunks for one event": lambda e: frame(e[:9]) + frame(e[9:]),
}


@pytest.mark.parametrize("name", sorted(FRAMINGS))
def test_chunk_framings_the_same_either_way(name) -> None:
    """Chunks the lane does not take (the Python path's parser does): nothing differs."""
    events = vllm_stream(thinking(20))
    reads = [HEAD] + [FRAMINGS[name](e) if 3 <= i < 9 else frame(e) for i, e in enumerate(events)]
    assert same([*reads, b"0\r\n\r\n"]) > 0


def loop_tokens(name: str) -> list[tuple[str, str]]:
    channel, text = loop_corpus.LOOPS[name]
    return [(channel, piece) for piece in loop_corpus.stream(text)]


@pytest.mark.parametrize("action", ["observe", "stop"])
@pytest.mark.parametrize("name", sorted(loop_corpus.LOOPS))
def test_loops_caught_at_the_same_token_either_way(name, action) -> None:
    """The guard checks every 32 characters (through the lane's checkpoint when the lane
    took the text); a stop ends the stream at the same token with the same ending, whatever
    the lane took before it."""
    tokens = loop_tokens(name)
    for how in ("each", "pairs"):
        reads = cuts(vllm_stream(tokens), how)
        assert same(reads, action) > 0
        result = run(True, reads, action)
        assert result["guard"]["looping"] == 1
        assert result["guard"]["stopped"] is (action == "stop")


@pytest.mark.parametrize("name", sorted(loop_corpus.LEGIT))
def test_legitimate_repetition_the_same_either_way(name) -> None:
    channel, text = loop_corpus.LEGIT[name]
    tokens = [(channel, piece) for piece in loop_corpus.stream(text)][:600]
    reads = cuts(vllm_stream(tokens), "each")
    assert same(reads, "stop") > 0
    assert run(True, reads, "stop")["guard"]["looping"] == 0


def test_the_lane_stops_at_a_paused_client(monkeypatch) -> None:
    """Bytes waiting for the client (its transport paused): the lane leaves the reads to the
    Python path, which queues them in order."""
    monkeypatch.setattr(bench_hot_path.Flow, "write_paused", True)
    reads = cuts(vllm_stream(thinking(30)), "each")
    assert same(reads) == 0


@pytest.mark.parametrize("gone_at", [3, 10])
def test_a_client_gone_during_a_write_the_same_either_way(gone_at) -> None:
    """The client's transport ends the exchange inside a write the lane makes (vLLM's
    connection dropped, the lane disarmed under it): the read finishes on what it holds, and
    both ways leave the same state."""
    tokens = thinking(30)
    taken = same(cuts(vllm_stream(tokens), "each"), gone_at=gone_at)
    assert taken == lane_writes(gone_at)
    assert 0 < taken < gone_at


@pytest.mark.parametrize("paused_at", range(3, 21))  # before its last read
def test_a_client_paused_inside_a_read_the_same_either_way(paused_at) -> None:
    """Two token chunks a read, the guard's check falling between them: the lane writes the
    read in two pieces around its checkpoint, and the client's buffer fills on the first (the
    lane disarmed under it): the rest of the read waits in order behind it, as through the
    Python path, and the guard counts and checks the same."""
    reads = cuts(vllm_stream(thinking(40)), "pairs")
    assert same(reads, paused_at=paused_at) > 0


def test_a_guard_that_fails_ends_the_stream_the_same_either_way(monkeypatch, caplog) -> None:
    """A bug in the guard's check (raised at its third look) ends that response with an error
    event after the token it looked at, the same through the lane's checkpoint as through
    the Python path, and the connection's loop goes on (nothing raised out of it)."""
    original = TailDetector.check
    looks: list[int] = []

    def failing(self: TailDetector) -> tuple[int, int] | None:
        looks.append(1)
        if len(looks) == 3:
            raise RuntimeError("the detector failed")
        return original(self)

    monkeypatch.setattr(TailDetector, "check", failing)
    reads = cuts(vllm_stream(thinking(400)), "each")
    python = run(False, reads)
    looks.clear()
    lane = run(True, reads)
    assert lane.pop("taken") > 0 and python.pop("taken") == 0
    assert lane == python
    failed = b"the sidecar failed on vLLM's response: RuntimeError: the detector failed"
    assert failed in lane["body"]
    assert caplog.text.count("classifying a response failed") == 2


def test_the_lane_keeps_texts_only_with_a_checkpoint() -> None:
    """A watched channel's texts are handed over at the guard's checks: arming with one and
    no checkpoint (or a checkpoint and no channel) is refused, and the lane stays unarmed."""
    lane = lane_.Lane(lambda data: None)
    keys = ((b'"reasoning":"', "reasoning", False),)

    def clock() -> float:
        return 0.0

    def write(data: bytes) -> None:
        return None

    def check() -> int:
        return 32

    with pytest.raises(TypeError, match="a watched channel needs a check"):
        lane.arm(b"data: {", keys, b"}\n\n", "reasoning", 32, write, clock)
    with pytest.raises(TypeError, match="a watched channel needs a check"):
        lane.arm(b"data: {", keys, b"}\n\n", None, 32, write, clock, check)
    assert not lane.armed
    lane.arm(b"data: {", keys, b"}\n\n", "reasoning", 32, write, clock, check)
    assert lane.armed


def lane_writes(writes: int) -> int:
    """How many of a stream's first `writes` client writes the lane makes, one token chunk a
    read: write 1 is the role chunk (with the head) and write 2 the first token chunk (its
    shape learnt), both Python's; the lane takes every token after them, also one that makes
    the guard's detector look (its checkpoint runs the check, as the Python path would)."""
    return max(writes - 2, 0)


def test_frames() -> None:
    """What the Python path's arming relies on: whole canonical chunks, exactly."""
    lane = lane_
    assert lane.BUILT
    assert lane.frames(b"5\r\nhello\r\n") == [5]
    assert lane.frames(b"a\r\n0123456789\r\n2\r\nab\r\n") == [10, 2]
    for data in (b"5\r\nhello\r\nx", b"5\r\nhell\r\n", b"05\r\nhello\r\n",
                 b"A\r\n0123456789\r\n", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n",
                 b"5;x\r\nhello\r\n", b"5\r\nhello", b"", b"\r\n",
                 b"ffffffffffffffff\r\nx\r\n"):  # fmt: skip
        assert lane.frames(data) is None, data


# -- the sidecar as it runs, on real sockets ------------------------------------------------
def chat(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="glm-5.3-flash", messages=[{"role": "user", "content": "hi"}], stream=True,
        max_tokens=200,
    )  # fmt: skip
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("lane", ["auto", "off"])
def test_the_sidecar_reads_token_chunks_in_c_unless_told_not_to(vllm, sidecar, lane) -> None:
    """`mla-serve sidecar` on its own protocol in front of the stand-in (tokens paced, so each
    is a read of its own): the official openai client gets the answer either way; /status
    says whether the lane is on and counts the reads it did."""
    vllm.behaviour.token_delay = 0.002
    vllm.behaviour.answer_tokens = 60
    url = sidecar(lane=lane)
    before = httpx.get(f"{url}/status").json()["pass_through"]
    assert before["lane"] is (lane == "auto")
    assert chat(url) == "".join(f"word{i} " for i in range(60))
    after = httpx.get(f"{url}/status").json()["pass_through"]
    if lane == "auto":  # all but the first token and the last events (reads may coalesce)
        assert after["lane_reads"] - before["lane_reads"] >= 40
    else:
        assert after["lane_reads"] == 0


def settings_from(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    settings_.add_arguments(parser)
    return settings_.from_arguments(parser.parse_args(["--vllm-url", URL, *argv]), environ or {})


def test_the_lane_setting_is_checked(monkeypatch) -> None:
    with pytest.raises(SettingsError, match="--lane must be one of auto, on, off, got 'yes'"):
        settings_from(["--lane", "yes"])
    with pytest.raises(SettingsError, match="--lane must be one of auto, on, off, got '0'"):
        settings_from([], {"MLA_SERVE_LANE": "0"})
    assert settings_from(["--lane", "on"]).lane_on
    assert settings_from([]).lane_on
    assert not settings_from([], {"MLA_SERVE_LANE": "off"}).lane_on
    monkeypatch.setattr(lane_, "BUILT", False)  # an install without a C compiler
    assert not settings_from([]).lane_on
    with pytest.raises(SettingsError, match=r"--lane on: the C lane .* is not built"):
        settings_from(["--lane", "on"])


# -- the build ------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def test_the_lane_compiles_without_a_warning(tmp_path: Path) -> None:
    hatch_build.compile_lane(ROOT, tmp_path / "_lane.abi3.so", ("-Wextra", "-Werror"))


@pytest.mark.parametrize("mode", ["require", "off"])
def test_the_wheel_carries_the_lane_unless_told_not_to(tmp_path: Path, mode: str) -> None:
    """`pip wheel .` (the image's build, `make e2e-pack`'s): with the lane, a wheel for this
    platform on CPython's stable ABI; with MLA_SERVE_BUILD_LANE=off, a pure-Python one."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True, env={**os.environ, "MLA_SERVE_BUILD_LANE": mode},
    )  # fmt: skip
    (wheel,) = tmp_path.glob("mla_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if mode == "require":
        assert wheel.name.endswith(f"-cp311-abi3-{platform}.whl")
        assert "mla_serve/sidecar/passthrough/_lane.abi3.so" in names
    else:
        assert wheel.name.endswith("-py3-none-any.whl")
        assert not [name for name in names if name.endswith(".so")]
    assert "mla_serve/sidecar/passthrough/_lane.pyi" in names
