"""Each profile's memory settings, checked with `mla-serve plan` on the model's config.

The plan's inputs come from the profile itself (parallelism, gpu.memoryGiB, vllm.*); only the
model config (one mla-serve ships, `mla-serve plan --model NAME`: mla_serve/sizing/models) and
the checkpoint's format are mapped here.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from mla_serve import cli
from mla_serve.sizing.commands import model_config
from tests.helm.helm_support import PROFILES, REPO, case_values, chart, run

GiB = 1 << 30

# model.name -> (the shipped config `plan --model` takes, extra flags for the checkpoint's format)
MODELS: dict[str, tuple[str, list[str]]] = {
    "zai-org/GLM-5.3-Flash": ("GLM-5.3-Flash", []),
    # The NVFP4 checkpoint of vLLM's B200 evaluation (vllm#55879): routed experts in NVFP4.
    "nvidia/GLM-5.2-NVFP4": ("GLM-5.2", ["--expert-dtype", "nvfp4"]),
    "deepseek-ai/DeepSeek-V4-Flash": ("DeepSeek-V4-Flash", []),
}

# The FlashInfer sparse-MLA workspace is sized for the scheduler's token budget; no profile may
# let it grow past what vLLM's B200 evaluation found workable (vllm#55879: 2.39 GiB at DCP4,
# 4096 tokens).
WORKSPACE_CEILING = int(2.5 * GiB)


def mla_serve() -> list[str]:
    exe = Path(sys.executable).with_name("mla-serve")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mla-serve")
    return [found] if found else [sys.executable, "-m", "mla_serve.cli"]


def extra_arg(vllm: dict[str, Any], flag: str) -> str | None:
    """The value a profile gives `flag` in vllm.extraArgs (`FLAG=VALUE`), or None."""
    for arg in vllm.get("extraArgs") or []:
        name, _, value = str(arg).partition("=")
        if name == flag:
            return value
    return None


def plan_args(values: dict[str, Any], **overrides: Any) -> list[str]:
    p, v = values["parallelism"], values["vllm"]
    fixture, extra = MODELS[values["model"]["name"]]
    settings = {
        "tp": p["tensor"],
        "pcp": p["prefillContext"],
        "dcp": p["decodeContext"],
        "dp": p["data"],
        "ep": p["tensor"] * p["prefillContext"] * p["data"] if p["expert"] else 1,
        "gpu-memory-gib": values["gpu"]["memoryGiB"],
        "gpu-memory-utilization": v["gpuMemoryUtilization"],
        "max-num-batched-tokens": v.get("maxNumBatchedTokens"),
        "kv-cache-dtype": v.get("kvCacheDtype") or "auto",
        "attention-backend": v.get("attentionBackend") or None,
        # DeepSeek-V4's prefill workspace grows with it (the other models' plans do not read it)
        "max-model-len": v.get("maxModelLen") if fixture == "DeepSeek-V4-Flash" else None,
        "indexer-kv-dtype": extra_arg(v, "--attention-config.indexer_kv_dtype"),
    }
    settings.update({k.replace("_", "-"): value for k, value in overrides.items()})
    args = ["plan", "--model", fixture, "--format", "json"]
    for flag, value in settings.items():
        if value is not None:
            args += [f"--{flag}", str(value)]
    return args + extra


def plan(values: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    result = run(mla_serve() + plan_args(values, **overrides), cwd=REPO, timeout=120)
    if result.returncode == 2 and "not covered" in result.stderr:
        pytest.skip(f"mla-serve plan does not model this checkpoint: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def model_max_len(values: dict[str, Any]) -> int:
    fixture, _ = MODELS[values["model"]["name"]]
    config = json.loads(model_config(fixture).read_text())
    config = config.get("text_config", config)
    return int(config["max_position_embeddings"])


def profile_values(profile: str) -> dict[str, Any]:
    return chart().merge_values(case_values(f"profile-{profile}"))


def profile_or_default(profile: str) -> dict[str, Any]:
    return chart().merge_values({}) if profile == "defaults" else profile_values(profile)


@pytest.mark.parametrize("profile", ["defaults", *PROFILES])
def test_profile_fits_in_memory(profile: str) -> None:
    """Each profile, and the defaults without one, on the GPU its values name."""
    values = profile_or_default(profile)
    assert values["gpu"]["memoryGiB"] > 0, f"{profile}: gpu.memoryGiB unset"
    report = plan(values)
    rank = report["per_rank"]
    assert report["warnings"] == [], f"{profile}: {report['warnings']}"
    assert rank["kv_budget_bytes"] > 0, f"{profile}: KV budget {rank['kv_budget_bytes']} B"
    assert rank["workspace_bytes"] <= WORKSPACE_CEILING, f"{profile}: workspace too large"
    # One sequence of the longest allowed context fits in the KV cache: the profile's
    # maxModelLen or, unset, the model's own (vLLM shrinks it only when it is -1).
    max_len = values["vllm"].get("maxModelLen") or model_max_len(values)
    assert rank["kv_tokens"] >= max_len, f"{profile}: {rank['kv_tokens']} KV tokens < {max_len}"


def test_dcp_profile_keeps_the_workspace_at_2_39_gib() -> None:
    """vllm#50791 / #55879: at DCP4 (64 heads/rank) the workspace is 2.39 GiB at 4096 batched
    tokens and 16.39 GiB at vLLM's 32768; the profile's 4096 is what keeps it small."""
    values = profile_values("b200-tp1-pcp4-dcp4")
    assert values["vllm"]["maxNumBatchedTokens"] == 4096
    capped = plan(values)["details"]
    assert capped["workspace_required_bytes"] == 2_561_671_168
    uncapped = plan(values, max_num_batched_tokens=32768)["details"]
    assert uncapped["workspace_required_bytes"] == 17_594_056_704
    # FlashInfer's sparse MLA refuses PCP+DCP: the backend that gathers the DCP shards is forced.
    assert values["vllm"]["attentionBackend"] == "FLASHMLA_SPARSE"
    forced = plan(values, attention_backend="FLASHINFER_MLA_SPARSE")
    assert any("does not support combined PCP+DCP" in w for w in forced["warnings"])
    # 0.96 is above the utilization vLLM suggested after the -3.23 GiB KV budget.
    assert values["vllm"]["gpuMemoryUtilization"] > 0.9545


def test_tp2_pcp2_profile_leaves_room_for_cutlass_autotuning() -> None:
    """vllm#55879: CUTLASS MoE autotuning needs 12.22 GiB outside vLLM's pool, where only ~7.6 GiB
    remained at vLLM's 0.92; lowering the utilization frees (0.92 - u) x GPU memory."""
    values = profile_values("b200-tp2-pcp2")
    utilization = values["vllm"]["gpuMemoryUtilization"]
    freed_gib = (0.92 - utilization) * values["gpu"]["memoryGiB"]
    assert freed_gib == pytest.approx(12.5, abs=0.1)
    assert 7.6 + freed_gib >= 12.22
    assert plan(values)["per_rank"]["kv_budget_bytes"] > 0


