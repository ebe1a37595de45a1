"""The live benchmark's per-request timeline (`bench.py --socket-trace`: tests/e2e/socktrace.c
preloaded into every process, tests/e2e/timeline.py reading what it wrote), end to end on the
CPU: the run's own requests answered with the bytes vLLM 0.33.0 sent for them on an H200
(passthrough/replay.py, a stand-in process that says it is one), through the real sidecar
and Envoy's real binary, with the official openai client."""

from __future__ import annotations

import itertools
import json
import subprocess
from typing import Any

import pytest

from tests.e2e import timeline
from tests.test_e2e_bench import BENCH, ROOT, envoy_binary, replayed


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("traced")
    library = timeline.build(tmp / "socktrace.so")
    trace = tmp / "trace"
    trace.mkdir()
    envoy = envoy_binary(tmp)
    with replayed(timeline.preload(library, trace)) as (url, pid):
        argv = [
            *BENCH, "--upstream-url", url, "--upstream-pid", str(pid),
            "--bodies", "live", "--model", "tiny-deepseek-v3.2",
            "--results", str(tmp / "results"), "--work", str(tmp / "work"),
            "--levels", "1,4", "--rounds", "1=2,4=1", "--requests", "1=4,4=8",
            "--budget-s", "120", "--socket-trace", str(trace),
        ]  # fmt: skip
        argv += ["--envoy", str(envoy)] if envoy else ["--no-envoy"]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=150, check=False, cwd=ROOT
        )
    results = tmp / "results"
    return {
        "rc": done.returncode,
        "output": done.stdout + done.stderr,
        "bench": json.loads((results / "bench.json").read_text()),
        "timeline": json.loads((results / "socket-timeline.json").read_text()),
        "md": (results / "socket-timeline.md").read_text(),
        "envoy": envoy is not None,
        "trace": trace,
    }


def test_every_traced_request_is_found_on_every_connection_it_crossed(traced):
    assert traced["rc"] == 0, traced["output"][-3000:]
    assert "SOCKET-TRACED" in traced["bench"]["what"]
    found = traced["timeline"]
    paths = ["direct", "sidecar", *(["envoy"] if traced["envoy"] else [])]
    # every 4th request thinks to the cap: no token chunk, so no first token to trace
    expected = len(paths) * (2 * 3 + 6)
    assert len(found["records"]) == found["requests"] == expected
    assert found["matched"] == expected and found["unmatched"] == found["incomplete"] == 0
    assert not any(found["dropped"].values())
    # the replay's, the clients', the sidecar's and Envoy's processes each wrote a trace
    assert len(list(traced["trace"].glob("trace-*.bin"))) >= len(paths) + 1
    for level in ("1", "4"):
        assert sorted(found["summary"][level]) == sorted(paths)


def test_the_parts_are_in_causal_order_and_add_up_to_the_ttft(traced):
    """A byte's write is timed at its call, its read at its return: every part is >= 0 when
    the marks were found on the right events of the right connections."""
    rows = traced["timeline"]["rows"]
    assert rows and all("missing" not in row for row in rows), rows[:3]
    for row in rows:
        parts = row["parts_ms"]
        assert all(value >= 0 for value in parts.values()), row
        assert abs(sum(parts.values()) - row["ttft_ms"]) < 0.01, row
        if row["path"] == "direct":
            proxied = ("to_proxy", "proxy_request", "to_proxy_back", "proxy_response")
            assert all(parts[k] == 0 for k in proxied), row
            assert "proxy_token_in_role_write" not in row, row
        else:
            assert parts["proxy_request"] > 0 and parts["proxy_response"] > 0, row
            assert isinstance(row["proxy_token_in_role_write"], bool), row
        assert isinstance(row["client_token_in_role_read"], bool), row
    # vLLM's recorded stream: head, role chunk and first token chunk, each its own write
    summary = traced["timeline"]["summary"]
    assert summary["1"]["direct"]["vllm_writes_to_token"] >= 2
    sidecar = summary["1"]["sidecar"]
    members = [r for r in rows if r["path"] == "sidecar" and r["concurrency"] == 1]
    for key in ("client_token_in_role_read", "proxy_token_in_role_write"):
        assert sidecar[key] == sum(r[key] for r in members)
    assert set(sidecar["added_ms"]) == {"ttft", *timeline.PARTS}
    assert sidecar["proxy_woke_to_read_us_p50"] >= 0
    assert "| 1 | sidecar - direct |" in traced["md"]


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_the_marks_are_the_ends_of_head_role_and_first_token():
    stream = HEAD + _chunk(ROLE) + _chunk(TOKEN) + _chunk(TOKEN)
    role_end = len(HEAD) + len(_chunk(ROLE)) - 2  # the event's last byte, before the CRLF
    token_end = len(HEAD) + len(_chunk(ROLE)) + len(_chunk(TOKEN)) - 2
    assert timeline.marks(stream) == {"head": len(HEAD), "role": role_end, "token": token_end}
    # an event split over two chunks (a proxy may frame it so): its end is in the second
    split = HEAD + _chunk(ROLE) + _chunk(TOKEN[:10]) + _chunk(TOKEN[10:])
    assert timeline.marks(split)["token"] == len(split) - 2


def test_each_mark_is_timed_by_the_event_that_moved_its_last_byte():
    stream = HEAD + _chunk(ROLE) + _chunk(TOKEN)
    cut = [0, 40, len(HEAD) + 5, len(HEAD) + len(_chunk(ROLE)), len(stream)]
    events = [
        timeline.Event(float(i), 1, 1, 3, b - a, 1, 2, "R", 1, stream[a:b])
        for i, (a, b) in enumerate(itertools.pairwise(cut))
    ]
    # the head ends in the second read, the role chunk in the third, the token in the last
    assert timeline.mark_times(events) == {"head": 1.0, "role": 2.0, "token": 3.0}
    # a capture cut short: the marks past it are not guessed
    events[1] = timeline.Event(1.0, 1, 1, 3, events[1].ret, 1, 2, "R", 1, events[1].data[:10])
    assert timeline.mark_times(events) == {}
