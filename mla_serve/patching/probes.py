"""Postcondition checks: is a fix's behaviour present in a vLLM tree?

A patch tool's exit code only says that text was replaced. A probe reads the
code of the tree (by its syntax tree, without importing vLLM, so it runs on any
tree and needs no torch or GPU) and checks the property the fix is about: the
guard around the event wait, the capacity row stride, the rejected backend
combination. Each probe accepts any implementation with that property: ours on
affected releases and upstream's own on releases that carry the fix. Where the
affected code does not exist, the probe checks that absence, so a backport of
the buggy code would fail it.

Where the property is arithmetic (the workspace size), the probe runs the
tree's own function on seed 002's reported figures.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mla_serve.patching.catalog import ReleaseStatus, Status
from mla_serve.patching.tree import TreeError, VllmTree

INDEX_GROUP = "vllm/v1/attention/backends/mla/index_group.py"
HISPARSE_RUNTIME = "vllm/v1/hisparse/runtime.py"
FORWARD_CONTEXT = "vllm/forward_context.py"
FLASHINFER_SPARSE = "vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py"
DCP_OPS = ("vllm/v1/attention/ops/dcp.py", "vllm/v1/attention/ops/common.py")
BACKEND_UTILS = "vllm/v1/attention/backends/utils.py"
INDEXER = "vllm/v1/attention/backends/mla/indexer.py"
DSV4_ATTENTION = "vllm/models/deepseek_v4/attention.py"
DSV4_SPARSE_MLA = "vllm/models/deepseek_v4/sparse_mla.py"

# Seed 002: 64 heads per rank, DCP 4, vLLM's 394 MiB default workspace.
SEED_002_WORKSPACE = {4096: 2_561_671_168, 32768: 17_594_056_704}
DEFAULT_WORKSPACE_BYTES = 394 * 1024 * 1024


@dataclass(frozen=True)
class ProbeResult:
    passed: bool
    detail: str
    # The buggy code is there, but only where vLLM's own code paths are expected not to
    # reach it. Not a pass: it proves `not-affected` only with the catalog's verdict for the
    # release (`not_affected` in [fix.releases], e.g. after a GPU run), never on its own.
    unreachable: bool = False

    @property
    def word(self) -> str:
        if self.passed:
            return "pass"
        return "unreachable" if self.unreachable else "fail"


def proves(claim: ReleaseStatus, result: ProbeResult) -> bool:
    """Whether a probe's result on a tree (its series applied) bears out the catalog's claim:
    the fix is there (patched, upstream), the bug is absent or, with a verdict, unreachable
    (not-affected), or the bug is there (affected: no backport)."""
    if claim.status is Status.AFFECTED:
        return not result.passed
    if claim.status is Status.NOT_AFFECTED and claim.verdict:
        return result.passed or result.unreachable
    return result.passed


Probe = Callable[[VllmTree], ProbeResult]
PROBES: dict[str, Probe] = {}


def probe(fix_id: str) -> Callable[[Probe], Probe]:
    def register(function: Probe) -> Probe:
        PROBES[fix_id] = function
        return function

    return register


def run(fix_id: str, tree: VllmTree) -> ProbeResult:
    try:
        return PROBES[fix_id](tree)
    except SyntaxError as error:
        return ProbeResult(False, f"{error.filename or 'a file'} does not parse: {error.msg}")
    except TreeError:
        raise  # the tree itself is unusable (a path outside it, a file that is not UTF-8)
    except Exception as error:  # a probe must fail closed on code it cannot judge
        return ProbeResult(False, f"probe raised {type(error).__name__}: {error}")


# --- syntax helpers -------------------------------------------------------


def _module(tree: VllmTree, relative: str) -> ast.Module | None:
    source = tree.read(relative)
    return None if source is None else ast.parse(source, filename=relative)


def _function(module: ast.Module, qualified: str) -> ast.FunctionDef | None:
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


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and _called_name(n) == name]


def _with_parents(root: ast.AST) -> Iterator[tuple[ast.AST, list[ast.AST]]]:
    stack: list[tuple[ast.AST, list[ast.AST]]] = [(root, [])]
    while stack:
        node, parents = stack.pop()
        yield node, parents
        for child in ast.iter_child_nodes(node):
            stack.append((child, [*parents, node]))


def _is_topk_event(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "logical_topk_ready"


def _guarded_by_not_piecewise(call: ast.Call, parents: list[ast.AST]) -> bool:
    """Inside the body of an `if` whose test says `not in_piecewise_cudagraph()`."""
    chain = [*parents, call]
    for depth, parent in enumerate(parents):
        if not isinstance(parent, ast.If) or chain[depth + 1] not in parent.body:
            continue
        for node in ast.walk(parent.test):
            if (
                isinstance(node, ast.UnaryOp)
                and isinstance(node.op, ast.Not)
                and _calls(node.operand, "in_piecewise_cudagraph")
            ):
                return True
    return False


# --- the probes -------------------------------------------------------------


@probe("piecewise-topk-event")
def _piecewise_topk_event(tree: VllmTree) -> ProbeResult:
    """No eager wait on the graph-local `logical_topk_ready` event in piecewise mode."""
    modules = {rel: _module(tree, rel) for rel in (INDEX_GROUP, HISPARSE_RUNTIME)}
    users = {
        rel: module
        for rel, module in modules.items()
        if module is not None and any(_is_topk_event(n) for n in ast.walk(module))
    }
    if not users:
        return ProbeResult(True, "no logical_topk_ready event in this release (code absent)")
    forward_context = _module(tree, FORWARD_CONTEXT)
    if forward_context is None or _function(forward_context, "in_piecewise_cudagraph") is None:
        return ProbeResult(False, f"{FORWARD_CONTEXT} has no in_piecewise_cudagraph()")
    for rel, module in users.items():
        for node, parents in _with_parents(module):
            if not isinstance(node, ast.Call):
                continue
            name = _called_name(node)
            waits = name == "wait_event" and node.args and _is_topk_event(node.args[0])
            if waits and not _guarded_by_not_piecewise(node, parents):
                return ProbeResult(
                    False,
                    f"{rel}:{node.lineno} waits on logical_topk_ready without a "
                    "`not in_piecewise_cudagraph()` guard",
                )
            owner = node.func.value if isinstance(node.func, ast.Attribute) else None
            if name == "record" and owner is not None and _is_topk_event(owner):
                function = next(
                    (p for p in reversed(parents) if isinstance(p, ast.FunctionDef)), None
                )
                checks = _calls(function, "in_piecewise_cudagraph") if function else []
                if not any(c.lineno < node.lineno for c in checks):
                    return ProbeResult(
                        False,
                        f"{rel}:{node.lineno} records logical_topk_ready without "
                        "checking in_piecewise_cudagraph() first",
                    )
    return ProbeResult(True, "every logical_topk_ready record/wait is skipped in piecewise mode")


@probe("dcp-workspace-sizing")
def _dcp_workspace_sizing(tree: VllmTree) -> ProbeResult:
    """The sparse-MLA workspace grows with DCP; seed 002's figures come out byte-exact."""
    module = _module(tree, FLASHINFER_SPARSE)
    if module is None:
        return ProbeResult(True, "no FlashInfer sparse MLA backend in this release (code absent)")
    function = _function(module, "compute_trtllm_sparse_mla_workspace_bytes")
    if function is None:
        return ProbeResult(False, "no compute_trtllm_sparse_mla_workspace_bytes(): fixed 394 MiB")
    compute = _isolate(module, function)
    for tokens, expected in SEED_002_WORKSPACE.items():
        got = compute(DEFAULT_WORKSPACE_BYTES, 4, 64, tokens)
        if got != expected:
            return ProbeResult(False, f"DCP4/64 heads/{tokens} tokens gives {got}, not {expected}")
    if compute(DEFAULT_WORKSPACE_BYTES, 1, 64, 32768) != DEFAULT_WORKSPACE_BYTES:
        return ProbeResult(False, "workspace changes without DCP")
    buffer = _function(module, "_get_workspace_buffer")
    if buffer is None or len(buffer.args.args) < 2:
        return ProbeResult(False, "_get_workspace_buffer() cannot be asked for a minimum size")
    preallocates = any(
        isinstance(node, ast.FunctionDef)
        and node.name == "__init__"
        and _calls(node, "_get_workspace_buffer")
        for node in ast.walk(module)
    )
    if not preallocates:
        return ProbeResult(False, "no metadata builder sizes the workspace before capture")
    return ProbeResult(True, "DCP-aware size, byte-exact on seed 002; preallocated in the builder")


