"""Shared test set-up.

`--vllm-tree DIR --vllm-state pristine|patched` select the vLLM tree that the
per-tree suites (tests/vllm_cpu, tests/gpu) import; their `expect` fixture says,
from the fix catalog, whether a fix must show as fixed or buggy in that tree.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mla_serve.sidecar.settings import Settings
    from tests.vllm_standin import StandIn

from mla_serve.patching import tree as tree_
from tests.vllm_tree import CATALOG, Expect


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--vllm-tree", default=None, help="directory containing vllm/")
    parser.addoption("--vllm-state", default=None, choices=("pristine", "patched"))


def pytest_configure(config: pytest.Config) -> None:
    tree = config.getoption("--vllm-tree")
    if tree:  # a sys.path edit (bench_gpu has the other): it selects the vLLM tree under test
        sys.path.insert(0, str(Path(tree).resolve()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/vllm_cpu runs only in the per-tree child pytest of test_vllm_behaviour.py."""
    if collection_path.name == "vllm_cpu" and config.getoption("--vllm-tree") is None:
        return True
    return None


@pytest.fixture
def vllm() -> Iterator[StandIn]:
    """A stand-in vLLM 0.33.0 server on 127.0.0.1 (tests/vllm_standin.py)."""
    from tests.vllm_standin import StandIn

    standin = StandIn().start()
    yield standin
    standin.stop()


@pytest.fixture
def serve_sidecar() -> Iterator[Callable[[Settings], str]]:
    """Start sidecars with the given settings on real sockets, on the sidecar's own HTTP
    protocol as `mla-serve sidecar` runs it (serve.py: the pass-through without ASGI,
    passthrough/fronts.py); returns each one's URL."""
    from mla_serve.sidecar import uvicorn_adapter
    from mla_serve.sidecar.app import create_app
    from tests.http_server import ServerThread

    servers: list[ServerThread] = []

    def start(settings: Settings) -> str:
        app = create_app(settings)
        http = uvicorn_adapter.protocol("auto", settings, app)
        servers.append(ServerThread(app, http=http).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def sidecar(vllm: StandIn, serve_sidecar: Callable[[Settings], str]) -> Callable[..., str]:
    """Start sidecars in front of the stand-in `vllm`, with Settings overrides as keywords;
    returns each one's URL. (Suites with a sidecar of their own override this fixture.)"""

    from mla_serve.sidecar.settings import Settings

    def start(**overrides: object) -> str:
        settings = Settings(vllm_url=vllm.url, poll_interval=0.1, **overrides)  # type: ignore[arg-type]
        return serve_sidecar(settings)

    return start


@pytest.fixture
def backend_log() -> Iterator[tuple[ModuleType, list[logging.LogRecord]]]:
    """The FlashInfer sparse-MLA backend module of the tree, and the warnings it logs."""
    backend = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.WARNING)
    backend.logger.addHandler(handler)
    yield backend, records
    backend.logger.removeHandler(handler)


@pytest.fixture(scope="session")
def expect(pytestconfig: pytest.Config) -> Expect:
    tree = pytestconfig.getoption("--vllm-tree")
    state = pytestconfig.getoption("--vllm-state")
    if not tree or not state:
        pytest.skip("needs --vllm-tree DIR --vllm-state pristine|patched")
    found = tree_.locate(Path(tree))
    import vllm

    assert Path(vllm.__file__).resolve().is_relative_to(found.root), "imported another vLLM"
    return Expect(CATALOG.release_of(found.version), state)
