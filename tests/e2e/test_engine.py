"""What the sidecar reports about every engine rank, against what vLLM itself logged.

The figures come from the engine plugin (source "plugin"); vLLM's own log lines
are the independent record, per rank: each worker prefixes its lines with its
process name (`(Worker_TP1_DCP1 pid=…)`, or `(EngineCore pid=…)` for a one-rank
engine). The capture progress bars (one per runtime mode, with the number of
sizes) come from the first rank only; "Graph capturing finished in N secs, took X
GiB" from every rank in vLLM 0.33.0's model runner (from the first only where a
release logs it once); with VLLM_DEBUG_WORKSPACE=1, each rank's locked workspace.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
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
PREFIX = re.compile(r"^\((\w+) pid=\d+\)")


def process_name(rank: int, parallel: dict[str, Any]) -> str:
    """vLLM's name for the process of global `rank` (multiproc_executor's rule; TP fastest)."""
    tp, pcp, dcp = int(parallel["tp"]), int(parallel["pcp"]), int(parallel["dcp"])
    if tp * pcp == 1:
        return "EngineCore"
    tp_rank, pcp_rank = rank % tp, (rank // tp) % pcp
    name = "Worker"
    name += f"_PCP{pcp_rank}" if pcp > 1 else ""
    name += f"_TP{tp_rank}" if tp > 1 else ""
    name += f"_DCP{tp_rank % dcp}" if dcp > 1 else ""
    return name


def rank_log(log: str, name: str) -> str:
    """The lines vLLM's process `name` logged (EngineCore also matches EngineCore_DP0)."""
    lines = []
    for line in log.splitlines():
        found = PREFIX.match(line)
        if found and (found[1] == name or found[1].startswith(f"{name}_DP")):
            lines.append(line)
    return "\n".join(lines)