def _isolate(module: ast.Module, function: ast.FunctionDef) -> Callable[..., int]:
    """Run one pure-arithmetic function of a module with its literal constants only."""
    namespace: dict[str, object] = {}
    for node in module.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            if names <= set(namespace):
                statement = ast.Module(body=[node], type_ignores=[])
                exec(compile(statement, "<probe>", "exec"), namespace)  # noqa: S102
    definition = ast.Module(body=[function], type_ignores=[])
    exec(compile(ast.fix_missing_locations(definition), "<probe>", "exec"), namespace)  # noqa: S102
    return namespace[function.name]  # type: ignore[return-value]


@probe("dcp-empty-shard-mask")
def _dcp_empty_shard_mask(tree: VllmTree) -> ProbeResult:
    """A DCP rank with no local sequences masks every row instead of indexing seq_lens[-1]."""
    for rel in DCP_OPS:
        module = _module(tree, rel)
        function = _function(module, "mask_dcp_empty_shards_") if module else None
        if function is None:
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.If)
                and _tests_empty(node.test, "seq_lens")
                and any(isinstance(s, ast.Return) for s in node.body)
                and _calls(node, "fill_")
            ):
                return ProbeResult(True, f"{rel}: empty seq_lens fills -inf and returns")
        return ProbeResult(False, f"{rel}: mask_dcp_empty_shards_ indexes an empty seq_lens")
    return ProbeResult(True, "no mask_dcp_empty_shards_ in this release (code absent)")


