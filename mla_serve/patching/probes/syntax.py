"""Syntax-tree helpers the probes share, and the vLLM files more than one probe reads."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from mla_serve.patching.tree import VllmTree

FLASHINFER_SPARSE = "vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py"
INDEXER = "vllm/v1/attention/backends/mla/indexer.py"


def parse_module(tree: VllmTree, relative: str) -> ast.Module | None:
    """The file's syntax tree, or None when the tree has no such file."""
    source = tree.read(relative)
    return None if source is None else ast.parse(source, filename=relative)


def find_function(module: ast.Module, qualified: str) -> ast.FunctionDef | None:
    """`name` or `Class.name`, at module level."""
    *owner, name = qualified.split(".")
    scope: list[ast.stmt] = module.body
    if owner:
        classes = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner[0]]
        if not classes:
            return None
        scope = classes[0].body
    for node in scope:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and called_name(n) == name]


def with_parents(root: ast.AST) -> Iterator[tuple[ast.AST, list[ast.AST]]]:
    stack: list[tuple[ast.AST, list[ast.AST]]] = [(root, [])]
    while stack:
        node, parents = stack.pop()
        yield node, parents
        for child in ast.iter_child_nodes(node):
            stack.append((child, [*parents, node]))
