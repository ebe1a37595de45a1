"""tests/upstream.py's fetching and bookkeeping, against a package index on 127.0.0.1.

The index serves a small source distribution built here (not vLLM's), as a PEP 503 HTML
page and as PEP 691 JSON, so the download, the sha256 check, the extraction of only the
named files and the per-test outcomes are checked without the network.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mla_serve.patching import catalog
from tests import upstream

RELEASE = "9.9.9"
FILES = {
    "tests/v1/attention/test_a.py": "def test_one():\n    pass\n",
    "tests/v1/attention/utils.py": "X = 1\n",
    "tests/other/test_big.py": "# not needed\n" * 1000,
    "vllm/__init__.py": "",
}


def _sdist() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{RELEASE}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class _Index(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """A simple index on 127.0.0.1 as pip's configured index; the cache in tmp_path."""
    root = tmp_path / "index"
    (root / "simple" / "vllm").mkdir(parents=True)
    (root / "files").mkdir()
    payload = _sdist()
    (root / "files" / f"vllm-{RELEASE}.tar.gz").write_bytes(payload)
    sha = hashlib.sha256(payload).hexdigest()
    state: dict[str, object] = {"root": root, "sha": sha}

    def page(digest: str) -> None:
        href = f"../../files/vllm-{RELEASE}.tar.gz#sha256={digest}"
        (root / "simple" / "vllm" / "index.html").write_text(
            f'<html><body><a href="{href}">vllm-{RELEASE}.tar.gz</a></body></html>'
        )

    page(sha)
    state["page"] = page
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Index, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setattr(upstream, "CACHE", tmp_path / "cache")
    yield state
    server.shutdown()
    thread.join(timeout=10)


def test_index_is_pips_configured_one(index):
    assert upstream.index_urls()[0].startswith("http://127.0.0.1:")


def test_downloads_once_checks_the_hash_and_extracts_only_what_is_named(index, tmp_path):
    path = upstream.sdist(RELEASE)
    assert path.read_bytes() == (Path(str(index["root"])) / "files" / path.name).read_bytes()
    root = upstream.extract(RELEASE, ("tests/v1/attention/test_a.py",))
    extracted = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert extracted == ["tests/v1/attention/test_a.py"]  # no __init__.py in this sdist
    (Path(str(index["root"])) / "files" / path.name).unlink()  # cached: no second download
    assert upstream.sdist(RELEASE) == path
    assert upstream.extract(RELEASE, ("tests/v1/attention/utils.py",)).is_dir()


def test_a_wrong_hash_is_refused_and_nothing_is_cached(index, tmp_path):
    index["page"]("0" * 64)  # type: ignore[operator]
    with pytest.raises(upstream.UpstreamError, match="sha256"):
        upstream.sdist(RELEASE)
    assert not any((tmp_path / "cache" / "sdists").iterdir())


def test_a_release_missing_from_every_index_is_named(index):
    with pytest.raises(upstream.UpstreamError, match=r"vllm-1\.0\.0\.tar\.gz is on none"):
        upstream.sdist("1.0.0")


def test_a_missing_test_file_is_named(index):
    with pytest.raises(upstream.UpstreamError, match=r"has no tests/nope\.py"):
        upstream.extract(RELEASE, ("tests/nope.py",))


def test_outcomes_of_files_that_do_not_import_parametrized_tests_and_skips():
    recorded = {
        "collect": {"tests/a.py": "failed", "tests/b.py": "passed"},
        "tests": {
            "tests/b.py::test_p[1]": "passed",
            "tests/b.py::test_p[2]": "failed",
            "tests/b.py::test_q": "passed",
            "tests/b.py::test_qq": "failed",
            "tests/b.py::test_s": "skipped",
        },
    }
    assert upstream.outcome("tests/a.py::test_x", recorded) == "failed"
    assert upstream.outcome("tests/b.py::test_p", recorded) == "failed"
    assert upstream.outcome("tests/b.py::test_q", recorded) == "passed"  # not test_qq
    assert upstream.outcome("tests/b.py::test_s", recorded) == "skipped"
    assert upstream.outcome("tests/b.py::test_gone", recorded) == "missing"


def test_expectations_follow_the_catalog():
    loaded = catalog.load()
    pristine = {c.test: c.expect for c in upstream.cases(loaded, "0.29.0", "pristine", "cpu")}
    patched = {c.test: c.expect for c in upstream.cases(loaded, "0.29.0", "patched", "cpu")}
    later = {c.test: c.expect for c in upstream.cases(loaded, "0.33.0", "pristine", "cpu")}
    assert set(pristine.values()) == {"fail"} and set(patched.values()) == {"pass"}
    assert set(later.values()) == {"pass"} and len(later) > len(pristine)  # + warmup keys
    early = {c.test for c in upstream.cases(loaded, "0.28.0", "patched", "cpu")}
    assert not any("test_indexer_dcp_localize" in t for t in early)  # left out, with reason
    guards = upstream.cases(loaded, "0.28.0", "pristine", "gpu")  # the fix upstream there
    assert {c.expect for c in guards if c.fix == "dsv4-indexer-capture-shortcut"} == {"pass"}
    not_affected = upstream.cases(loaded, "0.27.1", "pristine", "gpu")  # a verdict: none run
    assert not any(c.fix == "dsv4-indexer-capture-shortcut" for c in not_affected)
    json.dumps([c.__dict__ for c in guards])  # what run.sh writes