def _tests_empty(test: ast.expr, name: str) -> bool:
    """`name.shape[0] == 0`, `name.numel() == 0` or `not name.numel()`."""
    mentions = any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(test))
    zero = any(
        isinstance(n, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value == 0 for c in n.comparators)
        for n in ast.walk(test)
    ) or (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not))
    sized = any(
        (isinstance(n, ast.Attribute) and n.attr == "shape")
        or (isinstance(n, ast.Call) and _called_name(n) in ("numel", "size"))
        for n in ast.walk(test)
    )
    return mentions and zero and sized


@probe("pcp-dcp-warmup-keys")
def _pcp_dcp_warmup_keys(tree: VllmTree) -> ProbeResult:
    """Every key the PCP+DCP prefill path launches with is warmed up before serving."""
    module = _module(tree, INDEXER)
    if module is None:
        return ProbeResult(True, "no sparse indexer in this release (code absent)")
    if _function(module, "build_pcp_global_chunk_plan") is None:
        return ProbeResult(
            True,
            "no PCP global chunk plan: prefill launches with the rank's own DCP key, "
            "which is warmed (code absent)",
        )
    warmup = _function(module, "BuildPrefillChunkMetadataKernel.get_warmup_keys")
    if warmup is None:
        return ProbeResult(False, "BuildPrefillChunkMetadataKernel has no warmup keys")
    normalized = any(
        {k.arg: getattr(k.value, "value", None) for k in call.keywords}
        == {"DCP_RANK": 0, "DCP_WORLD": 1}
        for call in _calls(warmup, "dict")
    )
    aligned = sum(
        1
        for call in _calls(warmup, "from_alignment")
        if {k.arg for k in call.keywords} >= {"uncompressed_seq_lens", "cu_compressed_seq_lens"}
    )
    if not normalized:
        return ProbeResult(False, "warmup keys miss the normalized DCP key (rank 0, world 1)")
    if aligned < 4:
        return ProbeResult(False, f"{aligned} of 4 pointer-alignment variants are warmed")
    return ProbeResult(True, "normalized DCP key and 4 pointer-alignment variants warmed")


@probe("pcp-dcp-backend-reject")
def _pcp_dcp_backend_reject(tree: VllmTree) -> ProbeResult:
    """FLASHINFER_MLA_SPARSE refuses PCP+DCP and names FLASHMLA_SPARSE as the fallback."""
    module = _module(tree, FLASHINFER_SPARSE)
    if module is None:
        return ProbeResult(True, "no FlashInfer sparse MLA backend in this release (code absent)")
    function = _function(module, "FlashInferMLASparseTRTLLMBackend.supports_combination")
    if function is None:
        return ProbeResult(False, "FlashInferMLASparseTRTLLMBackend.supports_combination missing")
    attributes = {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute)}
    strings = " ".join(
        n.value
        for n in ast.walk(function)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )
    if not {"prefill_context_parallel_size", "decode_context_parallel_size"} <= attributes:
        return ProbeResult(False, "supports_combination does not look at PCP and DCP sizes")
    if "FLASHMLA_SPARSE" not in strings:
        return ProbeResult(False, "the refusal does not name the FLASHMLA_SPARSE fallback")
    return ProbeResult(True, "PCP+DCP refused with FLASHMLA_SPARSE named as the fallback")


@probe("dcp-rank-device-tensor")
def _dcp_rank_device_tensor(tree: VllmTree) -> ProbeResult:
    """Decode metadata reuses a device rank tensor instead of building one per batch."""
    utils = _module(tree, BACKEND_UTILS)
    helper = _function(utils, "get_dcp_local_seq_lens") if utils else None
    if helper is None:
        return ProbeResult(True, "no get_dcp_local_seq_lens in this release (code absent)")
    takes_tensor = any(
        isinstance(n, ast.Call)
        and _called_name(n) == "isinstance"
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id == "dcp_rank"
        for n in ast.walk(helper)
    )
    if not takes_tensor:
        return ProbeResult(False, "get_dcp_local_seq_lens always builds torch.tensor(dcp_rank)")
    indexer = _module(tree, INDEXER)
    localize = None
    for node in ast.walk(indexer) if indexer else ():
        if isinstance(node, ast.FunctionDef) and node.name == "_dcp_localize_decode_seq_lens":
            localize = node
    if localize is None:
        return ProbeResult(True, "helper takes a device rank; no indexer decode localization")
    for call in _calls(localize, "get_dcp_local_seq_lens"):
        rank = (
            call.args[2]
            if len(call.args) > 2
            else next((k.value for k in call.keywords if k.arg == "dcp_rank"), None)
        )
        if not (isinstance(rank, ast.Attribute) and rank.attr.endswith("_tensor")):
            return ProbeResult(False, f"{INDEXER}:{call.lineno} passes an int rank per batch")
    return ProbeResult(True, "decode localization reuses the builder's device rank tensor")


