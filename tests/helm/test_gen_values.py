"""helm/tools/gen_values.py: values.yaml is the one source of the schema and the chart README.

Each test runs the generator on a copy of the chart, as `make generate` / `make check-generated`
run it on the real one.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import helm_python as helm
import pytest

from tests.helm.helm_support import CHART, REPO, run

TOOL = REPO / "helm" / "tools" / "gen_values.py"


@pytest.fixture
def chart(tmp_path: Path) -> Path:
    copy = tmp_path / "mla-serve"
    shutil.copytree(CHART, copy)
    return copy


def generate(chart: Path, *args: str) -> tuple[int, str, str]:
    result = run([sys.executable, str(TOOL), "--chart", str(chart), *args], timeout=60)
    return result.returncode, result.stdout, result.stderr


def add_to_values(chart: Path, after: str, lines: str) -> None:
    values = chart / "values.yaml"
    text = values.read_text()
    assert text.count(after) == 1
    values.write_text(text.replace(after, after + lines))


NEW_VALUE = """\
  # @schema
  # type: [integer, "null"]
  # minimum: 1
  # @schema
  # -- A value added by the test.
  newSetting: null
"""


def test_a_new_value_is_one_edit_of_values_yaml(chart: Path) -> None:
    add_to_values(chart, "  maxNumSeqs: null\n", NEW_VALUE)
    code, _, err = generate(chart, "--check")
    assert code == 1
    assert "values.schema.json is stale: run make generate" in err
    assert "README.md is stale: run make generate" in err

    code, out, err = generate(chart)
    assert code == 0, err
    assert "wrote" in out
    assert generate(chart, "--check")[0] == 0

    schema = json.loads((chart / "values.schema.json").read_text())
    node = schema["properties"]["vllm"]["properties"]["newSetting"]
    assert node == {
        "type": ["integer", "null"],
        "minimum": 1,
        "description": "A value added by the test.",
        "default": None,
    }
    readme = (chart / "README.md").read_text()
    assert (
        "| `vllm.newSetting` | integer or null | `null` | A value added by the test. (≥ 1) |"
        in (readme)
    )
    # Helm enforces the generated type.
    loaded = helm.Chart.load(str(chart))
    loaded.validate_schema({"vllm": {"newSetting": 4}})
    with pytest.raises(helm.HelmValuesError, match="at '/vllm/newSetting'"):
        loaded.validate_schema({"vllm": {"newSetting": "four"}})


def test_types_are_inferred_and_maps_closed(chart: Path) -> None:
    add_to_values(
        chart,
        "  maxNumSeqs: null\n",
        "  # -- Inferred.\n  ratio: 0.5\n  # -- A closed map.\n  nested:\n"
        "    # -- Its key.\n    flag: true\n  # -- An open map.\n  open: {}\n",
    )
    assert generate(chart)[0] == 0
    vllm = json.loads((chart / "values.schema.json").read_text())["properties"]["vllm"]
    assert vllm["properties"]["ratio"]["type"] == "number"
    nested = vllm["properties"]["nested"]
    assert nested["additionalProperties"] is False
    assert nested["properties"]["flag"]["type"] == "boolean"
    assert vllm["properties"]["open"] == {
        "type": "object",
        "description": "An open map.",
        "default": {},
    }
    loaded = helm.Chart.load(str(chart))
    with pytest.raises(helm.HelmValuesError, match="additional properties 'typo' not allowed"):
        loaded.validate_schema({"vllm": {"nested": {"typo": 1}}})


BAD: dict[str, tuple[str, str]] = {
    "no description": ("  # no dashes here\n  newSetting: 1\n", "vllm.newSetting has no `# -- `"),
    "misspelt keyword": (
        "  # @schema\n  # minimun: 1\n  # @schema\n  # -- Something.\n  newSetting: 1\n",
        "unknown @schema keyword(s) minimun",
    ),
    "null without a type": (
        "  # -- Something.\n  newSetting: null\n",
        "vllm.newSetting defaults to null: give its type in a @schema block",
    ),
    "unclosed block": (
        "  # @schema\n  # minimum: 1\n  # -- Something.\n  newSetting: 1\n",
        "a `# @schema` block is not closed",
    ),
    "block not YAML": (
        "  # @schema\n  # minimum: [1\n  # @schema\n  # -- Something.\n  newSetting: 1\n",
        "the @schema block is not YAML",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_annotations_are_one_line_and_exit_2(chart: Path, name: str) -> None:
    lines, message = BAD[name]
    add_to_values(chart, "  maxNumSeqs: null\n", lines)
    before = (chart / "values.schema.json").read_text()
    code, out, err = generate(chart)
    assert code == 2, (out, err)
    assert err.startswith("gen_values.py: error: ") and message in err, err
    assert "values.yaml:" in err  # names the line
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (chart / "values.schema.json").read_text() == before  # nothing half-written


def test_readme_needs_its_markers(chart: Path) -> None:
    readme = chart / "README.md"
    readme.write_text(readme.read_text().replace("<!-- end: values -->", ""))
    code, _, err = generate(chart)
    assert code == 2
    assert "README.md: needs the lines" in err and "<!-- end: values -->" in err


def test_a_readme_cut_mid_sentence_is_refused(chart: Path) -> None:
    """The README is whole: a paragraph or list item that stops mid-sentence (as an edit that
    lost the file's end once left it) is refused with its line, and nothing is written."""
    readme = chart / "README.md"
    whole = readme.read_text()
    assert whole.rstrip().endswith(".")
    cut = whole[: whole.rindex(" the `helm test` script")] + "\n"
    readme.write_text(cut)
    code, out, err = generate(chart)
    assert code == 2 and out == ""
    line = len(cut.splitlines())
    assert err.strip() == (
        f"gen_values.py: error: {readme}:{line}: the paragraph stops mid-sentence"
    )
    assert readme.read_text() == cut


def test_required_lists_and_combinators(chart: Path) -> None:
    """`required: [..]` is the map's own list (the map itself stays optional); anyOf and
    friends constrain the inferred type rather than replace it."""
    add_to_values(
        chart,
        "  maxNumSeqs: null\n",
        "  # @schema\n  # required: [mode]\n  # properties: {mode: {enum: [a, b]}}\n  # @schema\n"
        "  # -- A map with a required key.\n  picky:\n    mode: a\n"
        "  # @schema\n  # anyOf: [{maxItems: 0}, {contains: {const: x}}]\n  # @schema\n"
        "  # -- A list.\n  things: []\n",
    )
    assert generate(chart)[0] == 0
    vllm = json.loads((chart / "values.schema.json").read_text())["properties"]["vllm"]
    assert "picky" not in vllm.get("required", [])
    assert vllm["properties"]["picky"]["required"] == ["mode"]
    assert vllm["properties"]["things"]["type"] == "array"
    loaded = helm.Chart.load(str(chart))
    with pytest.raises(helm.HelmValuesError, match="at '/vllm/things'"):
        loaded.validate_schema({"vllm": {"things": "x"}})
