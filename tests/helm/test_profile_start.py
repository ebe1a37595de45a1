"""Each profile starts on the hardware it names, as far as a CPU can tell.

For every profile the chart is rendered with Helm's engine, the vLLM container's `vllm serve`
arguments are taken from the Deployment, and vLLM 0.33.0's own start-up configuration path
runs on them in a child process (tests/helm/vllm_start_probe.py) with the profile's GPU
declared: the serve parser, `create_engine_config()` with the model's config.json (the
model's config hook, the parallel/scheduler/cache checks), the PCP manager's checks, and the
engine core's KV-cache planning, whose memory check needs one request at max-model-len to fit
in the per-rank budget `mla-serve plan` gives for the profile. No weights, no GPU.

The profiles as they were before their layouts were fixed are kept here as overrides of
today's values, and must fail with vLLM's own messages; today's must pass.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from mla_serve.patching import wheel
from mla_serve.sizing.commands import model_config
from tests import trees
from tests.helm.helm_support import (
    HERE,
    PROFILES,
    REPO,
    case_values,
    chart,
    documents,
    merge,
    render,
    run,
)
from tests.helm.test_helm_profiles_plan import MODELS, plan
from tests.helm.test_helm_vllm_args import ENV, RELEASE

GiB = 1 << 30

# gpu.product -> what the probe declares: vLLM's device name and compute capability.
GPUS: dict[str, tuple[str, tuple[int, int]]] = {
    "NVIDIA-B200": ("NVIDIA B200", (10, 0)),
    "NVIDIA-GB300": ("NVIDIA GB300", (10, 3)),
    "NVIDIA-H200": ("NVIDIA H200", (9, 0)),  # no profile names it: the refusal case below
}

# The checkpoints' quantization as vLLM reads it from config.json: nvidia/GLM-5.2-NVFP4 is the
# GLM-5.2 config plus ModelOpt's NVFP4 block (the published keys; README of the fixtures).
QUANTIZATION: dict[str, dict[str, Any]] = {
    "nvidia/GLM-5.2-NVFP4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
    },
}

# The profiles before their layouts were fixed (and one on a GPU it does not name), as
# overrides of today's files, and vLLM's refusal of each (stage of the probe, start of the
# message). "@kv-auto": the PCP+DCP
# profile with only the DCP backend fixed, i.e. GLM-5.2's `auto` KV dtype under a forced
# FLASHMLA_SPARSE.
PRISTINE: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "b200-tp1-pcp4-dcp4@pristine": (
        "b200-tp1-pcp4-dcp4",
        {"vllm": {"dcpCommBackend": "", "kvCacheDtype": ""}},
        "pcp",
        "NotImplementedError: MRV2 PCP + DCP requires dcp_comm_backend='ag_rs'; got 'a2a'.",
    ),
    "b200-tp1-pcp4-dcp4@kv-auto": (
        "b200-tp1-pcp4-dcp4",
        {"vllm": {"kvCacheDtype": ""}},
        "kv",
        "ValueError: Selected backend AttentionBackendEnum.FLASHMLA_SPARSE is not valid for "
        "this configuration. Reason: ['kv_cache_dtype not supported']",
    ),
    "b200-tp2-pcp2@pristine": (
        "b200-tp2-pcp2",
        {"vllm": {"maxModelLen": None, "gpuMemoryUtilization": 0.85}},
        "kv",
        "ValueError: To serve at least one request with the model's max seq len (1048576)",
    ),
    # The DeepSeek-V4 profile's MXFP4 indexer cache on a Hopper GPU: vLLM refuses it.
    "dsv4-flash@h200": (
        "dsv4-flash",
        {"gpu": {"product": "NVIDIA-H200", "memoryGiB": 139.8}},
        "config",
        "ValueError: indexer_kv_dtype='mxfp4' requires Blackwell datacenter GPUs (sm_10x",
    ),
    "b200-tp1-pcp4@pristine": (
        "b200-tp1-pcp4",
        {"vllm": {"maxModelLen": None, "gpuMemoryUtilization": 0.92}},
        "kv",
        "ValueError: To serve at least one request with the model's max seq len (1048576)",
    ),
}


def serve_argv(values: dict[str, Any]) -> list[str]:
    """The vLLM container's arguments after `serve` in the rendered Deployment (leader)."""
    (deployment,) = [d for d in documents(render(values)) if d["kind"] == "Deployment"]
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    ]
    assert container["command"] == ["mla-serve-entrypoint", "serve"]
    argv = []
    for arg in container["args"]:
        for var, value in ENV.items():
            arg = arg.replace(var, value)
        argv.append(arg)
    return argv


