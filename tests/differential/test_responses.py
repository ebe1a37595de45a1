"""vLLM's side of the sidecar against h11 as the reference client (harness.py): every class
of generated vLLM response (cases.py) through every sidecar configuration (conftest.py).

A class whose cases today's code gets wrong is marked xfail (strict: the mark goes when the
code is fixed), with what is wrong; the reference is never changed to pass.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings

from tests.differential import cases
from tests.differential.conftest import PROFILE
from tests.differential.harness import Harness

REWRITE = "fixed in the pass-through rewrite"
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
FAILING = {
    "transfer-coding": "a response in Transfer-Encoding gzip is relayed as a plain body",
    "head-answers": "the response to HEAD is read as if it had a body",
    "switching": "a 101 from vLLM raises out of the parser (a traceback in the log)",
}


def _run(fake, targets, strategy) -> None:
    @settings(PROFILE)
    @given(case=strategy)
    def run(case):
        for target in targets:
            Harness(fake, target).response(case)

    run()


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=f"{FAILING[name]}: "
                                                 f"{REWRITE}")] if name in FAILING else [])
     for name in CLASSES],
)  # fmt: skip
def test_responses_as_h11_reads_them(fake, targets, name):
    lane = next(target for target in targets if target.name == "httptools-lane")
    before = _lane_reads(lane)
    _run(fake, targets, CLASSES[name])
    if name == "streams":  # the lane took reads of its own (the same effects, checked above)
        assert _lane_reads(lane) > before, "the C lane took no read of the generated streams"


def _lane_reads(target) -> int:
    status = httpx.get(f"{target.sidecar.admin}/status", params={"format": "json"}, timeout=5)
    return int(status.json()["pass_through"]["lane_reads"])


@pytest.mark.xfail(strict=True, reason=f"bytes after a complete vLLM response are read as the "
                   f"next request's response on the pooled connection: {REWRITE}")  # fmt: skip
def test_bytes_after_a_response_as_h11_reads_them(fake, own_targets):
    """Run on sidecars of its own: failing, it leaves their pooled connections out of step."""
    _run(fake, own_targets, cases.extra_data())
