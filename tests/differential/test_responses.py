"""vLLM's side of the sidecar against h11 as the reference client (harness.py): every class
of generated vLLM response (cases.py) through every sidecar configuration (conftest.py).

Every class must hold; where the sidecar and the reference disagree, the sidecar is fixed,
never the reference.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings

from tests.differential import cases
from tests.differential.conftest import PROFILE
from tests.differential.harness import Harness

CLASSES = {
    "length": cases.response(framing="length"),
    "chunked": cases.response(framing="chunked"),
    "close-delimited": cases.response(framing="close"),
    "interim": cases.response(interim=True),
    "streams": cases.streams(),
    "early-close": cases.early_close(),
    "content-coding": cases.content_codings(),
    "length-and-chunked": cases.length_and_chunked_response(),
    "transfer-coding": cases.transfer_codings(),
    "head-answers": cases.head_answers(),
    "switching": cases.switching(),
}


def _run(fake, targets, strategy) -> None:
    @settings(PROFILE)
    @given(case=strategy)
    def run(case):
        for target in targets:
            Harness(fake, target).response(case)

    run()


@pytest.mark.parametrize("name", list(CLASSES))
def test_responses_as_h11_reads_them(fake, targets, name):
    lane = next(target for target in targets if target.name == "httptools-lane")
    before = _lane_reads(lane)
    _run(fake, targets, CLASSES[name])
    if name == "streams":  # the lane took reads of its own (the same effects, checked above)
        assert _lane_reads(lane) > before, "the C lane took no read of the generated streams"


def _lane_reads(target) -> int:
    status = httpx.get(f"{target.sidecar.admin}/status", params={"format": "json"}, timeout=5)
    return int(status.json()["pass_through"]["lane_reads"])


def test_bytes_after_a_response_as_h11_reads_them(fake, own_targets):
    """Run on sidecars of its own: failing, it leaves their pooled connections out of step."""
    _run(fake, own_targets, cases.extra_data())
