"""/status as a person sees it: the sidecar's page rendered in Debian's headless Chromium.

A real sidecar in front of the stand-in vLLM, with vLLM 0.33.0's tree patched by the fix series
and its manifest (verified by the sidecar), two engine ranks as the plugin writes them, and
traffic through the pass-through with the official `openai` client (an answer, a runaway, a
reasoning loop). The browser loads /status as a browser does (`Accept: text/html`); the test
reads the page's rendered text and tables, never its HTML. The screenshot of record is
results/status/status.png (`MLA_SERVE_RECORD=1` rewrites it).
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import httpx
import openai
import pytest

from mla_serve.engine import state
from mla_serve.sidecar.settings import Settings
from tests import browser, trees
from tests.test_sidecar import _plugin_state

MODEL = "glm-5.3-flash"
RECORD = Path(__file__).resolve().parents[1] / "results" / "status" / "status.png"


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("status-page")
    manifest = base / "manifest.json"
    tree = trees.patched(trees.DEFAULT_RELEASE, base / "tree", manifest)
    time.sleep(1.1)  # the verifier trusts no file written within a second of its check
    return tree, manifest


def _chromium() -> None:
    if browser.binary() is None:
        message = "no chromium binary: .ci/run installs Debian's `chromium` package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _wait_ready(admin: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if httpx.get(f"{admin}/readyz", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    pytest.fail(f"never ready: {httpx.get(f'{admin}/readyz', timeout=5).json()}")


def test_the_status_page_shows_tables_in_words(vllm, serve_sidecar, patched, tmp_path):
    _chromium()
    tree, manifest = patched
    for rank in range(2):
        state.write(tmp_path / "state", _plugin_state(rank, "FULL_AND_PIECEWISE", 2_561_671_168))
    settings = Settings(
        vllm_url=vllm.url,
        state_dir=tmp_path / "state",
        manifest=manifest,
        vllm_tree=tree,
        poll_interval=0.2,
    )
    url = serve_sidecar(settings)
    _wait_ready(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)

    def ask(text: str, **extra: object) -> object:
        messages = [{"role": "user", "content": text}]
        return client.chat.completions.create(model=MODEL, messages=messages, **extra)

    ask("hello", max_tokens=32)
    ask("[runaway] think forever", max_tokens=16)
    for _ in ask("[loop:phrase] go", max_tokens=600, stream=True):  # type: ignore[attr-defined]
        pass

    shot = RECORD if os.environ.get("MLA_SERVE_RECORD") == "1" else tmp_path / "status.png"
    with browser.Browser(width=1280, height=900) as chromium:
        page = chromium.page(f"{url}/status", screenshot=shot)

    assert page.title == "mla-serve status"
    assert page.text.startswith("mla-serve sidecar: ready")
    # Words, never the document's raw values.
    for raw in ('{"', "null", "True", "False", 'FULL_AND_PIECEWISE"', "2561671168"):
        assert raw not in page.text, f"the page shows {raw!r}"

    assert page.row("manifest") == ["manifest", "verified"]
    assert page.row("vLLM release") == ["vLLM release", trees.DEFAULT_RELEASE]
    checks = page.table_with("check")
    assert checks[0] == ["check", "result", "detail"]
    assert {row[1] for row in checks[1:]} == {"passes"}

    fixes = page.table_with("fix")
    assert fixes[0] == ["fix", "what it fixes", "status", "probe"]
    documented = httpx.get(f"{url}/status", headers={"accept": "application/json"}).json()
    assert documented["fixes"]["verified"] is True  # the JSON stays as it was
    expected = {f["id"]: f["status"] for f in documented["fixes"]["fixes"]}
    assert {row[0]: row[2] for row in fixes[1:]} == expected
    assert {row[3] for row in fixes[1:]} == {"passes"}

    ranks = page.table_with("rank 1")
    assert ranks[0] == ["", "rank 0", "rank 1"]
    assert page.row("CUDA graph mode")[1:] == ["FULL_AND_PIECEWISE\nplugin"] * 2
    assert page.row("Capture sizes")[1] == "5 (1, 2, 4, 8, 16)\nplugin"
    assert page.row("Capture time")[1] == "12.5 s\nplugin"
    assert page.row("Capture memory")[1] == "3.00 GiB\nplugin"
    assert page.row("Sparse-MLA workspace (allocated)")[1] == "2.39 GiB\nplugin"
    assert page.row("Sparse-MLA workspace (needed)")[1] == "2.39 GiB\nsizing model"
    assert page.row("Attention workspace")[1] == "394.0 MiB\nplugin"
    assert page.row("Parallel layout")[1] == "TP1 x PP1 x DP1 x PCP4 x DCP4\nplugin"

    counts = page.table_with("tokens they burnt")
    assert counts[1] == [MODEL, "3", "2", f"{16 + 600:,}"]
    recent = page.table_with("completion tokens")
    causes = sorted(row[3] for row in recent[1:])
    assert causes == ["long reasoning", "loop"]

    assert page.row("action") == ["action", "observe"]
    loops = page.table_with("loops in reasoning")
    assert loops[1][:3] == [MODEL, "1", "0"]

    with shot.open("rb") as png:
        head = png.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width == 1280 and height > 900  # the whole page, taller than the window
