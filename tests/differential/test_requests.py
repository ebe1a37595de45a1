"""The client's side of the sidecar against h11 as the reference server (harness.py): every
class of generated request (cases.py) through every sidecar configuration (conftest.py).

Every class must hold; where the sidecar and the reference disagree, the sidecar is fixed,
never the reference.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.differential import cases
from tests.differential.conftest import PROFILE
from tests.differential.harness import Harness

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
FEW = {"bytewise": 2}  # cases that take a second each


@pytest.mark.parametrize("name", list(CLASSES))
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
