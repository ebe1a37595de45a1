"""The probe of fix dcp-rank-device-tensor (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import (
    INDEXER,
    called_name,
    calls,
    find_function,
    parse_module,
)
from mla_serve.patching.tree import VllmTree

BACKEND_UTILS = "vllm/v1/attention/backends/utils.py"


@probe("dcp-rank-device-tensor")
def _dcp_rank_device_tensor(tree: VllmTree) -> ProbeResult:
    """Decode metadata reuses a device rank tensor instead of building one per batch."""
    utils = parse_module(tree, BACKEND_UTILS)
    helper = find_function(utils, "get_dcp_local_seq_lens") if utils else None
    if helper is None:
        return ProbeResult(True, "no get_dcp_local_seq_lens in this release (code absent)")
    takes_tensor = any(
        isinstance(n, ast.Call)
        and called_name(n) == "isinstance"
        and isinstance(n.args[0], ast.Name)
        and n.args[0].id == "dcp_rank"
        for n in ast.walk(helper)
    )
    if not takes_tensor:
        return ProbeResult(False, "get_dcp_local_seq_lens always builds torch.tensor(dcp_rank)")
    indexer = parse_module(tree, INDEXER)
    localize = None
    for node in ast.walk(indexer) if indexer else ():
        if isinstance(node, ast.FunctionDef) and node.name == "_dcp_localize_decode_seq_lens":
            localize = node
    if localize is None:
        return ProbeResult(True, "helper takes a device rank; no indexer decode localization")
    for call in calls(localize, "get_dcp_local_seq_lens"):
        rank = (
            call.args[2]
            if len(call.args) > 2
            else next((k.value for k in call.keywords if k.arg == "dcp_rank"), None)
        )
        if not (isinstance(rank, ast.Attribute) and rank.attr.endswith("_tensor")):
            return ProbeResult(False, f"{INDEXER}:{call.lineno} passes an int rank per batch")
    return ProbeResult(True, "decode localization reuses the builder's device rank tensor")
