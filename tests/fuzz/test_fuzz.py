"""The fuzz targets (targets.py) in `make test`: a bounded run of each over its kept corpus
(every input of it first, then new ones for FUZZ_TEST_SECONDS, 3 by default), the fuzzing
build of the C lane loaded the way `make fuzz` loads it, and each oracle seen to catch what
it is there to catch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hatch_build

pytest.importorskip("atheris", reason="atheris has wheels for Linux on x86-64 only")

from tests.fuzz import targets

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
SECONDS = float(os.environ.get("FUZZ_TEST_SECONDS", "3"))


def _fuzz(target: str, tmp_path: Path, *flags: str, lane: Path | None = None):
    env = {**os.environ, "FUZZ_TARGET": target}
    if lane is not None:
        env["FUZZ_LANE"] = str(lane)
    new = tmp_path / "new"
    new.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "tests.fuzz.run", "-timeout=30",
               f"-artifact_prefix={tmp_path}/", *flags, str(new), str(CORPUS / target)]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=SECONDS + 300)  # fmt: skip


@pytest.mark.parametrize("target", sorted(targets.TARGETS))
def test_a_bounded_fuzz_run_finds_nothing(target, tmp_path):
    kept = list((CORPUS / target).iterdir())
    assert kept, f"no corpus for {target}"
    done = _fuzz(target, tmp_path, f"-max_total_time={SECONDS:g}")
    crashes = [path.name for path in tmp_path.glob("crash-*")]
    assert done.returncode == 0 and not crashes, done.stderr[-4000:]
    assert "INITED" in done.stderr and "DONE" in done.stderr, done.stderr[-2000:]


def test_the_fuzzing_build_of_the_lane_is_the_one_fuzzed(tmp_path):
    """make fuzz's lane (GCC's comparison hooks, libFuzzer's underneath) loads and is run."""
    lane = tmp_path / "_lane-cmp.abi3.so"
    stubs = ROOT / "tests" / "fuzz" / "coverage_stubs.c"
    hatch_build.compile_lane(ROOT, lane, ("-fsanitize-coverage=trace-cmp", str(stubs)))
    done = _fuzz("frames", tmp_path, "-runs=3000", "-use_value_profile=1", lane=lane)
    assert done.returncode == 0, done.stderr[-4000:]


def test_frames_catches_sizes_httptools_does_not_give(monkeypatch):
    monkeypatch.setattr(targets._lane, "frames", lambda data: [3])
    with pytest.raises(targets.Diverged):
        targets.frames(b"4\r\nabcd\r\n")
    with pytest.raises(targets.Diverged):
        targets.frames(b"3\r\nabc\r")  # the read ends inside a chunk's CRLF


def test_protocol_catches_a_request_passed_on_that_h11_reads_otherwise(monkeypatch):
    data = b"POST /v1/responses HTTP/1.1\r\nHost: s\r\nContent-Length: 3\r\n\r\nabc"
    monkeypatch.setattr(targets, "_received", [(b"POST", b"/v1/responses", b"ab")])
    with pytest.raises(targets.Diverged):
        targets._check_protocol(data, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    monkeypatch.setattr(targets, "_received", [(b"POST", b"/v1/responses", b"abc")] * 2)
    with pytest.raises(targets.Diverged):  # a second request where h11 read one
        targets._check_protocol(data, b"")


def test_protocol_holds_the_host_rule_too():
    for kind in (0, 1):  # httptools, h11
        targets.protocol(bytes([kind]) + b"GET /v1/models HTTP/1.1\r\n\r\n")


def test_protocol_relays_the_body_of_a_request_offering_an_upgrade():
    body = b'{"model": "m"}'
    request = (b"POST /v1/responses HTTP/1.1\r\nHost: s\r\nConnection: Upgrade\r\n"
               b"Upgrade: h2c\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    for kind in (0, 1):  # httptools, h11
        targets.protocol(bytes([kind]) + request)


def test_head_refusal_holds_the_http10_host_and_framing_rules():
    te = (b"transfer-encoding", b"chunked")
    for version, fields in (
        ("1.0", [te]),
        ("1.1", []),
        ("1.1", [(b"host", b"a"), (b"host", b"b")]),
        ("1.1", [(b"host", b"a b")]),
        ("1.1", [(b"host", b"[::1")]),
        ("1.1", [(b"host", b"[::g]:80")]),
        ("1.1", [(b"host", b"a"), (b"content-length", b"1"), te]),
    ):
        targets.check_head(b"POST", b"/v1/models", version, fields, 32768, 100)


def test_head_rules_read_hosts_as_rfc_3986_does():
    valid = [
        b"a",
        b"a.b:80",
        b"127.0.0.1:8080",
        b"[::1]:8080",
        b"xn--bcher-kva.example",
        b"a,b",
        b"a%20b",
        b"localhost:",
        b"[v1.x]",
    ]
    invalid = [
        b"a b",
        b"a/b",
        b"user@host",
        b"host:port",
        b"[::1",
        b"host:80:80",
        b"[::g]",
        b"a\tb",
        b"a\x00",
    ]
    assert all(targets._valid_host(host) for host in valid)
    assert not any(targets._valid_host(host) for host in invalid)
