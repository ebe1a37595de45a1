"""The repository speaks of the product: no file tells how it was developed (numbered working
periods, device time, internal issue numbers, superseded copies). Upstream's issues are named
as upstream's (`vLLM issue 52448`, `vllm#52448`); pytest's session scope and aiohttp's
ClientSession are not what this is about, and the patterns leave them alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PATTERNS = {
    "a working period": re.compile(
        r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|next|last|"
        r"this) (?:working )?sessions?\b|\bsessions\b|\bsession \d+\b|"
        r"\bworking periods?\b",
        re.I,
    ),
    "an internal issue number": re.compile(
        r"(?<![vV][lL][lL][mM] )(?<![vV][lL][lL][mM]#)\bissues? #?\d{1,3}\b", re.I
    ),
    "device time": re.compile(r"\bdevice[- ](?:minutes?|time|budget)\b", re.I),
    "a superseded copy": re.compile(r"\bsuperseded\b", re.I),
}
# Not the project's words: vLLM's own patch text (its files, quoted in the backports), the
# generated hash locks, and this file's examples.
SKIP = ("patches/vllm-", "docker/locks/", "tests/test_wording.py")
PENDING: dict[str, int] = {}  # files allowed such words (none: keep it so)


def _files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sorted(f for f in listed.split("\0") if f and not f.startswith(SKIP))


def hits(text: str) -> list[str]:
    """Each development-process phrase in `text`, as `what: phrase`."""
    return [
        f"{what}: {match.group(0)!r}"
        for what, pattern in PATTERNS.items()
        for match in pattern.finditer(text)
    ]


def test_no_file_tells_how_the_project_was_developed() -> None:
    found: dict[str, list[str]] = {}
    for name in _files():
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: compressed results, the lane's build
        if got := hits(text):
            found[name] = got
    over = {name: got for name, got in found.items() if len(got) > PENDING.get(name, 0)}
    assert over == {}, f"development-process words (say what the product does instead): {over}"


@pytest.mark.parametrize(
    "text",
    [
        "the sixth session's runs",
        "kept so later sessions can compare",
        "Items refer to issue 12.",
        "(issue 19 point 2)",
        "before any device minute went",
        "the first runs are in superseded/",
    ],
)
def test_each_kind_is_caught(text: str) -> None:
    assert hits(text)


@pytest.mark.parametrize(
    "text",
    [
        "vLLM issue 52448",
        "vllm#52448 and vLLM issues 51970",
        '@pytest.fixture(scope="session")',
        "aiohttp.ClientSession(",
        "start_new_session=True",
        "the session fixture of pytest",
    ],
)
def test_what_is_not_a_development_word(text: str) -> None:
    assert hits(text) == []
