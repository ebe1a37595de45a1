#!/usr/bin/env python3
"""Write values.schema.json and README.md's tables from the chart's annotated values.yaml.

values.yaml is the one source: each key's JSON Schema is the `# @schema` block above it
(dadav/helm-schema's annotation: YAML between two `# @schema` lines; `# @schema.root` for the
root, e.g. its `definitions`), its description the `# -- ` comment (norwoodj/helm-docs'
convention, with `# @default -- text` where the default needs words). Without a `type`, the
type is inferred from the default; a map whose annotation gives neither `$ref`, `properties`
nor `additionalProperties` is walked key by key and closed (additionalProperties: false), an
empty map is open, as helm-schema does. `required: true` adds the key to its parent's list.
Every key needs a description; a misspelt keyword is refused, so nothing is silently ignored.

Rules across values (the parallel layout, ports, the drain) are not in the schema: they live
in templates/_validate.tpl, which Helm runs on every install, upgrade and template.

Usage: python helm/tools/gen_values.py [--check]
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import generated
import yaml
from generated import GenerationError

Schema = dict[str, Any]

# helm-schema's annotation keywords (its README's table), all JSON Schema draft 7.
KEYWORDS = frozenset(
    {
        "type",
        "title",
        "description",
        "default",
        "properties",
        "pattern",
        "format",
        "required",
        "deprecated",
        "items",
        "enum",
        "const",
        "examples",
        "minimum",
        "exclusiveMinimum",
        "maximum",
        "exclusiveMaximum",
        "multipleOf",
        "additionalProperties",
        "patternProperties",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "contains",
        "additionalItems",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependencies",
        "definitions",
        "$comment",
    }
)
# Keywords that already say what a value is, so no type is inferred beside them.
TYPED = frozenset({"type", "$ref", "const"})

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_-]*):(?:\s|$)")
COMMENT_LINE = re.compile(r"^(?P<indent> *)#(?P<text>.*)$")


@dataclass
class Key:
    path: tuple[str, ...]
    where: str  # file:line, for messages
    value: Any
    annotation: Schema
    description: str
    default_text: str | None
    walked: bool = False
    children: list[Key] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ".".join(self.path)


@dataclass
class Comments:
    """The comment lines directly above a key (a blank line ends a block)."""

    lines: list[str] = field(default_factory=list)

    def parse(self, where: str) -> tuple[Schema | None, str, str | None]:
        """(annotation, description, @default text) of the block."""
        schema_lines: list[str] = []
        blocks = 0
        inside = False
        description: list[str] | None = None
        default_text = None
        for text in self.lines:
            stripped = text.strip()
            if stripped == "@schema":
                inside = not inside
                blocks += 0 if inside else 1
                continue
            if inside:
                schema_lines.append(text[1:] if text.startswith(" ") else text)
            elif stripped.startswith("@default --"):
                default_text = stripped.removeprefix("@default --").strip()
            elif stripped == "--" or stripped.startswith("-- "):
                description = [stripped[2:].strip()]
            elif description is not None:
                description.append(stripped)
        if inside:
            raise GenerationError(f"{where}: a `# @schema` block is not closed")
        if blocks > 1:
            raise GenerationError(f"{where}: more than one `# @schema` block")
        annotation = _load_annotation(schema_lines, where) if blocks else None
        return annotation, " ".join(part for part in description or [] if part), default_text


def _load_annotation(lines: list[str], where: str) -> Schema:
    try:
        loaded = yaml.safe_load("\n".join(lines))
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise GenerationError(f"{where}: the @schema block is not YAML ({problem})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise GenerationError(f"{where}: the @schema block must be a mapping")
    unknown = sorted(set(loaded) - KEYWORDS)
    if unknown:
        raise GenerationError(f"{where}: unknown @schema keyword(s) {', '.join(unknown)}")
    return loaded


def parse(text: str, source: str = "values.yaml") -> tuple[Schema, list[Key]]:
    """The root annotation and the top-level keys (with their walked children)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise GenerationError(f"{source}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise GenerationError(f"{source}: the top level must be a mapping")
    root: Schema = {}
    top: list[Key] = []
    stack: list[tuple[int, Key]] = []  # walked maps enclosing the current line
    skip_below: int | None = None  # inside a value that is not walked: lines indented deeper
    comments = Comments()
    root_lines: list[str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{number}"
        comment = COMMENT_LINE.match(line)
        if comment:
            body = comment["text"]
            if body.strip() == "@schema.root":
                if root_lines is None:
                    root_lines = []
                else:
                    root = _load_annotation(root_lines, where)
                    root_lines = None
                continue
            if root_lines is not None:
                root_lines.append(body[1:] if body.startswith(" ") else body)
            elif skip_below is None or len(comment["indent"]) <= skip_below:
                comments.lines.append(body)
            continue
        if not line.strip():
            comments = Comments()
            continue
        indent = len(line) - len(line.lstrip(" "))
        if skip_below is not None and indent > skip_below:
            continue
        skip_below = None
        match = KEY_LINE.match(line)
        if not match:
            raise GenerationError(f"{where}: expected `key: value` (lists belong to a key)")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else None
        path = (*parent.path, match["key"]) if parent else (match["key"],)
        value = _lookup(data, path, where)
        annotation, description, default_text = comments.parse(where)
        comments = Comments()
        key = Key(path, where, value, annotation or {}, description, default_text)
        if not description:
            raise GenerationError(f"{where}: {key.name} has no `# -- ` description")
        key.walked = (
            isinstance(value, dict)
            and bool(value)
            and not {"$ref", "properties", "additionalProperties"} & set(key.annotation)
        )
        (parent.children if parent else top).append(key)
        if key.walked:
            stack.append((indent, key))
        else:
            skip_below = indent
    if root_lines is not None:
        raise GenerationError(f"{source}: a `# @schema.root` block is not closed")
    return root, top


def _lookup(data: dict[str, Any], path: tuple[str, ...], where: str) -> Any:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            raise GenerationError(f"{where}: cannot place {'.'.join(path)} (indentation?)")
        node = node[part]
    return node


def _inferred_type(key: Key) -> str:
    value = key.value
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise GenerationError(
        f"{key.where}: {key.name} defaults to null: give its type in a @schema block"
    )


def key_schema(key: Key) -> tuple[Schema, bool]:
    """The key's schema and whether its parent must require it."""
    annotation = dict(key.annotation)
    required = annotation.pop("required", False)
    out: Schema = {}
    if key.walked:
        properties: Schema = {}
        needed: list[str] = []
        for child in key.children:
            properties[child.path[-1]], child_required = key_schema(child)
            if child_required:
                needed.append(child.path[-1])
        out = {"type": "object", "additionalProperties": False, "properties": properties}
        if needed:
            out["required"] = needed
    elif not TYPED & set(annotation):
        out["type"] = _inferred_type(key)
    if isinstance(required, list):
        out["required"] = required
    elif not isinstance(required, bool):
        raise GenerationError(f"{key.where}: {key.name}: required is true, false or a list")
    out.update(annotation)
    if "$ref" in out and set(out) - {"$ref", "description", "default", "title", "$comment"}:
        # Draft 7 ignores a $ref's siblings: apply the reference and the rest together.
        out["allOf"] = [{"$ref": out.pop("$ref")}, *out.get("allOf", [])]
    out["description"] = key.description
    if not key.walked:
        out["default"] = key.value
    return out, required is True


def schema(root: Schema, keys: list[Key]) -> Schema:
    top = Key((), "", {}, {}, "", None)
    top.walked = True
    top.children = keys
    body, _ = key_schema(top)
    del body["description"]
    return {"$schema": "http://json-schema.org/draft-07/schema#", **root, **body}


# --- README ---------------------------------------------------------------------------------


def _resolve(node: Schema, root: Schema) -> Schema:
    """A key's schema with its $ref (or allOf of one $ref) merged in, for display."""
    merged = dict(node)
    refs = [merged.pop("$ref")] if "$ref" in merged else []
    if "allOf" in merged:
        refs += [part["$ref"] for part in merged.pop("allOf") if "$ref" in part]
    for ref in refs:
        target = root["definitions"][ref.removeprefix("#/definitions/")]
        merged = {**_resolve(target, root), **{k: v for k, v in merged.items() if k != "type"}}
    return merged


def _code(value: Any) -> str:
    return "`" + json.dumps(value, ensure_ascii=False) + "`"


def type_text(node: Schema) -> str:
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return " or ".join(kinds)


def constraint_text(node: Schema) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(_code(v) for v in node["enum"]))
    if "const" in node:
        parts.append("must be " + _code(node["const"]))
    for word, sign in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ):
        if word in node:
            parts.append(f"{sign} {node[word]}")
    if node.get("minLength") == 1:
        parts.append("not empty")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    items = node.get("items", {})
    if "enum" in items:
        parts.append("items: " + ", ".join(_code(v) for v in items["enum"]))
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def values_table(root: Schema, keys: list[Key], body: Schema) -> str:
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]

    def visit(key: Key, node: Schema) -> None:
        shown = _resolve(node, root)
        if key.walked:
            default = ""
        elif key.default_text is not None:
            default = key.default_text
        else:
            default = _code(key.value)
        limits = constraint_text(shown)
        description = key.description + (f" ({limits})" if limits else "")
        rows.append(
            f"| `{key.name}` | {type_text(shown)} | {_cell(default)} | {_cell(description)} |"
        )
        for child in key.children:
            visit(child, node["properties"][child.path[-1]])

    for key in keys:
        visit(key, body["properties"][key.path[-1]])
    return "\n".join(rows)


