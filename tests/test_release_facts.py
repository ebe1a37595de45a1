"""The default vLLM release is stated once, in patches/catalog.toml (`default`): every
place that needs it reads it from there, or holds a copy this test compares."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from itertools import takewhile
from pathlib import Path

from mla_serve.patching import catalog, report
from tests import trees, vllm_standin

ROOT = Path(__file__).resolve().parent.parent
PRINT = ["make", "-s", "--no-print-directory", "--eval", "print-%: ; @echo $($*)"]
DEFAULT = catalog.load().default


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_VERSION", "MAKEFLAGS")}
    return {**env, "PYTHON": sys.executable}


def _output(argv: list[str], env: dict[str, str] | None = None) -> str:
    """What `argv`, run in the checkout, prints (it must succeed within a minute)."""
    result = subprocess.run(
        argv,
        cwd=ROOT,
        env=_environment() if env is None else env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


def _make_default() -> str:
    """What `make` uses when VLLM_VERSION is not given."""
    return _output([*PRINT, "print-VLLM_VERSION", f"PYTHON={sys.executable}"])


def _script_default(script: str) -> str:
    """The value docker/<script> gives VLLM_VERSION when it is not set: its own assignment
    line, run by bash in the checkout (the script itself would build an image)."""
    text = (ROOT / "docker" / script).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if re.match(r"(PYTHON|VLLM_VERSION)=", line)]
    assert len(lines) == 2, f"docker/{script}: one PYTHON= and one VLLM_VERSION= line"
    return _output(["bash", "-euo", "pipefail", "-c", "\n".join([*lines, 'echo "$VLLM_VERSION"'])])


def _dockerfile_default() -> str:
    text = (ROOT / "docker" / "Dockerfile").read_text(encoding="utf-8")
    (value,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", text, re.M)
    return value


def _chart_app_version_release() -> str:
    text = (ROOT / "helm" / "mla-serve" / "Chart.yaml").read_text(encoding="utf-8")
    (value,) = re.findall(r'^appVersion:\s*"?[^"\s]*-vllm([^"\s]+)"?\s*$', text, re.M)
    return value


def test_every_copy_of_the_default_release_agrees_with_the_catalog():
    copies = {
        "Makefile VLLM_VERSION": _make_default(),
        "docker/build.sh VLLM_VERSION": _script_default("build.sh"),
        "docker/smoke.sh VLLM_VERSION": _script_default("smoke.sh"),
        "docker/Dockerfile ARG VLLM_VERSION": _dockerfile_default(),
        "helm/mla-serve/Chart.yaml appVersion": _chart_app_version_release(),
        "tests/trees.py DEFAULT_RELEASE": trees.DEFAULT_RELEASE,
        "tests/vllm_standin.py VERSION": vllm_standin.VERSION,
    }
    wrong = {where: value for where, value in copies.items() if value != DEFAULT}
    assert not wrong, f"patches/catalog.toml says default = {DEFAULT!r}; these differ: {wrong}"


def test_make_and_the_scripts_still_take_another_release():
    env = {**_environment(), "VLLM_VERSION": "0.29.0"}
    printed = _output([*PRINT, "print-VLLM_VERSION", "print-BASE_IMAGE"], env)
    assert printed.split() == ["0.29.0", "vllm/vllm-openai:v0.29.0"]


def test_the_catalog_reader_for_make_and_scripts(tmp_path: Path):
    command = [sys.executable, "-m", "mla_serve.patching.catalog"]
    env = {**_environment(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*command, "default"], env=env, capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, f"{DEFAULT}\n")
    bad = subprocess.run(
        [*command, "default"],
        env={**env, "MLA_SERVE_PATCHES": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"mla-serve catalog: no fix catalog at {tmp_path}/catalog.toml\n"
    usage = subprocess.run([*command, "newest"], env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage:")


def _code_blocks(path: Path) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S)


def test_the_readmes_fix_tables_are_patches_list():
    """README.md and patches/README.md show `mla-serve patches list`: each copy must be its
    output for this catalog, word for word (paste what the assertion shows)."""
    expected = report.matrix(catalog.load()) + "\n"
    for name in ("README.md", "patches/README.md"):
        tables = [b for b in _code_blocks(ROOT / name) if b.startswith("fix ")]
        assert tables, f"{name} has no copy of `patches list`"
        for table in tables:
            assert table == expected, f"{name}: the `patches list` copy should be:\n{expected}"


def test_the_readme_says_what_make_dist_applies_to_the_default_release():
    """README.md's first lines say what `make dist` builds: the default release's wheel with
    its backports, stated from the catalog ('no backport' only while the series is empty)."""
    first = _code_blocks(ROOT / "README.md")[0].splitlines()
    start = next(i for i, line in enumerate(first) if line.startswith("make dist "))
    lines = [
        first[start],
        *takewhile(lambda line: line.lstrip().startswith("#"), first[start + 1 :]),
    ]
    comment = " ".join(line.split("#", 1)[1].strip() for line in lines)
    patches = catalog.load().series(DEFAULT).patches
    assert f"vLLM {DEFAULT}'s wheel" in comment, comment
    assert f"vllm-{DEFAULT}+mla." in comment, comment
    if not patches:
        assert "no backport" in comment, f"{DEFAULT}'s series is empty: say so ({comment})"
    else:
        assert "no backport" not in comment, f"{DEFAULT} carries {len(patches)} backports"
        assert f"{len(patches)} backport" in comment, f"say that {DEFAULT} carries {patches}"


# ---- copies by hand -----------------------------------------------------------------------
# A new release or a new default is an edit to catalog.toml; what else names the release by
# hand is counted here, so the checklists in patches/README.md stay true.

RELEASES = catalog.load().releases
# The files that name the default release by hand, each held to the catalog above: the
# catalog itself, the Dockerfile's ARG default, the chart's appVersion, and the README's
# `make dist` line (test_the_readme_says_what_make_dist_applies_to_the_default_release).
DEFAULT_BY_HAND = {
    "patches/catalog.toml",
    "docker/Dockerfile",
    "helm/mla-serve/Chart.yaml",
    "README.md",
}
# Not the project's own words or copies: vLLM's patch text, the generated hash locks (one per
# release, `make lock`), the results of record (what ran, on which release), this file's
# examples.
NOT_COPIES = ("patches/vllm-", "docker/locks/", "results/", "tests/test_release_facts.py")
PENDING_RANGES: dict[str, int] = {}  # files allowed a hand-written range (none: keep it so)


def _texts() -> dict[str, str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    texts = {}
    for name in listed.split("\0"):
        path = ROOT / name
        if not name or name.startswith(NOT_COPIES) or not path.is_file():
            continue
        try:
            texts[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def default_release_named(text: str, release: str) -> bool:
    """Whether `text` names `release` as the default by hand: the catalog's `default = "X"`,
    an ARG or argument default, the `-vllmX` of the appVersion and image tags, the README's
    `make dist    # vLLM X's wheel`, or "(default: X)" in prose."""
    r = re.escape(release)
    return bool(
        re.search(
            rf"default\s*=\s*\"?{r}\b|VLLM_VERSION={r}\b|-vllm{r}\b|make dist\s+#\s*vLLM {r}'s"
            rf"|\(default:? {r}\)|default \({r}\)",
            text,
        )
    )


def supported_ranges(text: str) -> list[str]:
    """Each hand-written copy of the supported range (the catalog's first release to its last)."""
    first, last = (re.escape(r) for r in (RELEASES[0], RELEASES[-1]))
    dashes = "-\u2013\u2014"  # hyphen, en dash, em dash
    joined = rf"\s*(?:[{dashes}]|\.\.\.?|\u2026|to|through|until)\s*(?:vLLM\s+)?"
    return re.findall(rf"{first}{joined}{last}", text)


def test_the_files_that_name_the_default_release_by_hand():
    """A new default release is these files by hand (patches/README.md, "add a release"):
    no golden, no doc, no script holds another copy (they say "the default release", read the
    catalog, or use a placeholder such as the chart's `$TAG`)."""
    named = {name for name, text in _texts().items() if default_release_named(text, DEFAULT)}
    assert named == DEFAULT_BY_HAND


def test_the_supported_range_is_stated_only_by_the_catalog():
    """Say "every supported release" (and test it per release, as tests/test_vllm_facts.py
    does) rather than copy `first-last`, which a new release leaves stale."""
    copies = {name: supported_ranges(text) for name, text in _texts().items()}
    over = {n: c for n, c in copies.items() if len(c) > PENDING_RANGES.get(n, 0)}
    assert over == {}


def test_the_patterns_find_the_copies_they_are_for():
    assert default_release_named('default = "0.33.0"', "0.33.0")
    assert default_release_named("ARG VLLM_VERSION=0.33.0", "0.33.0")
    assert default_release_named("image: mla-serve:0.1.0-vllm0.33.0", "0.33.0")
    assert default_release_named("make dist  # VLLM_VERSION=0.29.0 (default: 0.33.0)", "0.33.0")
    assert default_release_named("make dist    # vLLM 0.33.0's wheel with its fix series", "0.33.0")
    assert not default_release_named("vLLM 0.33.0's default NVFP4 MoE backend", "0.33.0")
    assert not default_release_named("fetched from vLLM 0.33.0's wheel", "0.33.0")
    first, last = RELEASES[0], RELEASES[-1]
    for text in (f"{first} - {last}", f"{first}\u2013{last}", f"vLLM {first} to {last}",
                 f"({first} through {last})", f"{first}-{last}"):  # fmt: skip
        assert supported_ranges(text), text
    assert supported_ranges(f"{first} to {RELEASES[-2]}") == []
