"""What the sidecar reports about the engine, against what vLLM itself logged at startup.

The figures come from the engine plugin (source "plugin"); vLLM's own log lines
are the independent record: the capture progress bars (one per runtime mode, with
the number of sizes), "Graph capturing finished in N secs, took X GiB", and, with
VLLM_DEBUG_WORKSPACE=1, the workspace sizes when capture locks it.
"""

from __future__ import annotations

import re
from typing import Any

from scrape import samples

from server.sidecar import vllm_log as log_parser

# Runtime modes whose graphs each resolved CUDA graph mode captures.
CAPTURED_MODES = {
    "FULL_AND_PIECEWISE": {"PIECEWISE", "FULL"},
    "FULL_DECODE_ONLY": {"FULL"},
    "FULL": {"FULL"},
    "PIECEWISE": {"PIECEWISE"},
    "NONE": set(),
}
BAR = re.compile(r"Capturing CUDA graphs \((?:([^,)]+), )?(\w+)\): +100%\|[^|]*\| *(\d+)/(\d+)")
FINISHED = re.compile(r"Graph capturing finished in (\d+) secs, took ([0-9.]+) GiB")
LOCKED = re.compile(r"Workspace locked\. Current sizes: \[([0-9., e+-]*)\]")


def rank0(status: dict[str, Any]) -> dict[str, Any]:
    (rank,) = status["engine"]["ranks"]
    assert rank["rank"] == 0
    figures = {name: figure["value"] for name, figure in rank["figures"].items()}
    sources = {figure["source"] for name, figure in rank["figures"].items() if figure["value"]}
    assert sources <= {"plugin", "sizing model"}, sources
    return figures


def real_capture(log: str) -> tuple[str, re.Match[str]]:
    """The log of the capture that serves, and its "finished" line.

    vLLM 0.33.0 captures twice: a profile-only pass that measures graph memory
    (not reported by the plugin), then the real one. Its log runs from the
    previous "finished" line to the last.
    """
    finished = list(FINISHED.finditer(log))
    assert finished, "vLLM logged no finished graph capture"
    start = finished[-2].end() if len(finished) > 1 else 0
    return log[start : finished[-1].end()], finished[-1]


def test_graph_mode_and_sizes_are_what_vllm_captured(status: dict[str, Any], vllm_log: str) -> None:
    figures = rank0(status)
    assert figures["phase"] == "ready"
    mode, sizes = figures["cudagraph_mode"], figures["cudagraph_capture_sizes"]
    assert mode != "NONE" and sizes, "CUDA graphs are on (vLLM's default)"
    capture_log, _ = real_capture(vllm_log)
    bars = {(found[2], int(found[3])) for found in BAR.finditer(capture_log)}
    assert {runtime for runtime, _ in bars} == CAPTURED_MODES[mode], (mode, bars)
    for runtime, count in bars:
        if runtime == "PIECEWISE":
            assert count == len(sizes)  # piecewise graphs cover every capture size
        else:
            assert count <= len(sizes)  # full graphs: the uniform-decode sizes among them


def test_capture_time_and_memory_match_vllm_log(status: dict[str, Any], vllm_log: str) -> None:
    figures = rank0(status)
    _, finished = real_capture(vllm_log)
    logged_seconds, logged_gib = int(finished[1]), float(finished[2])
    # vLLM times the capture inside capture_model and rounds to whole seconds; the
    # plugin times the whole call around it.
    assert logged_seconds - 0.5 <= figures["capture_seconds"] <= logged_seconds + 2.0
    assert abs(figures["capture_bytes"] / 2**30 - logged_gib) <= 0.005 + 1e-9


def test_attention_workspace_is_the_size_vllm_locked(status: dict[str, Any], vllm_log: str) -> None:
    figures = rank0(status)
    assert any("MLA_SPARSE" in name for name in figures["attention_backends"])
    locked = LOCKED.findall(vllm_log)
    assert locked, "VLLM_DEBUG_WORKSPACE=1 makes vLLM log the locked workspace"
    logged = sum(float(size) for size in locked[-1].split(",") if size.strip()) * 2**20
    assert figures["attention_workspace_bytes"] > 0
    assert abs(figures["attention_workspace_bytes"] - logged) < 1.0
    # FlashInfer's sparse-MLA workspace exists on SM100 only: absent here, not made up.
    assert figures["sparse_mla_workspace_bytes"] is None


def test_metrics_carry_the_same_figures(live: dict[str, Any], status: dict[str, Any]) -> None:
    figures = rank0(status)
    series = samples(live["sidecar_url"])
    rank = {"rank": "0"}
    assert series["mla_serve_cudagraph_mode_info"] == [
        ({"mode": figures["cudagraph_mode"], "rank": "0"}, 1.0)
    ]
    assert series["mla_serve_cudagraph_capture_sizes"] == [
        (rank, float(len(figures["cudagraph_capture_sizes"])))
    ]
    assert series["mla_serve_cudagraph_capture_duration_seconds"] == [
        (rank, figures["capture_seconds"])
    ]
    assert series["mla_serve_cudagraph_capture_memory_bytes"] == [
        (rank, float(figures["capture_bytes"]))
    ]
    assert series["mla_serve_attention_workspace_bytes"] == [
        (rank, float(figures["attention_workspace_bytes"]))
    ]
    assert series["mla_serve_vllm_up"] == [({}, 1.0)]
    assert series["mla_serve_ready"] == [({}, 1.0)]
    assert series["mla_serve_manifest_verified"] == [({}, 1.0)]


def test_fix_manifest_is_verified_for_the_running_release(status: dict[str, Any]) -> None:
    fixes = status["fixes"]
    assert fixes["verified"] is True and not fixes["drift"]
    assert fixes["vllm_version"] == status["vllm"]["version"]
    figures = rank0(status)
    assert figures["manifest"]["files_match"] is True


def test_log_fallback_reads_the_same_figures(status: dict[str, Any], vllm_log: str) -> None:
    """Without the plugin the sidecar reads vLLM's log; on a real log it must agree."""
    figures = rank0(status)
    (parsed,) = log_parser.parse(vllm_log)
    assert parsed["cudagraph_mode"] == figures["cudagraph_mode"]
    assert parsed["cudagraph_capture_sizes"] == figures["cudagraph_capture_sizes"]
    assert abs(parsed["capture_bytes"] - figures["capture_bytes"]) <= 0.005 * 2**30
