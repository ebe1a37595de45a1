"""results/ holds the results of record (results/README.md): one folder per area, each README
naming the command that reproduces its result; every path the READMEs cite is there; no
folder is an older or dated copy of another (history is git's); large files are compressed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
AREAS = ("e2e", "gpu", "bench", "hostile", "status")
# How a README names the command of its result.
COMMAND = re.compile(r"`(?:make |bash tests/|python3? -m |\.venv/bin/python -m |HOSTILE_)[^`]*`")
# A folder named after when it ran, or after an earlier or later attempt.
DIARY = re.compile(
    r"\d{4}-\d{2}-\d{2}|supersed(?:ed)?|(?:^|[-_])(?:rerun|first|old|new|before|after|call\d*)$"
)
# Files over this size are xz-compressed, but the JSON records the tools read and screenshots
# (PNG is compressed already; a viewer opens it as it is).
LARGE = 16 * 1024
COMPRESSED_ALREADY = (".xz", ".json", ".md", ".png")
# A results path in backticks (where results are now, or where they were), or a relative link.
CITED = re.compile(r"`((?:tests/[a-z]+/)?results/[^`\s]*)`|\]\(([^)#\s]+)")
PENDING: set[tuple[str, str]] = set()  # (file, citation) allowed to miss (none: keep it so)


def _readmes() -> list[Path]:
    return sorted(ROOT.glob("*.md")) + sorted(
        p
        for p in ROOT.rglob("*.md")
        if p.parent != ROOT and not {".venv", ".cache", "build", "node_modules"} & set(p.parts)
    )


def test_each_area_has_a_readme_with_its_command() -> None:
    assert (RESULTS / "README.md").is_file()
    for area in AREAS:
        readme = RESULTS / area / "README.md"
        assert readme.is_file(), f"results/{area}: no README"
        assert COMMAND.search(readme.read_text()), f"results/{area}/README.md names no command"
    for readme in RESULTS.rglob("README.md"):
        text = readme.read_text()
        assert COMMAND.search(text) or readme == RESULTS / "README.md", readme


def test_no_folder_or_file_is_a_copy_by_date_or_attempt() -> None:
    diary = [
        str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if DIARY.search(p.name.split(".")[0])
    ]
    assert diary == [], "keep the current result; earlier ones are in git's history"


def test_large_files_are_compressed() -> None:
    large = [
        str(p.relative_to(ROOT))
        for p in RESULTS.rglob("*")
        if p.is_file() and p.stat().st_size > LARGE and p.suffix not in COMPRESSED_ALREADY
    ]
    assert large == [], f"xz -9e them (any xz reader opens them): {large}"


def test_every_cited_path_is_there() -> None:
    """Every results path a README cites in backticks, and every file it links to, is there
    (for a pattern: something matches it)."""
    missing = []
    for readme in _readmes():
        for match in CITED.finditer(readme.read_text()):
            quoted, link = match.groups()
            if quoted:
                target = ROOT / quoted.rstrip(".,:;")
            elif link and not re.match(r"[a-z]+:", link):
                target = (readme.parent / link).resolve()
            else:
                continue
            cited = (str(readme.relative_to(ROOT)), str(target.relative_to(ROOT)))
            if not target.exists() and not list(ROOT.glob(cited[1])) and cited not in PENDING:
                missing.append(": ".join(cited))
    assert missing == []


def test_the_recorded_streams_the_benchmarks_replay_are_kept() -> None:
    from tests.bench.passthrough.replay import RECORDINGS

    recordings = sorted(ROOT.glob(RECORDINGS))
    assert len(recordings) >= 10, recordings
    assert {p.parent.parent.name for p in recordings} == {"h200", "h200x2"}