def _layout(values: dict[str, Any]) -> str:
    p = values["parallelism"]
    parts = [
        f"{name}{p[key]}"
        for name, key in (
            ("TP", "tensor"),
            ("PCP", "prefillContext"),
            ("DCP", "decodeContext"),
            ("PP", "pipeline"),
            ("DP", "data"),
        )
        if p[key] > 1 or key == "tensor"
    ]
    return " x ".join(parts) + (", EP" if p["expert"] else "")


def profiles_table(chart: Path, defaults: dict[str, Any]) -> str:
    rows = ["| Profile | Model | Layout | GPUs | About |", "|---|---|---|---|---|"]
    for path in sorted((chart / "profiles").glob("*.yaml")):
        text = path.read_text()
        overlay = yaml.safe_load(text) or {}
        values = _merge(defaults, overlay)
        first = next((line for line in text.splitlines() if line.startswith("#")), "")
        about = first.lstrip("#").strip()
        if not about:
            raise GenerationError(f"{generated.shown(path)}:1: no leading comment")
        gpu = values["gpu"]
        gpus = f"{gpu['product'] or 'any'} ({gpu['arch'] or 'any arch'}, {gpu['perNode']}/node)"
        rows.append(
            f"| [`{path.stem}`](profiles/{path.name}) | `{values['model']['name']}` | "
            f"{_layout(values)} | {_cell(gpus)} | {_cell(about)} |"
        )
    return "\n".join(rows)


