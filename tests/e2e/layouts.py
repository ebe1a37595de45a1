"""The Helm profiles' own `vllm serve` command lines, scaled to a tiny model and the GPUs at hand.

`make e2e-pack` renders every profile with Helm's engine (tests/helm/helm_support.py)
and writes layouts.json into the pack; tests/e2e/run.sh starts vLLM with those
arguments. Scaling keeps every flag of the profile except the ones listed below,
and records each change with its reason, so the results say exactly what ran:

* the model: each profile serves the tiny model of its own family where one is made
  (model.py): `dsv4-flash` the tiny DeepSeek-V4-Flash, `gb300-tp4` the tiny GLM-5.3-Flash;
  the b200 profiles (GLM-5.2) and `tp1` the tiny DeepSeek-V3.2, the model their results of
  record ran (a tiny GLM-5.2 is in the pack for them: one line in `PROFILE_MODELS`). The
  model's name is the tiny one's. Where the tiny model is of the profile's family, the
  profile's reasoning and tool parsers stay; otherwise the tiny model's reasoning parser
  replaces the profile's and a tool parser of another family is dropped;
* memory: `--gpu-memory-utilization 0.2` and a fixed `--kv-cache-memory-bytes`, because
  several stacks share the GPUs (vLLM's free-memory profiling is device-wide, so
  concurrent start-ups would disturb each other's KV budget); `--max-model-len 4096`,
  `--max-num-seqs 16` (the tiny models' length; short start-ups);
* width: `tensor x prefill-context` must fit the GPUs. The prefill-context axis shrinks
  first (to what fits; to 1 under DCP, as PCP keeps a whole KV copy per rank and DCP is
  what shards it), then a decode-context size that spanned PCP is carried by TP instead
  (DCP divides TP), then TP shrinks to the GPUs. On two GPUs: TP1 x PCP4 x DCP4 becomes
  TP2 x DCP2, TP2 x PCP2 becomes TP2, TP1 x PCP4 becomes PCP2, TP4 becomes TP2. Each
  profile is also scaled to every narrower width where that changes it, as
  `PROFILE@WIDTH` (`dsv4-flash@1`: TP1 on one GPU);
* experts: `--enable-expert-parallel` stays where the tiny model has routed experts
  (DeepSeek-V4-Flash's), and is dropped for the V3.2 stand-in, which has none;
* Hopper: under DCP vLLM takes FlashMLA sparse, which refuses a bf16 cache there, so
  `--kv-cache-dtype fp8_ds_mla` and the 32-head model (fewer than 32 heads per rank);
  a Blackwell-only attention backend would be dropped with vLLM's reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.e2e import model

ROOT = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 4 << 30
TINY = [
    "--load-format=dummy",
    "--max-model-len=4096",
    "--max-num-seqs=16",
    "--gpu-memory-utilization=0.2",
    f"--kv-cache-memory-bytes={KV_CACHE_BYTES}",
]
# The profile -> its tiny model, where one of its family is made; the others serve V3.2.
PROFILE_MODELS = {
    "dsv4-flash": model.DEEPSEEK_V4_FLASH.name,
    "gb300-tp4": model.GLM53_FLASH.name,
}
REPLACED = {  # the profile's flag -> why the tiny model's value replaces it
    "--served-model-name": "the tiny model's name",
    "--gpu-memory-utilization": "several stacks share the GPUs: a fixed KV cache instead",
    "--max-model-len": "the tiny model's context",
    "--max-num-seqs": "short start-ups",
    "--host": "the harness binds 127.0.0.1",
    "--port": "the harness picks the port",
}
# Flags a stand-in of another family cannot take: the profile's flag -> why it goes.
FOREIGN = {
    "--tool-call-parser": "the profile's model family's parser; the stand-in calls no tools",
    "--enable-auto-tool-choice": "goes with the dropped tool parser",
}
BLACKWELL_ONLY = {  # attention backends Hopper cannot run, with vLLM's reason
    "FLASHINFER_MLA_SPARSE": "FlashInfer's sparse MLA (trtllm-gen) runs on SM100 only",
    "FLASHINFER_MLA": "FlashInfer's trtllm-gen MLA runs on SM100 only",
    "CUTLASS_MLA": "CUTLASS MLA runs on SM100 only",
}
# Settings Hopper refuses, with vLLM 0.33.0's reason: the flag=value -> why it goes.
BLACKWELL_SETTINGS = {
    "--attention-config.indexer_kv_dtype=mxfp4": (
        "vLLM's MXFP4 indexer cache needs SM10x (dsa_indexer_uses_fp4 refuses the rest)"
    ),
}
PARALLEL = (
    "--tensor-parallel-size",
    "--prefill-context-parallel-size",
    "--decode-context-parallel-size",
)


def split(argv: list[str]) -> list[tuple[str, str | None]]:
    """`--flag=value` / `--flag value` / `--flag` pairs (the chart renders `--flag=value`)."""
    pairs: list[tuple[str, str | None]] = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            pairs.append((name, value if eq else None))
        elif pairs and pairs[-1][1] is None:
            pairs[-1] = (pairs[-1][0], arg)
    return pairs


def scale(
    profile: str, chart_argv: list[str], gpus: int, tiny: model.Tiny = model.DEEPSEEK_V32
) -> dict[str, Any]:
    """The command line of `tiny` for `chart_argv` on `gpus` Hopper GPUs, and every change."""
    flags = split(chart_argv[1:])  # [0] is the model
    chart_parser = dict(flags).get("--reasoning-parser")
    own_family = chart_parser == tiny.reasoning_parser  # the profile's family's tiny model
    sizes = {name: int(value or 1) for name, value in flags if name in PARALLEL}
    tp, pcp, dcp = (sizes.get(name, 1) for name in PARALLEL)
    changes: list[str] = []
    fits_as_is = tp * pcp <= gpus  # then every parallel flag stays the chart's
    if tp * pcp > gpus and pcp > 1:
        # PCP shrinks to what fits; with DCP it goes (DCP is then carried by TP, below).
        fits = 1 if dcp > 1 else max(1, gpus // tp)
        changes.append(
            f"prefill-context {pcp} -> {fits}: TP {tp} x PCP {pcp} needs {tp * pcp} GPUs"
        )
        pcp = fits
    if not fits_as_is and dcp > 1 and (tp % dcp or dcp > gpus):
        new_dcp = min(dcp, gpus)
        new_tp = max(tp, new_dcp)
        changes.append(
            f"decode-context {dcp} over TP {tp} -> DCP {new_dcp} over TP {new_tp}: "
            "DCP divides TP once PCP is gone"
        )
        tp, dcp = new_tp, new_dcp
    if tp * pcp > gpus:
        changes.append(f"tensor {tp} -> {gpus // pcp}: TP {tp} x PCP {pcp} needs {tp * pcp} GPUs")
        tp = gpus // pcp
    kept: list[str] = []
    dropped: dict[str, str] = {}
    backend = None
    for name, value in flags:
        if name in PARALLEL:
            continue
        if name in REPLACED:
            changes.append(f"{name}={value}: {REPLACED[name]}")
        elif name == "--reasoning-parser" and value != tiny.reasoning_parser:
            changes.append(f"{name}={value}: the tiny {tiny.family} takes {tiny.reasoning_parser}")
        elif name in FOREIGN and not own_family:
            dropped[name] = FOREIGN[name]
        elif name == "--enable-expert-parallel" and not tiny.config.get("n_routed_experts"):
            dropped[name] = f"the tiny {tiny.family} has no routed experts"
        elif name == "--attention-backend" and value in BLACKWELL_ONLY:
            dropped[f"{name}={value}"] = BLACKWELL_ONLY[value]
        elif f"{name}={value}" in BLACKWELL_SETTINGS:
            dropped[name] = f"{value}: " + BLACKWELL_SETTINGS[f"{name}={value}"]
        else:
            backend = value if name == "--attention-backend" else backend
            kept.append(f"{name}={value}" if value is not None else name)
    argv = [
        f"--tensor-parallel-size={tp}",
        f"--prefill-context-parallel-size={pcp}",
        f"--decode-context-parallel-size={dcp}",
        *kept,
        *TINY,
    ]
    if chart_parser != tiny.reasoning_parser:
        argv.append(f"--reasoning-parser={tiny.reasoning_parser}")
    heads = 64
    if dcp > 1 and "--kv-cache-dtype=fp8_ds_mla" not in argv:
        argv.append("--kv-cache-dtype=fp8_ds_mla")
        changes.append(
            "--kv-cache-dtype=fp8_ds_mla: FlashMLA sparse under DCP refuses bf16 on SM90"
        )
    if dcp > 1:
        heads = 32
        changes.append("the 32-head tiny model: FlashMLA sparse's DCP decode wants < 32 heads/rank")
    tiny.config_for(heads)  # raises where the model has no such variant
    return {
        "profile": profile,
        "model": tiny.name,
        "served_model_name": tiny.served_name,
        "model_dir": tiny.directory(heads),
        "gpus": tp * pcp,
        "parallel": {"tp": tp, "pcp": pcp, "dcp": dcp},
        "heads": heads,
        "attention_backend": backend,
        "chart_argv": chart_argv,
        "argv": argv,
        "changes": changes,
        "dropped": dropped,
    }


def rendered() -> dict[str, list[str]]:
    """Each profile's rendered `vllm serve` arguments (leader pod), from Helm's engine."""
    from tests.helm.helm_support import PROFILES, case_documents, vllm_container

    lines: dict[str, list[str]] = {}
    for profile in PROFILES:
        for doc in case_documents(f"profile-{profile}"):
            if doc["kind"] == "Deployment":
                pod = doc["spec"]["template"]
            elif doc["kind"] == "LeaderWorkerSet":
                pod = doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
            else:
                continue
            lines[profile] = list(vllm_container(pod["spec"])["args"])
    return lines


def widths(profile: str, argv: list[str], gpus: int) -> dict[str, dict[str, Any]]:
    """`profile` scaled to `gpus`, and as `profile@w` to every narrower width where that
    changes the parallel layout, each with its own family's tiny model."""
    tiny = model.MODELS[PROFILE_MODELS.get(profile, model.DEEPSEEK_V32.name)]
    out = {profile: scale(profile, argv, gpus, tiny)}
    for width in range(gpus - 1, 0, -1):
        narrow = scale(profile, argv, width, tiny)
        if narrow["parallel"] not in [layout["parallel"] for layout in out.values()]:
            out[f"{profile}@{width}"] = narrow
    return out


def layouts(gpus: int) -> dict[str, dict[str, Any]]:
    """Every profile scaled to `gpus` (and narrower), plus `tp1`: the one-GPU layout of the
    first e2e run."""
    out = {"tp1": scale("tp1", ["model", "--tensor-parallel-size=1"], 1)}
    for profile, argv in sorted(rendered().items()):
        out |= widths(profile, argv, gpus)
    return out


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(layouts(args.gpus), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