def ranks(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in status["engine"]["ranks"]:
        figures = {name: figure["value"] for name, figure in rank["figures"].items()}
        sources = {figure["source"] for figure in rank["figures"].values() if figure["value"]}
        assert sources <= {"plugin", "sizing model"}, sources
        found[int(rank["rank"])] = figures
    return found


def real_capture(log: str) -> tuple[str, re.Match[str]] | None:
    """The log of the capture that serves, and its "finished" line, if this log has one.

    vLLM 0.33.0 may capture twice: a profile-only pass that measures graph memory
    (not reported by the plugin), then the real one. Its log runs from the previous
    "finished" line to the last.
    """
    finished = list(FINISHED.finditer(log))
    if not finished:
        return None
    start = finished[-2].end() if len(finished) > 1 else 0
    return log[start : finished[-1].end()], finished[-1]


def test_every_rank_reports(status: dict[str, Any], live: dict[str, Any], world: int) -> None:
    reported = ranks(status)
    assert sorted(reported) == list(range(world)), sorted(reported)
    parallel = live["layout"]["parallel"]
    for figures in reported.values():
        assert figures["phase"] == "ready"
        layout = figures["parallel"]
        assert (layout["tp"], layout["pcp"], layout["dcp"]) == (
            parallel["tp"],
            parallel["pcp"],
            parallel["dcp"],
        )


def first_rank_capture(log: str, name: str) -> str:
    """The whole log (bars carry no prefix) between the first rank's last two "finished" lines."""
    lines = log.splitlines()
    marks = [
        i
        for i, line in enumerate(lines)
        if FINISHED.search(line)
        and (m := PREFIX.match(line))
        and (m[1] == name or m[1].startswith(f"{name}_DP"))
    ]
    assert marks, f"vLLM logged no finished graph capture for {name}"
    start = marks[-2] + 1 if len(marks) > 1 else 0
    return "\n".join(lines[start : marks[-1] + 1])


def test_graph_mode_and_sizes_are_what_vllm_captured(
    status: dict[str, Any], live: dict[str, Any], vllm_log: str
) -> None:
    reported = ranks(status)
    first = reported[0]
    mode, sizes = first["cudagraph_mode"], first["cudagraph_capture_sizes"]
    assert mode != "NONE" and sizes, "CUDA graphs are on"
    for figures in reported.values():  # every rank runs the mode and sizes of the first
        assert (figures["cudagraph_mode"], figures["cudagraph_capture_sizes"]) == (mode, sizes)
    capture = first_rank_capture(vllm_log, process_name(0, live["layout"]["parallel"]))
    bars = {(found[2], int(found[3])) for found in BAR.finditer(capture)}
    assert {runtime for runtime, _ in bars} == CAPTURED_MODES[mode], (mode, bars)
    for runtime, count in bars:
        if runtime == "PIECEWISE":
            assert count == len(sizes)  # piecewise graphs cover every capture size
        else:
            assert count <= len(sizes)  # full graphs: the uniform-decode sizes among them


def test_capture_time_and_memory_match_each_ranks_log(
    status: dict[str, Any], live: dict[str, Any], vllm_log: str
) -> None:
    compared = []
    for rank, figures in ranks(status).items():
        capture = real_capture(rank_log(vllm_log, process_name(rank, live["layout"]["parallel"])))
        assert figures["capture_seconds"] > 0 and figures["capture_bytes"] is not None
        if capture is None:
            continue  # this release logs the line once, on the first rank
        logged_seconds, logged_gib = int(capture[1][1]), float(capture[1][2])
        # vLLM times the capture inside capture_model and rounds to whole seconds; the
        # plugin times the whole call around it.
        assert logged_seconds - 0.5 <= figures["capture_seconds"] <= logged_seconds + 2.0, rank
        assert abs(figures["capture_bytes"] / 2**30 - logged_gib) <= 0.005 + 1e-9, rank
        compared.append(rank)
    assert 0 in compared, "the first rank's capture line is in vLLM's log"


def test_attention_workspace_is_the_size_each_rank_locked(
    status: dict[str, Any], live: dict[str, Any], vllm_log: str
) -> None:
    for rank, figures in ranks(status).items():
        assert any("MLA_SPARSE" in name for name in figures["attention_backends"])
        own = rank_log(vllm_log, process_name(rank, live["layout"]["parallel"]))
        locked = LOCKED.findall(own)
        assert locked, f"rank {rank}: VLLM_DEBUG_WORKSPACE=1 makes vLLM log the locked workspace"
        logged = sum(float(size) for size in locked[-1].split(",") if size.strip()) * 2**20
        assert figures["attention_workspace_bytes"] > 0
        assert abs(figures["attention_workspace_bytes"] - logged) < 1.0, rank
        # FlashInfer's sparse-MLA workspace exists on SM100 only: absent here, not made up.
        assert figures["sparse_mla_workspace_bytes"] is None


def test_metrics_carry_every_ranks_figures(live: dict[str, Any], status: dict[str, Any]) -> None:
    reported = ranks(status)
    series = samples(live["admin_url"])

    def by_rank(name: str) -> dict[str, Any]:
        return {labels["rank"]: (labels, value) for labels, value in series[name]}

    assert set(by_rank("mla_serve_cudagraph_mode_info")) == {str(r) for r in reported}
    for rank, figures in reported.items():
        key = str(rank)
        assert by_rank("mla_serve_cudagraph_mode_info")[key] == (
            {"mode": figures["cudagraph_mode"], "rank": key},
            1.0,
        )
        assert by_rank("mla_serve_cudagraph_capture_sizes")[key][1] == float(
            len(figures["cudagraph_capture_sizes"])
        )
        assert (
            by_rank("mla_serve_cudagraph_capture_duration_seconds")[key][1]
            == (figures["capture_seconds"])
        )
        assert by_rank("mla_serve_cudagraph_capture_memory_bytes")[key][1] == float(
            figures["capture_bytes"]
        )
        assert by_rank("mla_serve_attention_workspace_bytes")[key][1] == float(
            figures["attention_workspace_bytes"]
        )
    assert series["mla_serve_vllm_up"] == [({}, 1.0)]


@pytest.mark.needs_manifest
def test_ready_and_verified_metrics(live: dict[str, Any]) -> None:
    series = samples(live["admin_url"])
    assert series["mla_serve_ready"] == [({}, 1.0)]
    assert series["mla_serve_manifest_verified"] == [({}, 1.0)]


@pytest.mark.needs_manifest
def test_fix_manifest_is_verified_for_the_running_release(status: dict[str, Any]) -> None:
    fixes = status["fixes"]
    assert fixes["verified"] is True and not fixes["drift"]
    assert fixes["vllm_version"] == status["vllm"]["version"]
    for figures in ranks(status).values():
        assert figures["manifest"]["files_match"] is True


def test_a_pristine_tree_is_never_ready(live: dict[str, Any], status: dict[str, Any]) -> None:
    if live["state"] != "pristine":
        pytest.skip("a patched tree: readiness is checked by test_startup")
    assert status["ready"]["status"] != "ok"
    assert "fix_manifest" in status["ready"]["failing"], status["ready"]


def test_log_fallback_reads_the_same_figures(status: dict[str, Any], vllm_log: str) -> None:
    """Without the plugin the sidecar reads vLLM's log; on a real log it must agree (first rank)."""
    first = ranks(status)[0]
    parsed = log_parser.parse(vllm_log)
    assert parsed, "the log parser found the capture"
    assert parsed[0]["cudagraph_mode"] == first["cudagraph_mode"]
    assert parsed[0]["cudagraph_capture_sizes"] == first["cudagraph_capture_sizes"]
    assert abs(parsed[0]["capture_bytes"] - first["capture_bytes"]) <= 0.005 * 2**30