def _merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def splice(text: str, name: str, body: str, source: str) -> str:
    """Replace what lies between `<!-- generated: NAME -->` and `<!-- end: NAME -->`."""
    begin = f"<!-- generated: {name} (make generate; edit values.yaml and profiles/) -->"
    end = f"<!-- end: {name} -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise GenerationError(f"{source}: needs the lines {begin!r} and {end!r}")
    return text[: start + len(begin)] + "\n" + body + "\n" + text[stop:]


# How a paragraph of prose (or a list item) may end: a sentence's end, or a colon before a block.
ENDS = (".", ":", "!", "?", ".)", ".**", ".`")


def cut_paragraphs(text: str) -> list[int]:
    """The lines (1-based) where a paragraph or list item of `text` stops mid-sentence, outside
    code blocks, tables, headings and the generated parts' markers."""
    cut: list[int] = []
    fenced = False
    block: list[tuple[int, str]] = []

    def close() -> None:
        if block:
            number, last = block[-1]
            first = block[0][1]
            if not first.startswith(("#", "|", "<!--")) and not last.rstrip().endswith(ENDS):
                cut.append(number)
        block.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith(("- ", "#", "|", "<!--")):
            close()
        if line.strip():
            block.append((number, line))
    close()
    return cut


def check_whole(text: str, source: str) -> str:
    """`text` unless a paragraph of it stops mid-sentence (a README cut while it was edited)."""
    cut = cut_paragraphs(text)
    if cut:
        raise GenerationError(f"{source}:{cut[0]}: the paragraph stops mid-sentence")
    if not text.endswith("\n"):
        raise GenerationError(f"{source}: does not end with a newline")
    return text


def build(chart: Path) -> dict[Path, str]:
    """values.schema.json and README.md of `chart`, from its values.yaml and profiles/."""
    values = chart / "values.yaml"
    text = values.read_text()
    root, keys = parse(text, generated.shown(values))
    body = schema(root, keys)
    readme_path = chart / "README.md"
    readme = readme_path.read_text()
    source = generated.shown(readme_path)
    readme = splice(readme, "values", values_table(root, keys, body), source)
    readme = splice(readme, "profiles", profiles_table(chart, yaml.safe_load(text)), source)
    check_whole(readme, source)
    return {
        chart / "values.schema.json": json.dumps(body, indent=2, ensure_ascii=False) + "\n",
        readme_path: readme,
    }


def main() -> int:
    return generated.main(build, (__doc__ or "").splitlines()[0], Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