@probe("dsv4-indexer-capture-shortcut")
def _dsv4_indexer_capture_shortcut(tree: VllmTree) -> ProbeResult:
    """The short-context shortcut is never taken while a CUDA graph is being captured."""
    module = _module(tree, DSV4_ATTENTION)
    forward = _function(module, "DeepseekV4Indexer.forward") if module else None
    if module is None or forward is None:
        return ProbeResult(True, "no DeepseekV4Indexer in this release (code absent)")
    for node in ast.walk(forward):
        if not isinstance(node, ast.If):
            continue
        attributes = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
        if {"compress_ratio", "topk_tokens"} <= attributes:
            if _calls(node.test, "is_current_stream_capturing"):
                return ProbeResult(True, "shortcut skipped during stream capture")
            sites = _indexer_call_sites(module)
            if sites and all(sites.values()):
                return ProbeResult(
                    False,
                    f"{DSV4_ATTENTION}:{node.lineno} shortcut not skipped during capture, but "
                    f"the indexer is called only inside @eager_break_during_capture regions "
                    f"({', '.join(sorted(sites))}), which breakable capture runs eagerly",
                    unreachable=True,
                )
            return ProbeResult(
                False, f"{DSV4_ATTENTION}:{node.lineno} shortcut can be baked into a graph"
            )
    return ProbeResult(False, "DeepseekV4Indexer.forward has no recognizable shortcut condition")


def _indexer_call_sites(module: ast.Module) -> dict[str, bool]:
    """Each function that calls `….indexer(…)`, and whether it is decorated with
    `eager_break_during_capture` (bare, qualified or called)."""
    sites: dict[str, bool] = {}
    for function in ast.walk(module):
        if not isinstance(function, ast.FunctionDef) or not _calls(function, "indexer"):
            continue
        names = set()
        for decorator in function.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            names.add(getattr(target, "id", getattr(target, "attr", None)))
        sites[function.name] = "eager_break_during_capture" in names
    return sites


@probe("dsv4-c128a-capacity-stride")
def _dsv4_c128a_capacity_stride(tree: VllmTree) -> ProbeResult:
    """C128A metadata rows keep the buffers' capacity stride that graphs were captured with."""
    module = _module(tree, DSV4_SPARSE_MLA)
    function = _function(module, "build_c128a_topk_metadata") if module else None
    if module is None or function is None:
        return ProbeResult(True, "no C128A metadata builder in this release (code absent)")
    packed = [c for c in _calls(function, "view") if _is_minus_one(c)]
    if packed:
        return ProbeResult(False, f"{DSV4_SPARSE_MLA}:{packed[0].lineno} packs rows with view(-1)")
    strides = _c128a_kernel_row_strides(module)
    if not strides:
        return ProbeResult(False, "no launch of the C128A metadata kernel found")
    for stride in strides:
        if not (
            isinstance(stride, ast.Call)
            and _called_name(stride) == "stride"
            and [getattr(a, "value", None) for a in stride.args] == [0]
        ):
            return ProbeResult(
                False, f"{DSV4_SPARSE_MLA}:{stride.lineno} kernel rows not at a buffer's stride(0)"
            )
    return ProbeResult(True, "rows written and read at the buffers' capacity stride")


def _c128a_kernel_row_strides(module: ast.Module) -> list[ast.expr]:
    """The row strides the C128A metadata kernel is launched with, by keyword or position."""
    strides: list[ast.expr] = []
    for call in (n for n in ast.walk(module) if isinstance(n, ast.Call)):
        strides += [
            k.value
            for k in call.keywords
            if k.arg in ("global_decode_stride", "prefill_local_stride")
        ]
        func = call.func
        if (
            isinstance(func, ast.Subscript)
            and isinstance(func.value, ast.Name)
            and func.value.id == "_build_c128a_topk_metadata_kernel"
            and len(call.args) >= 5
        ):
            strides += [call.args[1], call.args[4]]  # (…, decode stride, …, …, prefill stride)
    return strides


def _is_minus_one(call: ast.Call) -> bool:
    return (
        len(call.args) == 1
        and isinstance(call.args[0], ast.UnaryOp)
        and isinstance(call.args[0].op, ast.USub)
        and getattr(call.args[0].operand, "value", None) == 1
    )
