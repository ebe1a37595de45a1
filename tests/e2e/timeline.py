"""Where a request's first token spends its time: the live benchmark's per-request timeline,
from the socket reads and writes every process made (tests/e2e/socktrace.c, preloaded into
the clients, the proxies and vLLM's API server by `bench.py --socket-trace`).

    python -m tests.e2e.timeline TRACE_DIR socket-timeline.json   # a traced run's table again

Each request carries its id in its body (`user`, `mlasrid` and 32 hex digits; every proxy
passes a body as it came), so its exchange is found on every connection it crossed: the
client's to the path, the proxy's from the client and to vLLM, vLLM's. On each side of each
connection the response's bytes are read back from what was captured (the first 2 KiB of
every read and write) as HTTP/1.1: the head's end, the role chunk's end and the first token
chunk's end (the first server-sent event whose delta carries content or reasoning, as the
client counts a token). The time of each mark on a side is that of the read or write that
moved its last byte. The parts of the time to first token, which add up to it:

- `client_send`: the client's call to its write of the request's last byte (the openai
  client's work: it may write the head and the body apart, with other streams' work between);
- `to_proxy`, `proxy_request`, `to_vllm`: the request's last byte on its way in (loopback and
  the receiver's wake-up, the proxy's handling until its write of it to vLLM, loopback and
  vLLM's wake-up; direct: `to_vllm` only);
- `vllm`: vLLM's read of the request's last byte to its write of the first token chunk;
- `to_proxy_back`, `proxy_response`, `to_client`: the token's way out (vLLM's write to the
  proxy's read, the proxy's read to its write, its write to the client's read);
- `client_parse`: the client's read to its openai stream yielding the chunk.

Also: each process's wake-up (its last epoll return on the reading thread) before the read
of the token, the connections opened per request, TCP_NODELAY on every side, and how vLLM
split its writes (head, role chunk, token chunk: one write each, or fewer), and how many
requests had the role chunk and the first token in one read or write on each side (vLLM's
write, the proxy's read of vLLM and its write to the client, the client's read): a proxy
that held the role chunk back until the token came would show here, and so would a client
that reads both at once (its parse of the role chunk then counts in `client_parse`).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("socktrace.c")
RECORD = struct.Struct("<QiiiiHHBBH")
HEADER = 64
RID = re.compile(rb"mlasrid[0-9a-f]{32}")
REQUEST_LINE = re.compile(rb"(GET|POST|HEAD|PUT|DELETE|OPTIONS|PATCH) /")
MARKS = ("head", "role", "token")
PARTS = ("client_send", "to_proxy", "proxy_request", "to_vllm", "vllm", "to_proxy_back",
         "proxy_response", "to_client", "client_parse")  # fmt: skip


def build(out: Path) -> Path:
    """socktrace.c compiled into `out` with the compiler CPython was built with, or the
    machine's `cc` or `gcc` where that one is not installed (a conda Python names its own)."""
    named = shlex.split(sysconfig.get_config_var("CC") or "cc")
    choices = [named, ["cc"], ["gcc"]]
    compiler = next((c for c in choices if shutil.which(c[0])), named)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [*compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-ldl"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        why = f"cannot compile {SOURCE.name} ({shlex.join(command)}): {detail}"
        raise RuntimeError(why) from None
    return out


def preload(library: Path, trace_dir: Path) -> dict[str, str]:
    """The environment that traces a process started with it (and its children)."""
    return {
        "SOCKTRACE_DIR": str(trace_dir),
        "LD_PRELOAD": " ".join(filter(None, (str(library), os.environ.get("LD_PRELOAD")))),
    }


@dataclass
class Event:
    t: float  # seconds, CLOCK_MONOTONIC
    pid: int
    tid: int
    fd: int
    ret: int
    lport: int
    pport: int
    op: str
    nodelay: int
    data: bytes


def load(trace_dir: Path) -> tuple[list[Event], dict[str, int]]:
    """Every record of every process's file, in time order; and the records each dropped."""
    events: list[Event] = []
    dropped: dict[str, int] = {}
    for path in sorted(trace_dir.glob("trace-*.bin")):
        with path.open("rb") as handle:
            head = handle.read(HEADER)
            if len(head) < 24 or head[:8] != b"SOCKTRC1":
                continue
            used, lost = struct.unpack_from("<QQ", head, 8)
            body = handle.read(used - HEADER)
        dropped[path.name] = lost
        at = 0
        while at + RECORD.size <= len(body):
            t, pid, tid, fd, ret, lport, pport, op, nodelay, captured = RECORD.unpack_from(body, at)
            if t == 0:  # a record reserved but not written yet (the process was killed)
                break
            start = at + RECORD.size
            data = body[start : start + captured]
            at = start + ((captured + 7) & ~7)
            events.append(Event(t / 1e9, pid, tid, fd, ret, lport, pport, chr(op), nodelay, data))
    events.sort(key=lambda e: e.t)
    return events, dropped


@dataclass
class Side:
    """One end of one TCP connection in one process."""

    pid: int
    lport: int
    pport: int
    client: bool  # the connecting end (its peer port is a server's)
    nodelay: int = 0
    sent: list[Event] = field(default_factory=list)
    received: list[Event] = field(default_factory=list)
    connected: float | None = None  # its connect() or accept()


@dataclass
class Exchange:
    """One request and its response on one side."""

    side: Side
    rid: str | None
    request: list[Event]
    response: list[Event]

    @property
    def began(self) -> float:
        return self.request[0].t

    @property
    def sent(self) -> float:
        """When the request's last byte moved on this side (a client may write its head and
        body apart, and a proxy pass the head on before the body is in)."""
        return self.request[-1].t


def sides(events: list[Event], servers: set[int]) -> dict[tuple[int, int, int], Side]:
    out: dict[tuple[int, int, int], Side] = {}
    for event in events:
        if event.op not in "RWCA" or not event.lport:
            continue
        key = (event.pid, event.lport, event.pport)
        side = out.get(key)
        if side is None:
            side = out[key] = Side(event.pid, event.lport, event.pport, event.pport in servers,
                                   event.nodelay)  # fmt: skip
        if event.op in "CA":
            side.connected = event.t
        elif event.op == "W":
            side.sent.append(event)
        elif event.ret > 0:
            side.received.append(event)
        if event.op in "RW":
            side.nodelay = event.nodelay
    return out


def exchanges(side: Side) -> list[Exchange]:
    """The side's exchanges: each starts at a request line in the request direction (the
    client's writes, the server's reads); the other direction's events up to the next one's
    start are its response (one request at a time on a connection: a closed-loop client, a
    proxy's pooled connection)."""
    asks, answers = (side.sent, side.received) if side.client else (side.received, side.sent)
    answer_times = [e.t for e in answers]  # in time order, as `sides` gave them
    starts = [i for i, e in enumerate(asks) if REQUEST_LINE.match(e.data)]
    out = []
    for n, first in enumerate(starts):
        last = starts[n + 1] if n + 1 < len(starts) else len(asks)
        request = asks[first:last]
        until = asks[last].t if last < len(asks) else float("inf")
        low = bisect.bisect_left(answer_times, request[0].t)
        response = answers[low : bisect.bisect_left(answer_times, until, low)]
        found = RID.search(b"".join(e.data for e in request)[:16384])
        out.append(Exchange(side, found.group().decode() if found else None, request, response))
    return out


def _dechunk(body: bytes) -> tuple[bytes, list[int]] | None:
    """Chunked coding's payloads joined, and for each payload byte its offset in `body` (as far
    as the captured bytes go); None where a size line is not hex."""
    payload, where, at = bytearray(), list[int](), 0
    while at < len(body):
        end = body.find(b"\r\n", at)
        if end < 0:
            break
        try:
            size = int(body[at:end].split(b";")[0], 16)
        except ValueError:
            return None
        if size == 0:
            break
        start = end + 2
        piece = body[start : start + size]
        payload += piece
        where.extend(range(start, start + len(piece)))
        at = start + size + 2
    return bytes(payload), where


def marks(stream: bytes) -> dict[str, int]:
    """The byte offsets, in a response as it crossed one connection, just past the head, the
    role chunk and the first token chunk (those the captured bytes reach)."""
    out: dict[str, int] = {}
    end = stream.find(b"\r\n\r\n")
    if end < 0:
        return out
    out["head"] = end + 4
    head = stream[:end].lower()
    body = stream[end + 4 :]
    if b"transfer-encoding: chunked" in head:
        read = _dechunk(body)
        if read is None:
            return out
        payload, where = read
    else:
        payload, where = body, list(range(len(body)))
    at = 0
    while True:
        stop = payload.find(b"\n\n", at)
        if stop < 0:
            return out
        event = payload[at:stop]
        at = stop + 2
        if not event.startswith(b"data: {"):
            continue
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            continue
        offset = end + 4 + where[stop + 1] + 1  # just past the event's last byte
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if "role" in delta and "role" not in out:
                out["role"] = offset
            if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                out.setdefault("role", offset)
                out["token"] = offset
                return out


def mark_times(events: list[Event]) -> dict[str, float]:
    """When each mark's last byte moved on this side: the event covering its offset."""
    stream = bytearray()
    for event in events:
        stream += event.data
        if len(event.data) < event.ret:  # the capture stops here: later offsets are unknown
            break
    offsets = marks(bytes(stream))
    out, moved, index = {}, 0, 0
    for name in MARKS:
        if name not in offsets:
            continue
        while index < len(events) and moved + events[index].ret < offsets[name]:
            moved += events[index].ret
            index += 1
        if index < len(events):
            out[name] = events[index].t
    return out


def woke(epolls: dict[int, list[float]], event: Event) -> float | None:
    """The last epoll return of `event`'s thread before it (the loop's wake-up)."""
    times = epolls.get(event.tid, [])
    at = bisect.bisect_right(times, event.t)
    return times[at - 1] if at else None


def find(found: list[Exchange], client: bool, lport: int | None = None,
         pport: int | None = None) -> Exchange | None:  # fmt: skip
    """The exchange of `found` (one request's, on every side) on a side of that kind."""
    for exchange in found:
        side = exchange.side
        if side.client == client and lport in (None, side.lport) and pport in (None, side.pport):
            return exchange
    return None


def analyse(
    trace_dir: Path, ports: dict[str, int], records: list[dict[str, Any]]
) -> dict[str, Any]:
    """The timeline of every traced request. `ports`: each path's server port (`direct` is
    vLLM's); `records`: the client's {rid, path, concurrency, t0, t_token} of each."""
    events, dropped = load(trace_dir)
    vllm_port = ports["direct"]
    all_sides = sides(events, set(ports.values()))
    by_rid: dict[str, list[Exchange]] = defaultdict(list)
    for side in all_sides.values():
        for exchange in exchanges(side):
            if exchange.rid:
                by_rid[exchange.rid].append(exchange)
    epolls: dict[int, list[float]] = defaultdict(list)  # per thread, in time order
    for event in events:
        if event.op == "E":
            epolls[event.tid].append(event.t)
    rows, unmatched = [], []
    connects: dict[tuple[str, int], int] = defaultdict(int)
    for record in records:
        path, rid = record["path"], record["rid"]
        port = ports[path]
        found = by_rid.get(rid, [])

        client = find(found, True, pport=port)
        vllm = find(found, False, lport=vllm_port)
        if client is None or vllm is None:
            unmatched.append(rid)
            continue
        row: dict[str, Any] = {"rid": rid, "path": path, "concurrency": record["concurrency"]}
        c, v = mark_times(client.response), mark_times(vllm.response)
        times = {"t0": record["t0"], "c_req": client.sent, "v_req": vllm.sent,
                 "t_token": record["t_token"]}  # fmt: skip
        times |= {f"v_{k}": t for k, t in v.items()} | {f"c_{k}": t for k, t in c.items()}
        v_writes = [e for e in vllm.response if e.t <= v.get("token", float("-inf"))]
        row["vllm_writes_to_token"] = len(v_writes)
        row["nodelay"] = {"client": client.side.nodelay, "vllm": vllm.side.nodelay}
        if path != "direct":
            inbound = find(found, False, lport=port, pport=client.side.lport)
            upstream = find(found, True, pport=vllm_port)
            if inbound is None or upstream is None or upstream.side.pid != inbound.side.pid:
                unmatched.append(rid)
                continue
            p_out, p_up = mark_times(inbound.response), mark_times(upstream.response)
            times |= {"p_in_req": inbound.sent, "p_up_req": upstream.sent}
            times |= {f"p_out_{k}": t for k, t in p_out.items()}
            times |= {f"p_up_{k}": t for k, t in p_up.items()}
            row["nodelay"] |= {"proxy_in": inbound.side.nodelay, "proxy_up": upstream.side.nodelay}
            connected = upstream.side.connected
            fresh = connected is not None and inbound.began <= connected <= upstream.began
            row["new_upstream_connection"] = fresh  # opened for this request
            connects[(path, record["concurrency"])] += fresh
            token_read = next((e for e in upstream.response if e.t == times.get("p_up_token")),
                              None)  # fmt: skip
            if token_read is not None:
                wake = woke(epolls, token_read)
                if wake is not None:
                    row["proxy_woke_to_read_us"] = round((token_read.t - wake) * 1e6, 1)
            row["proxy_token_in_role_read"] = times.get("p_up_token") == times.get("p_up_role")
            row["proxy_token_in_role_write"] = times.get("p_out_token") == times.get("p_out_role")
        row["vllm_token_in_role_write"] = times.get("v_token") == times.get("v_role")
        row["client_token_in_role_read"] = times.get("c_token") == times.get("c_role")
        need = ["c_req", "v_req", "v_token", "c_token", "t_token"]
        if path != "direct":
            need += ["p_in_req", "p_up_req", "p_up_token", "p_out_token"]
        missing = [k for k in need if times.get(k) is None]
        if missing:
            row["missing"] = missing
            rows.append(row)
            continue
        row["parts_ms"] = parts(times, path != "direct")
        row["ttft_ms"] = round((times["t_token"] - times["t0"]) * 1e3, 3)
        rows.append(row)
    return {
        "requests": len(records),
        "matched": len(rows),
        "unmatched": len(unmatched),
        "incomplete": sum("missing" in row for row in rows),  # a mark not found on a side
        "events": len(events),
        "dropped": dropped,
        "upstream_connects": {f"{p}@{c}": n for (p, c), n in sorted(connects.items()) if n},
        "summary": summarize(rows),
        "rows": rows,
    }


def parts(times: dict[str, float], proxied: bool) -> dict[str, float]:
    def span(a: str, b: str) -> float:
        return round((times[b] - times[a]) * 1e3, 4)

    out = {"client_send": span("t0", "c_req")}
    if proxied:
        out |= {"to_proxy": span("c_req", "p_in_req"),
                "proxy_request": span("p_in_req", "p_up_req"),
                "to_vllm": span("p_up_req", "v_req"), "vllm": span("v_req", "v_token"),
                "to_proxy_back": span("v_token", "p_up_token"),
                "proxy_response": span("p_up_token", "p_out_token"),
                "to_client": span("p_out_token", "c_token")}  # fmt: skip
    else:
        out |= {"to_proxy": 0.0, "proxy_request": 0.0, "to_vllm": span("c_req", "v_req"),
                "vllm": span("v_req", "v_token"), "to_proxy_back": 0.0, "proxy_response": 0.0,
                "to_client": span("v_token", "c_token")}  # fmt: skip
    out["client_parse"] = span("c_token", "t_token")
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency and path: the median of each part and of the time to first token,
    and each part's median against direct's at the same concurrency (its share of the
    added time)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if "parts_ms" in row:
            groups[(row["concurrency"], row["path"])].append(row)
    out: dict[str, Any] = {}
    for (level, path), members in sorted(groups.items()):
        median = {k: round(statistics.median(r["parts_ms"][k] for r in members), 4) for k in PARTS}
        entry: dict[str, Any] = {
            "requests": len(members),
            "ttft_ms": round(statistics.median(r["ttft_ms"] for r in members), 4),
            "parts_ms": median,
            "vllm_writes_to_token": statistics.median(r["vllm_writes_to_token"] for r in members),
            "vllm_token_in_role_write": sum(r["vllm_token_in_role_write"] for r in members),
            "client_token_in_role_read": sum(r["client_token_in_role_read"] for r in members),
        }
        woke_us = [r["proxy_woke_to_read_us"] for r in members if "proxy_woke_to_read_us" in r]
        if woke_us:
            entry["proxy_woke_to_read_us_p50"] = round(statistics.median(woke_us), 1)
        if path != "direct":
            entry["new_upstream_connections"] = sum(r["new_upstream_connection"] for r in members)
            entry["proxy_token_in_role_read"] = sum(r["proxy_token_in_role_read"] for r in members)
            entry["proxy_token_in_role_write"] = sum(
                r["proxy_token_in_role_write"] for r in members
            )
        off = {k for r in members for k, v in r["nodelay"].items() if not v}
        entry["nodelay_off"] = sorted(off)  # the sides without TCP_NODELAY
        out.setdefault(str(level), {})[path] = entry
    for paths in out.values():
        direct = paths.get("direct")
        if direct is None:
            continue
        for path, entry in paths.items():
            if path == "direct":
                continue
            entry["added_ms"] = {
                "ttft": round(entry["ttft_ms"] - direct["ttft_ms"], 4),
                **{k: round(entry["parts_ms"][k] - direct["parts_ms"][k], 4) for k in PARTS},
            }
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown of a traced run's summary."""
    lines = [
        f"Traced requests: {result['matched']} of {result['requests']} found on every "
        f"connection ({result['events']} socket events).",
        "",
        "| streams | path | requests | TTFT p50 ms | " + " | ".join(PARTS) + " |",
        "|---|---|---|---|" + "---|" * len(PARTS),
    ]
    for level, paths in result["summary"].items():
        for path, entry in paths.items():
            cells = [f"{entry['parts_ms'][k]:.3f}" for k in PARTS]
            lines.append(f"| {level} | {path} | {entry['requests']} | {entry['ttft_ms']:.3f} | "
                         + " | ".join(cells) + " |")  # fmt: skip
            if "added_ms" in entry:
                added = entry["added_ms"]
                lines.append(f"| {level} | {path} - direct | | {added['ttft']:+.3f} | "
                             + " | ".join(f"{added[k]:+.3f}" for k in PARTS) + " |")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="a traced live-bench run's timeline table")
    parser.add_argument("trace_dir", type=Path, help="the run's --socket-trace DIR")
    parser.add_argument("document", type=Path, help="the run's socket-timeline.json")
    args = parser.parse_args(argv)
    trace_dir, document = args.trace_dir, args.document
    if not any(trace_dir.glob("trace-*.bin")):
        print(f"timeline: no trace-*.bin in {trace_dir}", file=sys.stderr)
        return 1
    try:
        spec = json.loads(document.read_text())
        ports, records = spec["ports"], spec["records"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"timeline: {document} is not a run's socket-timeline.json ({error})",
              file=sys.stderr)  # fmt: skip
        return 1
    result = analyse(trace_dir, ports, records)
    sys.stdout.write(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
