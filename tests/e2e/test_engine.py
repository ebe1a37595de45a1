"""What the sidecar reports about every engine rank, against what vLLM itself logged.

The figures come from the engine plugin (source "plugin"); vLLM's own log lines
are the independent record, per rank: each worker prefixes its lines with its
process name (`(Worker_TP1_DCP1 pid=…)`, or `(EngineCore pid=…)` for a one-rank
engine), written apart from the message, so two workers' lines can interleave.
The capture progress bars (one per runtime mode, with the number of sizes) come
from the first rank only; "Graph capturing finished in N secs, took X GiB" from
every rank; with VLLM_DEBUG_WORKSPACE=1, each rank's workspace as it grows and,
where the release locks it at capture, its locked size.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from mla_serve.engine import vllm_log as log_parser
from tests.scrape import samples

# Runtime modes whose graphs each resolved CUDA graph mode captures.
CAPTURED_MODES = {
    "FULL_AND_PIECEWISE": {"PIECEWISE", "FULL"},
    "FULL_DECODE_ONLY": {"FULL"},
    "FULL": {"FULL"},
    "PIECEWISE": {"PIECEWISE"},
    "NONE": set(),
}
BAR = re.compile(r"Capturing CUDA graphs \((?:([^,)]+), )?(\w+)\): +100%\|[^|]*\| *(\d+)/(\d+)")
# vLLM logs the free-memory difference around the capture: negative when another process
# freed memory meanwhile (stacks sharing the GPUs).
FINISHED = re.compile(r"Graph capturing finished in (\d+) secs, took (-?[0-9.]+) GiB")
LOCKED = re.compile(r"Workspace locked\. Current sizes: \[([0-9., e+-]*)\]")
RESIZED = re.compile(r"Resized workspace from '[^']*': [0-9.]+ MB -> ([0-9.]+) MB")
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


def ranks(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in status["engine"]["ranks"]:
        figures = {name: figure["value"] for name, figure in rank["figures"].items()}
        sources = {figure["source"] for figure in rank["figures"].values() if figure["value"]}
        assert sources <= {"plugin", "sizing model"}, sources
        found[int(rank["rank"])] = figures
    return found


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


def owners(line: str) -> list[str]:
    """The process names at the start of a log line: more than one where workers' writes
    interleaved (vLLM writes the prefix and the message separately), in write order."""
    names = []
    while found := PREFIX.match(line):
        names.append(found[1])
        line = line[found.end() :].lstrip()
    return names


def named(name: str, candidates: list[str]) -> bool:
    return any(c == name or c.startswith(f"{name}_DP") for c in candidates)


def capture_window(log: str, world: int) -> tuple[str, list[re.Match[str]]]:
    """The log of the capture that serves (bars included: they carry no prefix) and its
    "finished" lines: the last `world` of them, or the last one where a release logs it once.

    vLLM 0.33.0 may capture twice (a profile-only pass that measures graph memory, then the
    real one); the window starts after the "finished" lines of the pass before.
    """
    lines = log.splitlines()
    marks = [i for i, line in enumerate(lines) if FINISHED.search(line)]
    assert marks, "vLLM logged no finished graph capture"
    last = marks[-world:] if len(marks) >= world else marks[-1:]
    before = [i for i in marks if i < last[0]]
    start = before[-1] + 1 if before else 0
    found = [m for i in last if (m := FINISHED.search(lines[i]))]
    return "\n".join(lines[start : last[-1] + 1]), found


def test_graph_mode_and_sizes_are_what_vllm_captured(
    status: dict[str, Any], live: dict[str, Any], vllm_log: str
) -> None:
    reported = ranks(status)
    first = reported[0]
    mode, sizes = first["cudagraph_mode"], first["cudagraph_capture_sizes"]
    assert mode != "NONE" and sizes, "CUDA graphs are on"
    for figures in reported.values():  # every rank runs the mode and sizes of the first
        assert (figures["cudagraph_mode"], figures["cudagraph_capture_sizes"]) == (mode, sizes)
    capture, _ = capture_window(vllm_log, len(reported))
    bars = {(found[2], int(found[3])) for found in BAR.finditer(capture)}
    assert {runtime for runtime, _ in bars} == CAPTURED_MODES[mode], (mode, bars)
    for runtime, count in bars:
        if runtime == "PIECEWISE":
            assert count == len(sizes)  # piecewise graphs cover every capture size
        else:
            assert count <= len(sizes)  # full graphs: the uniform-decode sizes among them


def test_capture_time_and_memory_match_each_ranks_log(
    status: dict[str, Any], vllm_log: str
) -> None:
    """Every rank's capture time and memory is a "finished" line vLLM logged, one line per
    rank. Lines are matched by value, not by prefix: workers' writes interleave (the prefix
    of one line can belong to the message of the next)."""
    reported = ranks(status)
    _, finished = capture_window(vllm_log, len(reported))
    logged = [(int(found[1]), float(found[2])) for found in finished]
    for rank, figures in sorted(reported.items()):
        assert figures["capture_seconds"] > 0 and figures["capture_bytes"] is not None
        # vLLM times the capture inside capture_model and rounds to whole seconds; the
        # plugin times the whole call around it. Memory: GiB to two decimals.
        match = next(
            (
                line
                for line in logged
                if line[0] - 0.5 <= figures["capture_seconds"] <= line[0] + 2.0
                and abs(figures["capture_bytes"] / 2**30 - line[1]) <= 0.005 + 1e-9
            ),
            None,
        )
        if match is None and len(logged) < len(reported):
            continue  # this release logs the line once (the first rank's), already matched
        assert match is not None, (
            rank,
            figures["capture_seconds"],
            figures["capture_bytes"],
            logged,
        )
        logged.remove(match)


def test_attention_workspace_is_the_size_each_rank_locked(
    status: dict[str, Any], live: dict[str, Any], vllm_log: str
) -> None:
    """Each rank's workspace is what vLLM logged for it: the size it locked at capture, or,
    in a release whose model runner never locks it (0.28.0/0.29.0's V2 runner), the size
    its last resize reached (the workspace only grows)."""
    parallel = live["layout"]["parallel"]
    for rank, figures in ranks(status).items():
        assert any("MLA_SPARSE" in name for name in figures["attention_backends"])
        name = process_name(rank, parallel)
        own = [line for line in vllm_log.splitlines() if named(name, owners(line))]
        locked = [found for line in own if (found := LOCKED.search(line))]
        if locked:
            logged = sum(float(size) for size in locked[-1][1].split(",") if size.strip())
            tolerance = 1.0 / 2**20
        else:
            resized = [float(found[1]) for line in own if (found := RESIZED.search(line))]
            assert resized, f"rank {rank}: VLLM_DEBUG_WORKSPACE=1 makes vLLM log the workspace"
            logged, tolerance = max(resized), 0.005  # MB to two decimals
        assert figures["attention_workspace_bytes"] > 0
        assert abs(figures["attention_workspace_bytes"] / 2**20 - logged) <= tolerance, rank
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
    """Without the plugin the sidecar reads vLLM's log; on a real log it must agree: the first
    rank's mode and sizes, and the capture memory of every "finished" line it found."""
    reported = ranks(status)
    first = reported[0]
    parsed = log_parser.parse(vllm_log)
    assert parsed, "the log parser found the capture"
    assert parsed[0].cudagraph_mode == first["cudagraph_mode"]
    assert list(parsed[0].cudagraph_capture_sizes or ()) == first["cudagraph_capture_sizes"]
    _, finished = capture_window(vllm_log, len(reported))
    logged = sorted(round(float(found[2]) * 2**30) for found in finished)
    read = sorted(rank.capture_bytes for rank in parsed if rank.capture_bytes is not None)
    assert len(read) == len(logged)
    for ours, theirs in zip(read, logged, strict=True):
        assert abs(ours - theirs) <= 0.005 * 2**30


def test_sparse_mla_runs_the_backend_the_image_selects(
    status: dict[str, Any], live: dict[str, Any]
) -> None:
    """The image installs FlashInfer with vLLM (0.7.2.post1 with 0.33.0), and on Hopper
    vLLM 0.33.0 then tries FLASHINFER_MLA_SPARSE_SM90 first for MLA head size 512, GLM-5.3's
    NoPE MLA (platforms/cuda.py, where FlashInfer has its SM90 NoPE kernel); without FlashInfer
    it falls back to FLASHMLA_SPARSE. The stack carries the image's FlashInfer, so every rank
    runs what the image would; a layout that sets --attention-backend runs that one."""
    import torch

    from tests.e2e import pack

    pinned = pack.image_pin(live["release"], pack.FLASHINFER)
    carried = [p for p in live["python_paths"] if "/flashinfer-" in p]
    if pinned is not None:
        assert [p.split("/flashinfer-")[1].split("/")[0] for p in carried] == [pinned]
    flag = "--attention-backend="
    forced = [a.removeprefix(flag) for a in live["serve_argv"] if a.startswith(flag)]
    if forced:
        expected = forced[-1]
    elif live["tiny"] == "glm-5.3-flash" and torch.cuda.get_device_capability()[0] == 9:
        expected = "FLASHINFER_MLA_SPARSE_SM90"
    else:
        pytest.skip(f"vLLM's own choice for the tiny {live['tiny']} here has no other candidate")
    for rank, figures in ranks(status).items():
        sparse = [name for name in figures["attention_backends"] if "MLA_SPARSE" in name]
        assert sparse == [expected], (rank, figures["attention_backends"])
