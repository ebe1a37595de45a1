"""The plugin -> sidecar contract (mla_serve/engine/contract.py) and the metrics table.

The baseline `fixtures/contract/recorded-f8c48ab.json` was recorded on the code before
the contract (commit f8c48ab: untyped dicts, hand-written metric families) from the inputs
next to it (`ranks.json`, `vllm.log`): the rank files the plugin wrote, the sidecar's
/metrics families and its /status engine section. Metric names, label sets, help texts,
values and the rank-file format are an interface (alert rules, dashboards, the e2e run,
an engine image of another release): never re-record it to make this test pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mla_serve.engine import contract, ranks, state, vllm_log
from mla_serve.engine.contract import ContractError, RankRecord
from mla_serve.sidecar.admin import status
from mla_serve.sidecar.admin.fixes import FixReport
from mla_serve.sidecar.admin.health import Verdict
from mla_serve.sidecar.admin.metrics import SidecarCollector, View
from mla_serve.sidecar.admin.vllm_monitor import VllmSnapshot
from mla_serve.sidecar.settings import Settings
from tests.scrape import samples
from tests.test_sidecar import _plugin_state
from tests.vllm_standin import StandIn

FIXTURES = Path(__file__).parent / "fixtures" / "contract"
ROOT = Path(__file__).resolve().parents[1]


def _families(text: str) -> dict[str, Any]:
    found = {}
    for family in text_string_to_metric_families(text):
        rows = [[s.name, dict(s.labels), s.value] for s in family.samples]
        found[family.name] = {
            "type": family.type,
            "help": family.documentation,
            "samples": sorted(rows, key=lambda row: json.dumps(row, sort_keys=True)),
        }
    return found


def _scenario(found: ranks.Engine) -> dict[str, Any]:
    snapshot = VllmSnapshot(checked_at=1.0, health_status=200, version="0.33.0")
    view = View(snapshot, FixReport(path=None), found, True)
    registry = CollectorRegistry()
    registry.register(SidecarCollector(lambda: view))
    text = generate_latest(registry).decode()
    doc = status.document(view, Verdict(True, {}), "http://127.0.0.1:8000", {})
    assert doc["engine"].pop("refused_rank_files") == []
    return {"metrics": _families(text), "status_engine": doc["engine"]}


# Help texts changed on purpose since the baseline: family -> (recorded, now). The fix
# status gained `affected` (catalog.Status), which the help text had not listed.
CHANGED_HELP = {
    "mla_serve_fix_info": (
        "Sparse-MLA fixes in the image: status patched, upstream or not-affected.",
        "Sparse-MLA fixes in the image: status patched, upstream, not-affected or affected.",
    ),
}


def test_what_was_exposed_before_the_contract_is_exposed_unchanged(tmp_path: Path) -> None:
    """Every metric family of before (name, type, help, every sample with its labels and
    value; the help as CHANGED_HELP says where it changed on purpose) and every /status figure
    (value and source) is there unchanged; a figure added since may only add. Rank files: the
    plugin writes every key it wrote before, with the same value (an older sidecar reads it as
    before), and the older plugin's files read back as the same records (a newer sidecar reads
    an older engine)."""
    recorded = json.loads((FIXTURES / "recorded-f8c48ab.json").read_text())
    raws = json.loads((FIXTURES / "ranks.json").read_text())
    for record in (contract.decode({"schema": 1, **raw}) for raw in raws):
        path = state.write(tmp_path / "state", record)
        before = json.loads(recorded["rank_files"][path.name])
        now = json.loads(path.read_text())
        assert {key: now.get(key, "absent") for key in before} == before
        assert contract.decode(before) == record
    plugin = _scenario(ranks.read(tmp_path / "state", None))
    log = vllm_log.LogFile(FIXTURES / "vllm.log")
    log.refresh()
    logged = _scenario(ranks.read(None, log))
    for name, now in (("plugin", plugin), ("log", logged)):
        before = recorded[name]
        for family, exposed in before["metrics"].items():
            if family in CHANGED_HELP:  # an intended change of the help text, nothing else
                was, becomes = CHANGED_HELP[family]
                assert exposed["help"] == was, (name, family)
                exposed = {**exposed, "help": becomes}
            assert now["metrics"].get(family) == exposed, (name, family)
        listed = now["status_engine"]["ranks"]
        assert [rank["rank"] for rank in listed] == [
            r["rank"] for r in before["status_engine"]["ranks"]
        ]
        for rank, old in zip(listed, before["status_engine"]["ranks"], strict=True):
            figures = {key: rank["figures"].get(key) for key in old["figures"]}
            assert figures == old["figures"], (name, rank["rank"])
    # The exposition's text, as tests matching it as text see it.
    text = _exposition(ranks.read(tmp_path / "state", None))
    assert 'mla_serve_cudagraph_mode_info{mode="PIECEWISE",rank="1"} 1.0' in text
    assert 'mla_serve_sparse_mla_workspace_bytes{kind="predicted",rank="0"}' in text
    assert 'mla_serve_attention_backend_info{backend="TRITON_MLA",rank="1"} 1.0' in text


def _exposition(found: ranks.Engine) -> str:
    snapshot = VllmSnapshot(checked_at=1.0, health_status=200)
    registry = CollectorRegistry()
    registry.register(SidecarCollector(lambda: View(snapshot, FixReport(None), found, True)))
    return generate_latest(registry).decode()


def test_the_log_parser_and_the_plugin_give_the_same_type() -> None:
    (parsed,) = vllm_log.parse((FIXTURES / "vllm.log").read_text().splitlines()[0])
    assert isinstance(parsed, RankRecord) and parsed.cudagraph_mode == "FULL_AND_PIECEWISE"
    assert contract.decode(contract.encode(parsed)) == parsed
    record = _plugin_state(3, "PIECEWISE", 1 << 20)
    assert contract.decode(json.loads(json.dumps(contract.encode(record)))) == record


def test_a_record_off_the_contract_is_never_written(tmp_path: Path) -> None:
    """A writer bug (a figure of the wrong type from some vLLM release) fails in the plugin,
    which logs it, before anything is written; it never reaches the sidecar."""
    wrong = dataclasses.replace(_plugin_state(0, "FULL", None), capture_seconds="12.5")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match=r"^capture_seconds: expected a number, got str"):
        state.write(tmp_path / "state", wrong)
    assert not (tmp_path / "state").exists()


def _file(**changes: object) -> dict[str, object]:
    document = contract.encode(_plugin_state(1, "FULL", None))
    for key, value in changes.items():
        if value is _DROP:
            document.pop(key)
        else:
            document[key] = value
    return document


_DROP = object()


def _bytes(**changes: object) -> bytes:
    return json.dumps(_file(**changes)).encode()


NOT_A_NUMBER = "capture_seconds: expected a finite number, got nan"
HOSTILE: list[tuple[str, bytes | None, str]] = [
    ("rank-1.json", _bytes(schema=2), "schema 2: this sidecar reads schema 1"),
    ("rank-1.json", _bytes(schema=_DROP), "no schema version"),
    ("rank-1.json", _bytes(schema=True), "schema True: this sidecar"),
    ("rank-1.json", _bytes(schema="x" * 10_000), "schema '" + "x" * 36 + "...: this sidecar"),
    ("rank-1.json", _bytes(capture_seconds="12"), "capture_seconds: expected a number, got str"),
    ("rank-1.json", _bytes(capture_seconds=float("nan")), NOT_A_NUMBER),
    ("rank-1.json", _bytes(capture_bytes=True), "capture_bytes: expected an integer, got bool"),
    ("rank-1.json", _bytes(capture_bytes=1.5), "capture_bytes: expected an integer, got float"),
    ("rank-1.json", _bytes(capture_bytes=10**30), "capture_bytes: an integer of 100 bits"),
    ("rank-1.json", _bytes(phase="warming"), "phase: expected one of ['captured', 'ready']"),
    ("rank-1.json", _bytes(cudagraph_capture_sizes=[1, "2"]), "cudagraph_capture_sizes[1]: "),
    ("rank-1.json", _bytes(attention_backends="FLASHMLA"), "attention_backends: expected a list"),
    ("rank-1.json", _bytes(parallel={"tp": 1}), "parallel.pp: missing"),
    ("rank-1.json", _bytes(manifest={"path": 1}), "manifest.path: expected a string"),
    ("rank-1.json", _bytes(rank=_DROP), "rank: missing"),
    ("rank-1.json", _bytes(rank=-1), "rank: -1 is negative"),
    ("rank-1.json", _bytes(rank=2), "holds rank 2 under the name of rank 1"),
    ("rank-01.json", _bytes(), "not a rank file name"),
    ("rank-x.json", b"{}", "not a rank file name"),
    ("rank-1.json", b"[1, 2]", "expected a JSON object, got list"),
    ("rank-1.json", b'{"schema": 1, "rank": ', "not JSON"),
    ("rank-1.json", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ("rank-1.json", b"\xff\xfe", "not JSON"),
    ("rank-1.json", b" " * (state.MAX_BYTES + 1), f"larger than {state.MAX_BYTES} bytes"),
    ("rank-1.json", None, "not a regular file"),  # a FIFO: must not block the reader
]


@pytest.mark.parametrize(("name", "content", "reason"), HOSTILE)
def test_a_rank_file_off_the_contract_is_refused_with_its_reason(
    tmp_path: Path, name: str, content: bytes | None, reason: str
) -> None:
    directory = tmp_path / "state"
    state.write(directory, _plugin_state(0, "FULL", None))
    if content is None:
        os.mkfifo(directory / name)
    else:
        (directory / name).write_bytes(content)
    reading = state.read_all(directory)
    assert [record.rank for record in reading.records] == [0]
    (refused,) = reading.refused
    assert refused.file == name and refused.reason.startswith(reason), refused.reason


def test_the_sidecar_shows_refused_rank_files_and_serves_the_rest(
    tmp_path: Path, vllm: StandIn, serve_sidecar: Callable[[Settings], str]
) -> None:
    directory = tmp_path / "state"
    state.write(directory, _plugin_state(0, "FULL_AND_PIECEWISE", None))
    (directory / "rank-1.json").write_text(json.dumps(_file(schema=2)))
    (directory / "rank-2.json").write_text(json.dumps(_file(rank=2, capture_bytes="3 GiB")))
    url = serve_sidecar(Settings(vllm_url=vllm.url, state_dir=directory, poll_interval=0.05))
    doc = httpx.get(f"{url}/status", timeout=10).json()
    assert [rank["rank"] for rank in doc["engine"]["ranks"]] == [0]
    refused = {r["file"]: r["reason"] for r in doc["engine"]["refused_rank_files"]}
    assert set(refused) == {"rank-1.json", "rank-2.json"}
    assert refused["rank-1.json"].startswith("schema 2: this sidecar reads schema 1")
    assert refused["rank-2.json"] == "capture_bytes: expected an integer, got str '3 GiB'"
    series = samples(url)
    mode = ({"mode": "FULL_AND_PIECEWISE", "rank": "0"}, 1.0)
    assert series["mla_serve_cudagraph_mode_info"] == [mode]
    page = httpx.get(f"{url}/status?format=html", timeout=10).text
    assert "Rank files refused" in page and "rank-2.json" in page


def test_the_table_agrees_with_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    contract.check_table()
    broken = [
        contract.Figure("capture_seconds", contract.Series("mla_serve_x", "x", "count")),
        contract.Figure("cudagraph_mode", contract.Series("mla_serve_x", "x", "info")),
        contract.Figure("capture_bytes", contract.Series("mla_x", "x", "value", ("rank", "kind"))),
    ]
    original = contract.FIGURES
    for row in broken:
        table = tuple(row if f.name == row.name else f for f in original)
        monkeypatch.setattr(contract, "FIGURES", table)
        with pytest.raises(ValueError, match=f"^{row.name}: "):
            contract.check_table()
    monkeypatch.setattr(contract, "FIGURES", original[1:])
    with pytest.raises(ValueError, match="FIGURES and FigureName differ"):
        contract.check_table()


MYPY_SNIPPET = """
from mla_serve.engine.contract import Figure, RankRecord, Series
from mla_serve.engine.ranks import Rank

