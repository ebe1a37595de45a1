"""The probe of fix pcp-dcp-warmup-keys (patches/catalog.toml)."""

from __future__ import annotations

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import INDEXER, calls, find_function, parse_module
from mla_serve.patching.tree import VllmTree


@probe("pcp-dcp-warmup-keys")
def _pcp_dcp_warmup_keys(tree: VllmTree) -> ProbeResult:
    """Every key the PCP+DCP prefill path launches with is warmed up before serving."""
    module = parse_module(tree, INDEXER)
    if module is None:
        return ProbeResult(True, "no sparse indexer in this release (code absent)")
    if find_function(module, "build_pcp_global_chunk_plan") is None:
        return ProbeResult(
            True,
            "no PCP global chunk plan: prefill launches with the rank's own DCP key, "
            "which is warmed (code absent)",
        )
    warmup = find_function(module, "BuildPrefillChunkMetadataKernel.get_warmup_keys")
    if warmup is None:
        return ProbeResult(False, "BuildPrefillChunkMetadataKernel has no warmup keys")
    normalized = any(
        {k.arg: getattr(k.value, "value", None) for k in call.keywords}
        == {"DCP_RANK": 0, "DCP_WORLD": 1}
        for call in calls(warmup, "dict")
    )
    aligned = sum(
        1
        for call in calls(warmup, "from_alignment")
        if {k.arg for k in call.keywords} >= {"uncompressed_seq_lens", "cu_compressed_seq_lens"}
    )
    if not normalized:
        return ProbeResult(False, "warmup keys miss the normalized DCP key (rank 0, world 1)")
    if aligned < 4:
        return ProbeResult(False, f"{aligned} of 4 pointer-alignment variants are warmed")
    return ProbeResult(True, "normalized DCP key and 4 pointer-alignment variants warmed")
