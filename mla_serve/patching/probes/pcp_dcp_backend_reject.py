"""The probe of fix pcp-dcp-backend-reject (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import FLASHINFER_SPARSE, find_function, parse_module
from mla_serve.patching.tree import VllmTree


@probe("pcp-dcp-backend-reject")
def _pcp_dcp_backend_reject(tree: VllmTree) -> ProbeResult:
    """FLASHINFER_MLA_SPARSE refuses PCP+DCP and names FLASHMLA_SPARSE as the fallback."""
    module = parse_module(tree, FLASHINFER_SPARSE)
    if module is None:
        return ProbeResult(True, "no FlashInfer sparse MLA backend in this release (code absent)")
    function = find_function(module, "FlashInferMLASparseTRTLLMBackend.supports_combination")
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
