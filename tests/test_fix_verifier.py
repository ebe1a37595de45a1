"""The sidecar's manifest verifier re-verifies in full only when a file it read changed.

A full verification parses vLLM's source for every fix's probe (0.1-0.2 s of CPU, every
minute by default); the checks in between stat the files the last full one read. Real
patched trees (tests/trees.py), real files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mla_serve.patching import journal
from mla_serve.sidecar.admin import fixes
from tests import trees


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("verifier")
    manifest = base / "manifest.json"
    target = trees.patched("0.29.0", base / "tree", manifest)
    time.sleep(1.1)  # files written within a second of a verification are not trusted to stat
    return target, manifest


def test_a_check_with_nothing_changed_stats_instead_of_verifying(patched):
    target, manifest = patched
    first = fixes.check(manifest, target)
    assert first.verified is True, first.error
    names = {Path(name).name for name, _ in first.watched}
    assert {"manifest.json", "_version.py", journal.JOURNAL} <= names
    probed = [name for name, _ in first.watched if name.endswith(".py") and "/vllm/" in name]
    assert len(probed) >= 5  # the probes' and the series' files

    report = first
    for number in range(1, fixes.FULL_EVERY):
        report = fixes.check(manifest, target, report)
        assert report.verified is True and report.verified_at == first.verified_at
        assert report.reused == number
    again = fixes.check(manifest, target, report)  # the FULL_EVERY-th: in full regardless
    assert again.verified is True and again.reused == 0
    assert again.verified_at is not None and again.verified_at > first.verified_at


def test_a_file_rewritten_with_its_size_and_times_kept_is_still_caught(patched, tmp_path):
    """Bytes changed in place, size kept, mtime put back: the ctime (which no write can
    keep) tells the verifier to verify in full, and the drift shows at once."""
    target, manifest = patched
    report = fixes.check(manifest, target)
    assert report.verified is True
    document = report.document
    changed = target / document["files"][0]["path"]
    data = changed.read_bytes()
    stat = changed.stat()
    flipped = data.replace(b"(", b"[", 1)
    assert flipped != data and len(flipped) == len(data)
    try:
        changed.write_bytes(flipped)
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        after = fixes.check(manifest, target, report)
        assert after.verified is False
        assert any(document["files"][0]["path"] in line for line in after.drift), after.drift
    finally:
        changed.write_bytes(data)
    time.sleep(1.1)
    assert fixes.check(manifest, target, after).verified is True  # failed: verified in full


def test_files_written_just_before_a_verification_are_not_trusted(tmp_path):
    manifest = tmp_path / "manifest.json"
    target = trees.patched("0.29.0", tmp_path / "tree", manifest)
    fresh = fixes.check(manifest, target)  # within a second of the tree's writing
    assert fresh.verified is True and fresh.watched == ()
    assert fixes.check(manifest, target, fresh).reused == 0  # verified in full again