record = RankRecord(rank=0, {keyword}=12.5)
seconds: float | None = record.{attribute}
row = Figure("{figure}", Series("mla_serve_x_seconds", "x", "value"))
rank = Rank(record, "plugin")
value = rank.value("{figure}")
"""


def _mypy(tmp_path: Path, **names: str) -> subprocess.CompletedProcess[str]:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(MYPY_SNIPPET.format(**names)))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), str(snippet)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_mypy_catches_a_misspelt_figure(tmp_path: Path) -> None:
    """Every place a figure is named is checked by mypy: the record's fields (plugin, log
    parser, sidecar), and the table's and the sidecar's figure names (a Literal)."""
    right = _mypy(tmp_path, keyword="capture_seconds", attribute="capture_seconds",
                  figure="capture_seconds")  # fmt: skip
    assert right.returncode == 0, right.stdout + right.stderr
    wrong = _mypy(tmp_path, keyword="capture_secs", attribute="capture_secnds",
                  figure="capture_second")  # fmt: skip
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    errors = wrong.stdout
    assert 'Unexpected keyword argument "capture_secs" for "RankRecord"' in errors
    assert '"RankRecord" has no attribute "capture_secnds"' in errors
    assert errors.count("Literal['capture_second']") == 2, errors  # the table row, Rank.value


def test_the_sidecar_readme_lists_every_engine_series_as_the_table_feeds_it() -> None:
    """The README's table of engine series is the one a user reads: each family of
    `contract.FIGURES` once, its labels in exposition order, the figures that feed it."""
    readme = (ROOT / "mla_serve" / "sidecar" / "README.md").read_text()
    rows = []
    for line in readme.split("| series | labels | figure |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        series, labels, _ = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append((series.strip("`"), tuple(label.strip("` ") for label in labels.split(","))))
    families: dict[str, tuple[str, ...]] = {}
    for figure in contract.FIGURES:
        if figure.series is not None:
            families.setdefault(figure.series.name, figure.series.labels)
    assert rows == list(families.items())
