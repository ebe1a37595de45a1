"""Facts about vLLM that the chart and the docs state for every supported release, checked on
each release's own source (the catalog's `releases`): a release added to the catalog is held
to them with no edit here, and the docs need not name the range."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mla_serve.sizing import planning
from tests import trees

REQUESTS = {
    "vllm/entrypoints/openai/chat_completion/protocol.py": "ChatCompletionRequest",
    "vllm/entrypoints/openai/completion/protocol.py": "CompletionRequest",
}


def _class(path: Path, name: str) -> ast.ClassDef:
    found = [
        node
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if isinstance(node, ast.ClassDef) and node.name == name
    ]
    assert len(found) == 1, f"{path}: {len(found)} classes {name}"
    return found[0]


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {
        node.target.id: node
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


@pytest.mark.parametrize("release", trees.RELEASES)
def test_the_loop_guards_vllm_defaults_are_request_fields(release: str) -> None:
    """`sidecar.loopGuard.vllmDefaults` (helm/mla-serve/values.yaml) sets vLLM's own
    `repetition_detection` and `thinking_token_budget` on requests: fields of both request
    kinds in every supported release."""
    root = trees.pristine(release)
    for file, name in REQUESTS.items():
        fields = _fields(_class(root / file, name))
        assert {"repetition_detection", "thinking_token_budget"} <= set(fields), (file, name)


@pytest.mark.parametrize("release", trees.RELEASES)
def test_the_memory_utilization_default_is_vllms(release: str) -> None:
    """`mla-serve plan` and the chart's `vllm.gpuMemoryUtilization` take vLLM's default."""
    cls = _class(trees.pristine(release) / "vllm/config/cache.py", "CacheConfig")
    value = _fields(cls)["gpu_memory_utilization"].value
    assert isinstance(value, ast.Call)
    (default,) = (k.value for k in value.keywords if k.arg == "default")
    assert ast.literal_eval(default) == planning.DEFAULT_UTILIZATION