def model_dir(name: str, root: Path) -> Path:
    fixture, _ = MODELS[name]
    config = json.loads(model_config(fixture).read_text())
    if name in QUANTIZATION:
        config["quantization_config"] = QUANTIZATION[name]
    path = root / fixture
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def kv_plan(values: dict[str, Any]) -> dict[str, int | None]:
    """The per-rank KV budget and tokens `mla-serve plan` gives for the profile."""
    try:
        rank = plan(values)["per_rank"]
    except pytest.skip.Exception:
        return {"kv_budget_bytes": None, "plan_kv_tokens": None}
    return {"kv_budget_bytes": rank["kv_budget_bytes"], "plan_kv_tokens": rank["kv_tokens"]}


def third_party(root: Path) -> Path:
    """vllm/third_party's Python files (pynvml) from the release's wheel, which the test trees
    leave out."""
    whl = wheel.fetch(
        RELEASE, Path(os.environ.get("MLA_SERVE_WHEEL_CACHE", trees.CACHE / "wheels"))
    )
    with zipfile.ZipFile(whl) as archive:
        for name in archive.namelist():
            if (
                name.startswith("vllm/third_party/")
                and name.count("/") == 2
                and name.endswith(".py")
            ):
                archive.extract(name, root)
    return root


def declared_gpu(values: dict[str, Any]) -> dict[str, Any]:
    gpu = values["gpu"]
    name, capability = GPUS[gpu["product"]]
    return {
        "name": name,
        "capability": list(capability),
        "memory_bytes": int(gpu["memoryGiB"] * GiB),
    }


@functools.cache
def profile_values(label: str) -> dict[str, Any]:
    """Today's profile `label`, or the variant PRISTINE names."""
    profile, overrides = (PRISTINE[label][0], PRISTINE[label][1]) if "@" in label else (label, {})
    return chart().merge_values(merge(case_values(f"profile-{profile}"), overrides))


@pytest.fixture(scope="module")
def starts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """label ('<profile>' or '<profile>@pristine') -> the probe's report."""
    root = tmp_path_factory.mktemp("start")
    extra = third_party(root / "third_party")
    models = root / "models"
    models.mkdir()
    by_gpu: dict[str, dict[str, Any]] = {}
    for label in [*PROFILES, *PRISTINE]:
        values = profile_values(label)
        gpu = declared_gpu(values)
        group = by_gpu.setdefault(json.dumps(gpu, sort_keys=True), {"platform": gpu, "targets": {}})
        group["targets"][label] = {
            "argv": serve_argv(values),
            "model_dir": str(model_dir(values["model"]["name"], models)),
            **kv_plan(values),
        }
    report: dict[str, dict[str, Any]] = {}
    tree = trees.pristine(RELEASE)
    for number, group in enumerate(by_gpu.values()):
        out = root / f"report-{number}.json"
        result = run(
            [sys.executable, str(HERE / "vllm_start_probe.py")],
            input=json.dumps({"out": str(out), "third_party": str(extra), **group}),
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)]),
                "VLLM_TARGET_DEVICE": "cpu",  # the host; the target GPU is declared
                "VLLM_LOGGING_LEVEL": "ERROR",
                "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
                "HF_HUB_OFFLINE": "1",
            },
            cwd=root,
            timeout=600,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        report.update(json.loads(out.read_text()))
    return report


