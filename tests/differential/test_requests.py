"""The client's side of the sidecar against h11 as the reference server (harness.py): every
class of generated request (cases.py) through every sidecar configuration (conftest.py).

A class whose cases today's code gets wrong is marked xfail (strict: the mark goes when the
code is fixed), with what is wrong; the reference is never changed to pass.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.differential import cases
from tests.differential.conftest import PROFILE
from tests.differential.harness import Harness

REWRITE = "fixed in the pass-through rewrite"
CLASSES = {
    "plain": cases.plain(),
    "closing": cases.closing(),
    "codings": cases.codings(),
    "length-and-chunked": cases.length_and_chunked(),
    "major-versions": cases.major_versions(),
    "expect": cases.expects(),
    "pipelined": cases.pipelined(),
    "bytewise": cases.plain(),  # the same requests, a write for every byte
    "minor-versions": cases.minor_versions(),
    "hosts": cases.hosts(),
    "host-values": cases.host_values(),
    "http10-transfer-encoding": cases.http10_transfer_encoding(),
    "upgrades": cases.upgrades(),
    "heads": cases.heads(),
}
FAILING = {
    "length-and-chunked": "on the h11 front a request with both Content-Length and "
    "Transfer-Encoding is served and its connection kept (RFC 9112 section 6.1: closed after)",
    "minor-versions": "an HTTP/1.2 request is refused (400 on httptools, 505 on h11), where "
    "RFC 9112 section 2.3 (and h11) read it as HTTP/1.1",
    "hosts": "an HTTP/1.1 request without a Host, or with two, is served",
    "host-values": "an HTTP/1.1 request whose Host is no host[:port] is served",
    "http10-transfer-encoding": "Transfer-Encoding in an HTTP/1.0 request is served",
    "upgrades": "a request offering an Upgrade loses its body on the httptools front",
    "heads": "the response to HEAD is read as if it had a body",
}
FEW = {"bytewise": 2}  # cases that take a second each


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=f"{FAILING[name]}: "
                                                 f"{REWRITE}")] if name in FAILING else [])
     for name in CLASSES],
)  # fmt: skip
def test_requests_as_h11_reads_them(fake, targets, name):
    @settings(PROFILE, max_examples=min(PROFILE.max_examples, FEW.get(name, 10**6)))
    @given(ones=CLASSES[name], cuts=st.lists(st.integers(1, 1 << 20), max_size=6))
    def run(ones, cuts):
        if name == "bytewise":
            cuts = list(range(1, 1 << 12))
        for target in targets:
            size = sum(len(one.wire(f"{target.name}-0000-0")) for one in ones)
            Harness(fake, target).requests(ones, [cut % size for cut in cuts])

    run()
