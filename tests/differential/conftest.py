"""The differential harness' set-up: the sidecar configurations under test, in front of one
fake vLLM, and hypothesis' settings.

Each configuration is `mla-serve sidecar` through its real CLI (tests/hostile/conftest.py's
`Sidecar`: the suite's short timeouts): the default httptools front with the C lane on and
off, and the h11 front (`--http h11`) with the lane on and off. Every generated case runs
through all four.

Hypothesis runs a fixed number of examples per class with a fixed seed and no example
database (`derandomize`): the same cases on every run, so a failure is reproducible from the
test's name. `DIFFERENTIAL_EXAMPLES` sets
the number (default 10); `DIFFERENTIAL_PROFILE=explore` draws new cases each run, keeps them
in hypothesis' database and shrinks a failure to its smallest case.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.differential.harness import Target
from tests.hostile.conftest import Sidecar
from tests.hostile.fake_vllm import FakeVllm

EXAMPLES = int(os.environ.get("DIFFERENTIAL_EXAMPLES", "10"))
CONFIGS = {
    "httptools-lane": ("--lane", "on"),
    "httptools-python": ("--lane", "off"),
    "h11-lane": ("--http", "h11", "--lane", "on"),
    "h11-python": ("--http", "h11", "--lane", "off"),
}
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile(
    "fixed", max_examples=EXAMPLES, derandomize=True, database=None, print_blob=True,
    deadline=timedelta(seconds=20), phases=[Phase.explicit, Phase.generate],
    suppress_health_check=SLOW,
)  # fmt: skip
settings.register_profile(
    "explore", max_examples=max(EXAMPLES, 200), deadline=timedelta(seconds=20),
    suppress_health_check=SLOW,
)  # fmt: skip
PROFILE = settings.get_profile(os.environ.get("DIFFERENTIAL_PROFILE", "fixed"))


def start(fake: FakeVllm, logs: Path) -> list[Target]:
    started = [Sidecar(fake.url, logs / f"{name}.log", *flags) for name, flags in CONFIGS.items()]
    try:
        for one in started:
            one.wait_up()
            one.wait_ready()
    except BaseException:
        for one in started:
            one.stop()
        raise
    return [Target(name, one) for name, one in zip(CONFIGS, started, strict=True)]


@pytest.fixture(scope="session")
def fake() -> Iterator[FakeVllm]:
    vllm = FakeVllm().start()
    yield vllm
    vllm.stop()


@pytest.fixture(scope="session")
def targets(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Target]]:
    started = start(fake, tmp_path_factory.mktemp("differential"))
    yield started
    for one in started:
        one.sidecar.stop()


@pytest.fixture
def own_targets(fake: FakeVllm, tmp_path: Path) -> Iterator[list[Target]]:
    """Sidecars for one test alone: for cases that, failing, would leave a connection to
    vLLM out of step for the tests after them."""
    started = start(fake, tmp_path)
    yield started
    for one in started:
        one.sidecar.stop()