# Profiles whose model vLLM cannot inspect here: GLM-5.3-Flash's module imports torchvision
# (through transformers' GLM-4V image processor), which has no CPU build for this torch. For
# them only the parser names, the plan's fit and the chart's checks run.
NOT_RUN = {"gb300-tp4": "imports torchvision (not installed)"}


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_passes_vllms_start_checks(profile: str, starts: dict[str, Any]) -> None:
    got = starts[profile]
    print(f"{profile}: {got['facts']}")
    print("not checked on the CPU:\n  " + "\n  ".join(got["not_checked"]))
    if profile in NOT_RUN and got["stage"] == "skipped":
        print(f"{profile}: {got['error']}")
        assert got["error"].endswith(NOT_RUN[profile])
        return
    assert (got["stage"], got["error"]) == ("ok", None), got.get("where")


@pytest.mark.parametrize("label", sorted(PRISTINE))
def test_pristine_profile_fails_with_vllms_message(label: str, starts: dict[str, Any]) -> None:
    """The profiles before their layouts were fixed would not start; vLLM's own checks say why."""
    got = starts[label]
    _, _, stage, message = PRISTINE[label]
    print(f"{label}: {got['error']}")
    assert got["stage"] == stage, got
    assert got["error"].startswith(message), got["error"]


def test_pcp_dcp_profile_runs_ag_rs(starts: dict[str, Any]) -> None:
    """GLM-5.2's hook defaults DCP to a2a; the profile's flag wins, and the pristine one shows
    the hook's default is what vLLM would have used."""
    assert starts["b200-tp1-pcp4-dcp4"]["facts"]["dcp_comm_backend"] == "ag_rs"
    assert starts["b200-tp1-pcp4-dcp4@pristine"]["facts"]["dcp_comm_backend"] == "a2a"


def test_b200_default_batched_token_cap_is_16384(starts: dict[str, Any]) -> None:
    """What the profiles' comments say: vLLM 0.33.0 caps a B200-class GPU at 16384 by default."""
    for profile in PROFILES:
        values = profile_values(profile)
        if values["gpu"]["product"] == "NVIDIA-B200" and not values["vllm"].get(
            "maxNumBatchedTokens"
        ):
            assert starts[profile]["facts"]["max_num_batched_tokens"] == 16384, profile


def test_indexer_cache_dtype_per_profile(starts: dict[str, Any]) -> None:
    """vllm#52550: the DeepSeek-V4 profile asks for the MXFP4 indexer cache
    (attention_config.indexer_kv_dtype) and vLLM takes it on the B200 it names; GLM-5.2's
    profiles leave it at auto, fp8. On an H200 vLLM refuses the DeepSeek-V4 profile's
    setting (test_pristine_profile_fails_with_vllms_message, dsv4-flash@h200)."""
    dsv4 = starts["dsv4-flash"]["facts"]
    assert (dsv4["indexer_kv_dtype"], dsv4["indexer_cache"]) == ("mxfp4", "mxfp4")
    for profile in ("b200-tp2-pcp2", "b200-tp1-pcp4", "b200-tp1-pcp4-dcp4"):
        facts = starts[profile]["facts"]
        assert (facts["indexer_kv_dtype"], facts["indexer_cache"]) == ("auto", "fp8"), profile


def test_glm52_kv_cache_is_fp8_on_blackwell(starts: dict[str, Any]) -> None:
    """GLM-5.2's hook makes `auto` fp8_e4m3 on SM10x; FLASHMLA_SPARSE (the PCP+DCP profile's)
    refuses that name, so that profile asks for fp8_ds_mla, what FlashMLA stores anyway."""
    for profile in ("b200-tp2-pcp2", "b200-tp1-pcp4"):
        assert starts[profile]["facts"]["cache_dtype"] == "fp8_e4m3", profile
        assert starts[profile]["facts"]["attention_backend"] == "FLASHINFER_MLA_SPARSE"
    dcp = starts["b200-tp1-pcp4-dcp4"]["facts"]
    assert (dcp["cache_dtype"], dcp["kv_cache_dtype"]) == ("fp8_ds_mla", "fp8_ds_mla")
