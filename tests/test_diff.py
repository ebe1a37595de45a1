"""The in-memory unified-diff engine: exact context, moved hunks, no fuzz."""

from __future__ import annotations

import pytest

from mla_serve.patching import diff

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))

PATCH = """--- a/f.py
+++ b/f.py
@@ -3,3 +3,4 @@
 line 3
 line 4
+inserted
 line 5
@@ -15,3 +16,3 @@
 line 15
-line 16
+changed 16
 line 17
"""


def test_applies_and_reverses_exactly():
    (file_diff,) = diff.parse(PATCH)
    patched = diff.apply(file_diff, ORIGINAL)
    assert "line 4\ninserted\nline 5\n" in patched
    assert "changed 16\n" in patched and "line 16\n" not in patched
    assert diff.apply(file_diff.reversed(), patched) == ORIGINAL


def test_moved_hunks_still_apply_at_their_new_place():
    (file_diff,) = diff.parse(PATCH)
    shifted = "header\nheader\n" + ORIGINAL
    assert diff.apply(file_diff, shifted) == "header\nheader\n" + diff.apply(file_diff, ORIGINAL)


def test_changed_context_is_a_conflict_not_fuzz():
    (file_diff,) = diff.parse(PATCH)
    with pytest.raises(diff.HunkMismatch, match="hunk #2"):
        diff.apply(file_diff, ORIGINAL.replace("line 17\n", "line 17 edited\n"))


def test_applying_twice_is_a_conflict():
    (file_diff,) = diff.parse(PATCH)
    with pytest.raises(diff.HunkMismatch):
        diff.apply(file_diff, diff.apply(file_diff, ORIGINAL))


def test_crlf_bytes_are_kept():
    (file_diff,) = diff.parse(PATCH.replace("\n", "\r\n"))
    patched = diff.apply(file_diff, ORIGINAL.replace("\n", "\r\n"))
    assert "inserted\r\n" in patched and "\n" not in patched.replace("\r\n", "")


def test_missing_file_and_garbage_are_reported():
    (file_diff,) = diff.parse(PATCH)
    with pytest.raises(FileNotFoundError):
        diff.apply(file_diff, None)
    with pytest.raises(diff.DiffError):
        diff.parse("no diff here\n")
    with pytest.raises(diff.DiffError):
        diff.parse("--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n line\n")