def test_bf16_glm52_would_not_fit() -> None:
    """Why the GLM-5.2 profiles name the NVFP4 checkpoint: with the BF16 config alone no KV
    cache fits, and `plan` refuses, naming the flag that gives the experts' format."""
    values = profile_values("b200-tp2-pcp2")
    fixture, _ = MODELS[values["model"]["name"]]
    args = plan_args(values)
    bf16 = args[: args.index("--expert-dtype")]
    result = run(mla_serve() + bf16, cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "no KV cache fits on a rank: weights 357.58 GiB" in result.stderr
    assert "--expert-dtype nvfp4" in result.stderr
    assert fixture == "GLM-5.2"


def readme_plans() -> dict[str, list[str]]:
    """The chart README's `mla-serve plan` command for each profile (after `# <profile>`)."""
    text = (REPO / "helm" / "mla-serve" / "README.md").read_text()
    block = text.split("**Sizing a profile with `mla-serve plan`**", 1)[1]
    block = block.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands: dict[str, list[str]] = {}
    profile = None
    for line in block.splitlines():
        if line.startswith("# "):
            profile = line[2:].split()[0]  # "# NAME" or "# NAME (what it is)"
        elif line.startswith("mla-serve plan ") and profile:
            commands[profile] = shlex.split(line)[1:]
    return commands


@pytest.mark.parametrize("profile", ["defaults", *PROFILES])
def test_the_readme_gives_each_profiles_plan_flags(profile: str) -> None:
    """A user plans a profile with the README's command: it must say what the profile's
    values say (parsed by `mla-serve plan`'s own parser, so defaults may be left out),
    the checkpoint format flags included, which the profile cannot state."""
    documented = readme_plans().get(profile)
    assert documented, f"helm/mla-serve/README.md gives no `mla-serve plan` for {profile}"
    derived = plan_args(profile_or_default(profile))
    at = derived.index("--format")
    del derived[at : at + 2]
    expected = " ".join(["mla-serve", *derived])
    assert parsed(documented) == parsed(derived), f"{profile}: the README should say {expected}"


def parsed(argv: list[str]) -> dict[str, Any]:
    return {k: v for k, v in vars(cli.parser().parse_args(argv)).items() if k != "run"}


def test_dcp_profile_utilization_fits_a_full_request_with_the_evals_overhead() -> None:
    """vLLM's B200 evaluation (vllm#55879) measured a -3.23 GiB KV budget at 0.92 with
    FlashInfer's sparse MLA at 32768 batched tokens; what the plan does not count (activations,
    CUDA graph pool, NCCL) was then the reserve below. With it, the profile's 0.96 still fits
    one 1,048,576-token request per rank at DCP4, and 0.92 would not."""
    values = profile_values("b200-tp1-pcp4-dcp4")
    measured = plan(
        values,
        gpu_memory_utilization=0.92,
        max_num_batched_tokens=32768,
        attention_backend="FLASHINFER_MLA_SPARSE",
    )["per_rank"]
    reserve = measured["kv_budget_bytes"] + measured["reserve_bytes"] + int(3.23 * GiB)
    assert reserve / GiB == pytest.approx(19.66, abs=0.01)
    max_len = 1_048_576  # GLM-5.2's, which the profile keeps
    assert values["vllm"].get("maxModelLen") is None
    at_profile = plan(values, reserve_gib=reserve / GiB)["per_rank"]
    assert at_profile["kv_tokens"] >= max_len * 1.5
    at_default = plan(values, reserve_gib=reserve / GiB, gpu_memory_utilization=0.92)["per_rank"]
    assert at_default["kv_tokens"] < max_len
