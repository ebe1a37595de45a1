"""The sizing model and `mla-serve plan`: vllm#50791 / #55879's figures, budgets, CLI, bad input."""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from pathlib import Path

import pytest

from mla_serve import sizing
from mla_serve.cli import main
from mla_serve.sizing import backend, quant, shape, weights
from mla_serve.sizing.commands import MODELS_DIR
from tests import cli_run

MODELS = MODELS_DIR  # the model configs mla-serve ships (mla_serve/sizing/models)
GLM52 = MODELS / "GLM-5.2" / "config.json"
DSV32 = MODELS / "DeepSeek-V3.2" / "config.json"
GLM53_FLASH = MODELS / "GLM-5.3-Flash" / "config.json"
DSV4_FLASH = MODELS / "DeepSeek-V4-Flash" / "config.json"
GiB = 1 << 30
B200 = 179.06  # 183,359 MiB, as nvidia-smi reports a B200
DEFAULT_WORKSPACE = 394 * 1024 * 1024


def config(path: Path) -> dict:
    return json.loads(path.read_text())


def glm52_nvfp4() -> dict:
    """nvidia/GLM-5.2-NVFP4 as it matters here: expert-only NVFP4 and a static FP8 KV scheme.

    The three modelopt keys are the published ones; the exclude list is written for this
    test (the published one was not found), excluding what the model card keeps in bf16.
    """
    cfg = config(GLM52)
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "exclude_modules": [
            "lm_head",
            "*self_attn*",
            "*shared_experts*",
            "model.layers.0.mlp*",
            "model.layers.1.mlp*",
            "model.layers.2.mlp*",
            "model.layers.78*",
        ],
    }
    return cfg


def layout(**kw) -> sizing.Layout:
    kw.setdefault("gpu_memory_bytes", int(B200 * GiB))
    return sizing.Layout(**kw)


# --- the workspace, byte for byte ------------------------------------------------------


def test_seed_002_workspace_figures_are_byte_exact():
    assert sizing.DEFAULT_WORKSPACE_BYTES == 413_138_944
    assert sizing.workspace_bytes(4, 64, 4096) == 2_561_671_168
    assert sizing.workspace_bytes(4, 64, 32768) == 17_594_056_704
    assert round(2_561_671_168 / GiB, 2) == 2.39
    assert round(17_594_056_704 / GiB, 2) == 16.39


def test_without_dcp_the_workspace_is_the_base():
    assert sizing.workspace_bytes(1, 64, 32768) == DEFAULT_WORKSPACE
    assert sizing.workspace_bytes(1, 128, 1, base=1 << 30) == 1 << 30
    formula = 8 * (16 * 8) * 8192 * 256 + (1 << 20)
    assert sizing.workspace_bytes(8, 16, 8192, base=0) == formula


def test_workspace_override_replaces_the_size_and_warns_when_too_small():
    assert sizing.required_workspace_bytes(4, 64, 4096) == (2_561_671_168, None)
    assert sizing.required_workspace_bytes(4, 64, 4096, override=3 * GiB) == (3 * GiB, None)
    size, warning = sizing.required_workspace_bytes(4, 64, 32768, override=DEFAULT_WORKSPACE)
    assert size == DEFAULT_WORKSPACE
    assert (
        warning and "17594056704" in warning and "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE" in warning
    )
    assert sizing.required_workspace_bytes(1, 64, 4096, override=1 << 20) == (1 << 20, None)


def test_seed_002_dcp_layout_through_plan():
    for tokens, expected in ((4096, 2_561_671_168), (32768, 17_594_056_704)):
        result = sizing.plan(
            glm52_nvfp4(),
            layout(
                pcp=4,
                dcp=4,
                ep=4,
                max_num_batched_tokens=tokens,
                gpu_memory_utilization=0.96,
                attention_backend=backend.FLASHINFER,
            ),
        )
        assert result.heads_per_rank == 64
        assert result.workspace_bytes == expected
        assert any(
            "refuses --attention-backend FLASHINFER_MLA_SPARSE" in w for w in result.warnings
        )


def test_heads_per_rank_divide_by_tp_only():
    cfg = config(GLM52)
    assert sizing.plan(cfg, layout(tp=2, pcp=2)).heads_per_rank == 32
    assert sizing.plan(cfg, layout(tp=1, pcp=4, dcp=4)).heads_per_rank == 64
    assert sizing.plan(cfg, layout(tp=4, dcp=2)).heads_per_rank == 16


# --- backend choice, as vLLM 0.33.0 makes it on SM100 -------------------------------------


def test_pcp_plus_dcp_falls_back_to_flashmla_sparse_without_workspace():
    result = sizing.plan(glm52_nvfp4(), layout(pcp=4, dcp=4, ep=4, max_num_batched_tokens=32768))
    assert result.attention_backend == backend.FLASHMLA
    assert not result.workspace_allocated and result.workspace_bytes == 0
    assert result.workspace_required_bytes == 17_594_056_704
    assert result.kv_cache_dtype == "fp8_ds_mla"  # FLASHMLA_SPARSE stores fp8 as fp8_ds_mla
    assert result.to_json()["per_rank"]["workspace_bytes"] == 0


def test_backend_priorities():
    cfg = config(GLM52)
    assert sizing.plan(cfg, layout(kv_cache_dtype="fp8")).attention_backend == backend.FLASHINFER
    bf16 = layout(kv_cache_dtype="bfloat16")
    assert sizing.plan(cfg, bf16).attention_backend == backend.FLASHMLA  # bf16, 64 heads
    # auto: GLM-5.x's config hook makes it fp8_e4m3 on SM10x, so FlashInfer comes first
    assert sizing.plan(cfg, layout()).kv_cache_dtype == "fp8_e4m3"
    assert sizing.plan(cfg, layout()).attention_backend == backend.FLASHINFER
    assert sizing.plan(config(DSV32), layout(tp=8)).attention_backend == backend.FA4  # 16 heads
    forced = sizing.plan(
        cfg, layout(kv_cache_dtype="fp8_ds_mla", attention_backend=backend.FLASHINFER)
    )
    assert any("fp8_ds_mla" in w for w in forced.warnings)


def test_no_rope_model_has_no_backend_for_pcp_plus_dcp():
    # GLM-5.3-Flash: FLASHMLA_SPARSE takes head size 512 only on SM90, FlashInfer refuses PCP+DCP.
    with pytest.raises(sizing.SizingError, match="no sparse-MLA backend"):
        sizing.plan(config(GLM53_FLASH), layout(pcp=2, dcp=2))
    ok = sizing.plan(
        config(GLM53_FLASH), layout(pcp=2, dcp=2, attention_backend=backend.FLASHINFER)
    )
    assert ok.warnings


# --- KV cache ---------------------------------------------------------------------------


def test_kv_bytes_per_token():
    cfg = config(GLM52)
    fi = sizing.plan(cfg, layout(kv_cache_dtype="fp8"))
    assert fi.kv.indexer_layers == 21 and fi.kv.mla_layers == 78
    assert fi.kv_bytes_per_token == 78 * 576 + 21 * 132
    bf16 = sizing.plan(cfg, layout(kv_cache_dtype="bfloat16", attention_backend=backend.FLASHINFER))
    assert bf16.kv_bytes_per_token == 78 * 1152 + 21 * 132
    ds = sizing.plan(cfg, layout(pcp=4, dcp=4, kv_cache_dtype="fp8_ds_mla"))
    assert ds.kv_bytes_per_token == (78 * 656 + 21 * 132) / 4
    dsv32 = sizing.plan(config(DSV32), layout(tp=8, dcp=8))
    assert dsv32.kv_bytes_per_token == (61 * 1152 + 61 * 132) / 8
    flash = sizing.plan(config(GLM53_FLASH), layout(tp=4))
    assert flash.kv.mla_layers == 11 and flash.kv.linear_layers == 34
    assert flash.kv_bytes_per_token == 11 * 512 + 11 * 132 / 4  # auto: fp8 (the hook, SM10x)
    flash16 = sizing.plan(config(GLM53_FLASH), layout(tp=4, kv_cache_dtype="bfloat16"))
    assert flash16.kv_bytes_per_token == 11 * 1024 + 11 * 132 / 4
    # KDA: fp32 (16, 128, 128) recurrent + bf16 (3*8192/4, 3) conv state per layer at TP4
    assert flash.kv.state_bytes_per_sequence == 34 * (16 * 128 * 128 * 4 + 6144 * 3 * 2)


def test_indexer_layers_follow_vllm_rule_and_match_indexer_types():
    glm = shape.from_config(config(GLM52))
    assert sorted(glm.indexer_layers)[:4] == [0, 1, 2, 6]
    assert len(glm.indexer_layers) == glm.declared_full_indexers == 21
    assert len(shape.from_config(config(DSV32)).indexer_layers) == 61


def test_modelopt_kv_scheme_makes_auto_fp8():
    result = sizing.plan(glm52_nvfp4(), layout())
    assert result.kv_cache_dtype == "fp8" and result.kv_cache_dtype_requested == "auto"
    assert result.attention_backend == backend.FLASHINFER


# --- weights ------------------------------------------------------------------------------


def test_expert_only_nvfp4_glm52_matches_the_published_checkpoint_size():
    # nvidia/GLM-5.2-NVFP4 is ~465 GB: NVFP4 routed experts, everything else bf16 (MTP too).
    shape_ = shape.from_config(config(GLM52))
    one = weights.Parallel(tp=1, pcp=1, dp=1, ep=1)
    nvfp4 = weights.weight_bytes(shape_, quant.scheme(None, expert_dtype="nvfp4"), one)
    with_mtp = weights.weight_bytes(shape_, quant.scheme(None), one, mtp=True)
    on_disk = sum(nvfp4.values()) - nvfp4["absorbed_mla"] + with_mtp["mtp"]
    assert 460e9 < on_disk < 470e9
    # the modelopt exclude list and the --expert-dtype override describe the same weights
    by_config = sizing.plan(glm52_nvfp4(), layout(pcp=4, ep=4)).weights_bytes
    by_flag = sizing.plan(config(GLM52), layout(pcp=4, ep=4, expert_dtype="nvfp4")).weights_bytes
    assert by_config == by_flag


def test_experts_split_over_tp_pcp_dp_or_ep():
    cfg = config(DSV32)
    tp8 = sizing.plan(cfg, layout(tp=8)).weights_breakdown["routed_experts"]
    ep8 = sizing.plan(cfg, layout(tp=8, ep=8)).weights_breakdown["routed_experts"]
    one = sizing.plan(cfg, layout()).weights_breakdown["routed_experts"]
    assert tp8 == ep8 == one // 8
    dp = sizing.plan(cfg, layout(tp=2, dp=4, ep=8))
    assert dp.weights_breakdown["routed_experts"] == one // 8
    assert (
        dp.weights_breakdown["attention"]
        == sizing.plan(cfg, layout(tp=2)).weights_breakdown["attention"]
    )


def test_fp8_block_scales_and_ignore_lists():
    fp8 = quant.WeightFormat("fp8", block=(128, 128))
    assert fp8.matrix_bytes(7168, 2048) == 7168 * 2048 + 4 * 56 * 16
    assert quant.WeightFormat("nvfp4").matrix_bytes(4096, 6144) == 4096 * 6144 * 9 // 16 + 8
    ct = quant.scheme(
        {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                }
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
        }
    )
    assert ct.format_for("", ["model.layers.3.self_attn.q_b_proj"]) == quant.BF16
    assert (
        ct.format_for("routed_expert", ["model.layers.3.mlp.experts.0.gate_proj"]).kind == "nvfp4"
    )
    ex = quant.scheme({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0"]})
    assert ex.format_for("", ["model.layers.0.mlp.gate_proj"]) == quant.BF16
    assert ex.format_for("", ["model.layers.10.mlp.gate_proj"]).kind == "fp8"


def test_weights_override():
    result = sizing.plan(config(GLM52), layout(weights_bytes=100 * GiB))
    assert result.weights_bytes == 100 * GiB and not result.weights_estimated


# --- budget and warnings ------------------------------------------------------------------


def test_negative_budget_warns():
    result = sizing.plan(
        glm52_nvfp4(),
        layout(
            pcp=4,
            dcp=4,
            ep=4,
            max_num_batched_tokens=32768,
            gpu_memory_utilization=0.92,
            reserve_bytes=20 * GiB,
            attention_backend=backend.FLASHINFER,
        ),
    )
    assert result.kv_budget_bytes < 0 and result.kv_tokens == 0
    assert any(w.startswith("KV budget is negative") for w in result.warnings)


def test_large_workspace_share_warns():
    result = sizing.plan(
        glm52_nvfp4(),
        layout(
            pcp=4,
            dcp=4,
            ep=4,
            max_num_batched_tokens=32768,
            gpu_memory_utilization=0.96,
            attention_backend=backend.FLASHINFER,
        ),
    )
    assert result.kv_budget_bytes > 0
    assert any("workspace" in w and "%" in w for w in result.warnings)
    small = sizing.plan(
        glm52_nvfp4(),
        layout(
            pcp=4,
            dcp=4,
            ep=4,
            max_num_batched_tokens=4096,
            gpu_memory_utilization=0.96,
            attention_backend=backend.FLASHINFER,
        ),
    )
    assert not any("% of the memory" in w for w in small.warnings)


def test_budget_arithmetic_and_token_count():
    result = sizing.plan(config(DSV32), layout(tp=8, dcp=8, kv_cache_dtype="fp8"))
    usable = int(int(B200 * GiB) * 0.92)
    assert result.usable_bytes == usable
    assert (
        result.kv_budget_bytes == usable - result.weights_bytes - result.workspace_bytes - 8 * GiB
    )
    assert result.kv_tokens == int(result.kv_budget_bytes / result.kv_bytes_per_token)


def test_default_batched_tokens_follow_vllm_gpu_tiers():
    assert sizing.default_max_num_batched_tokens(int(B200 * GiB)) == 16384
    assert sizing.default_max_num_batched_tokens(140 * GiB) == 8192
    assert sizing.default_max_num_batched_tokens(48 * GiB) == 2048
    assert sizing.plan(config(GLM52), layout()).max_num_batched_tokens == 16384


# --- the CLI ------------------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str, str]:
    return cli_run.run(capsys, "plan", *argv)


def test_cli_text(capsys):
    code, out, err = run(
        capsys,
        "--config",
        str(GLM52),
        "--gpu-memory-gib",
        str(B200),
        "--pcp",
        "4",
        "--dcp",
        "4",
        "--ep",
        "4",
        "--expert-dtype",
        "nvfp4",
        "--kv-cache-dtype",
        "fp8",
        "--gpu-memory-utilization",
        "0.96",
        "--max-num-batched-tokens",
        "32768",
        "--attention-backend",
        "FLASHINFER_MLA_SPARSE",
    )
    assert code == 0 and not err
    assert "16.39 GiB (17,594,056,704 B)" in out
    assert "64 heads/rank" in out
    assert "WARNING: vLLM 0.33.0 refuses --attention-backend FLASHINFER_MLA_SPARSE" in out


def test_cli_refuses_a_layout_where_no_kv_cache_fits(capsys):
    """A negative KV budget is no plan (vLLM would not start): one line, exit 2, saying what
    is missing. From an unquantized config it is nearly always the checkpoint's format."""
    glm = ["--config", str(GLM52), "--gpu-memory-gib", str(B200)]
    seed_002 = ["--tp", "2", "--pcp", "2", "--ep", "4", "--gpu-memory-utilization", "0.85"]
    for fmt in ("text", "json"):
        code, out, err = run(capsys, *glm, *seed_002, "--format", fmt)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("mla-serve: error: no KV cache fits on a rank: weights 357.58 GiB")
        assert "the config has no quantization_config, so every weight counts as bf16" in err
        assert "--expert-dtype nvfp4" in err and "--weights-gib" in err
    code, out, _ = run(capsys, *glm, *seed_002, "--expert-dtype", "nvfp4")
    assert code == 0 and "KV budget" in out
    # Quantized, the weights fit, the reserve does not: the line names the other knobs.
    code, out, err = run(capsys, *glm, *seed_002, "--expert-dtype", "nvfp4", "--reserve-gib", "150")
    assert code == 2 and out == "" and "exceed 0.85 x 179.06 GiB by" in err
    assert "raise --gpu-memory-utilization, lower --reserve-gib" in err
    assert "quantization_config" not in err.split("(weights as")[0]
    code, out, err = run(capsys, "--config", str(DSV4_FLASH), "--gpu-memory-gib", "80", "--tp", "1")
    assert code == 2 and out == "" and "no KV cache fits on a rank" in err


def test_cli_text_reports_workspace_not_allocated(capsys):
    code, out, _ = run(
        capsys,
        *("--config", str(GLM52), "--gpu-memory-gib", str(B200), "--pcp", "4", "--dcp", "4"),
        *("--ep", "4", "--expert-dtype", "nvfp4"),
    )
    assert code == 0
    assert "workspace         not allocated (FLASHMLA_SPARSE)" in out


def test_cli_json_shape(capsys):
    code, out, err = run(
        capsys,
        "--config",
        str(GLM52),
        "--gpu-memory-gib",
        str(B200),
        "--pcp",
        "4",
        "--dcp",
        "4",
        "--ep",
        "4",
        "--expert-dtype",
        "nvfp4",
        "--gpu-memory-utilization",
        "0.96",
        "--max-num-batched-tokens",
        "4096",
        "--attention-backend",
        "FLASHINFER_MLA_SPARSE",
        "--format",
        "json",
    )
    assert code == 0 and not err
    doc = json.loads(out)
    assert doc["model"] == "GLM-5.2"
    assert set(doc["layout"]) == {
        "tp",
        "pcp",
        "dcp",
        "dp",
        "ep",
        "max_num_batched_tokens",
        "kv_cache_dtype",
        "attention_backend",
    }
    assert set(doc["per_rank"]) == {
        "workspace_bytes",
        "weights_bytes",
        "kv_bytes_per_token",
        "kv_budget_bytes",
        "kv_tokens",
        "gpu_memory_bytes",
        "reserve_bytes",
    }
    assert doc["layout"] == {
        "tp": 1,
        "pcp": 4,
        "dcp": 4,
        "dp": 1,
        "ep": 4,
        "max_num_batched_tokens": 4096,
        "kv_cache_dtype": "fp8_e4m3",  # auto, made fp8_e4m3 by GLM-5.x's hook on SM10x
        "attention_backend": "FLASHINFER_MLA_SPARSE",
    }
    assert doc["per_rank"]["workspace_bytes"] == 2_561_671_168
    assert doc["per_rank"]["reserve_bytes"] == 8 * GiB
    assert isinstance(doc["warnings"], list) and doc["warnings"]
    assert doc["per_rank"]["kv_bytes_per_token"] == (78 * 576 + 21 * 132) // 4


def test_cli_json_fractional_bytes_per_token(capsys):
    code, out, _ = run(
        capsys,
        "--config",
        str(DSV32),
        "--gpu-memory-gib",
        "179",
        "--tp",
        "8",
        "--dcp",
        "8",
        "--kv-cache-dtype",
        "fp8",
        "--format",
        "json",
    )
    assert code == 0
    assert json.loads(out)["per_rank"]["kv_bytes_per_token"] == (61 * 576 + 61 * 132) / 8


def bad_input_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    dense = tmp_path / "dense.json"
    dense_cfg = config(DSV32)
    del dense_cfg["index_topk"]
    dense.write_text(json.dumps(dense_cfg))
    wrong = tmp_path / "wrong.json"
    wrong_cfg = copy.deepcopy(config(GLM52))
    wrong_cfg["kv_lora_rank"] = "512"
    wrong.write_text(json.dumps(wrong_cfg))
    glm = str(GLM52)
    return [
        (["--config", str(tmp_path / "missing.json")], "no such file"),
        (["--config", str(llama)], "not a multi-head latent attention (MLA) config"),
        (["--config", str(tmp_path)], "is a directory"),
        (["--config", str(broken)], "not valid JSON"),
        (["--config", str(array)], "must be a JSON object"),
        (["--config", str(llama)], "kv_lora_rank"),
        (["--config", str(dense)], "index_topk"),
        (["--config", str(wrong)], "kv_lora_rank"),
        (["--config", str(DSV4_FLASH), "--pcp", "2"], "DeepSeek-V4 with --pcp > 1"),
        (["--config", str(DSV4_FLASH), "--kv-cache-dtype", "bfloat16"], "stores fp8 only"),
        (["--config", str(DSV4_FLASH), "--tp", "3"], "does not divide num_attention_heads 64"),
        (["--config", str(DSV4_FLASH), "--tp", "2", "--dcp", "4"], "must divide --tp"),
        (["--config", glm, "--tp", "3"], "does not divide num_attention_heads 64"),
        (["--config", glm, "--tp", "2", "--dcp", "4"], "must divide --tp"),
        (["--config", glm, "--tp", "2", "--pcp", "2", "--dcp", "3"], "--dcp must be one of"),
        (
            ["--config", glm, "--tp", "2", "--ep", "3"],
            "--ep must be 1 (no expert parallelism) or 2\n",
        ),
        (
            ["--config", glm, "--ep", "3"],
            "TP x PCP x DP = 1 rank(s) (--enable-expert-parallel), so --ep must be 1\n",
        ),
        (["--config", glm, "--gpu-memory-utilization", "1.5"], "utilization"),
        (["--config", str(GLM53_FLASH), "--pcp", "2", "--dcp", "2"], "no sparse-MLA backend"),
    ]


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    for argv, message in bad_input_cases(tmp_path):
        code, out, err = run(capsys, *argv, "--gpu-memory-gib", str(B200))
        assert code == 2, (argv, out, err)
        assert err.startswith("mla-serve: error: ") and message in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert out == ""


def test_argparse_errors_exit_2(capsys):
    for argv in (
        ["--gpu-memory-gib", "179"],
        ["--config", str(GLM52), "--tp", "0", "--gpu-memory-gib", "179"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", *argv])
        assert exit_.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_every_fixture_has_a_source_note():
    readme = (MODELS / "README.md").read_text()
    for model in ("DeepSeek-V3.2", "GLM-5.2", "GLM-5.3-Flash", "DeepSeek-V4-Flash"):
        assert (MODELS / model / "config.json").is_file()
        assert f"## {model}" in readme


def test_dsv4_cache_is_vllms_compressed_layout():
    """DeepSeek-V4-Flash: 21 layers at compress ratio 4 (584 B fp8_ds_mla state per 4 tokens,
    plus a 132 B indexer state per 4 tokens), 20 at 128, 2 sliding-window only."""
    from mla_serve.sizing import dsv4

    cfg = config(DSV4_FLASH)
    shape_ = dsv4.from_config(cfg)
    cache = dsv4.cache(shape_, "fp8_ds_mla", dcp=1)
    assert cache.compressed == {4: 21, 128: 20} and cache.indexer_layers == 21
    # 256-token pages rounded up to 576 B: 64 x 584 -> 37,440; 2 x 584 -> 1,728; 64 x 132 -> 8,640
    assert cache.bytes_per_token == (21 * (37_440 + 8_640) + 20 * 1_728) / 256
    assert dsv4.cache(shape_, "fp8_ds_mla", dcp=2).bytes_per_token == cache.bytes_per_token / 2
    # per sequence: 43 sliding windows of 128 tokens, the compressors' fp32 states
    swa = 43 * 128 * 584
    states = 21 * 8 * 2 * 2 * 512 * 4 + 20 * 128 * 2 * 512 * 4 + 21 * 8 * 2 * 2 * 128 * 4
    assert cache.bytes_per_sequence == swa + states


def test_dsv4_indexer_cache_at_the_indexer_kv_dtype():
    """attention_config.indexer_kv_dtype (vllm#52550): DeepSeek-V4's indexer K state is 132 B
    in fp8 (vLLM's "auto" on NVIDIA) and 68 B in mxfp4 (64 B of packed values and 4 UE8M0
    scales, DeepseekV4Indexer's k_cache_head_dim), each page of 64 states rounded up to 576 B."""
    from mla_serve.sizing import dsv4

    shape_ = dsv4.from_config(config(DSV4_FLASH))
    assert dsv4.indexer_state_bytes(shape_, "auto") == dsv4.indexer_state_bytes(shape_, "fp8")
    assert dsv4.indexer_state_bytes(shape_, "fp8") == 132
    assert dsv4.indexer_state_bytes(shape_, "mxfp4") == 68
    fp8 = dsv4.cache(shape_, "fp8_ds_mla", dcp=1)
    fp4 = dsv4.cache(shape_, "fp8_ds_mla", dcp=1, indexer_kv_dtype="mxfp4")
    assert fp8.bytes_per_token - fp4.bytes_per_token == Fraction(21 * (8_640 - 4_608), 256)
    with pytest.raises(sizing.SizingError, match="not 'nvfp4'"):
        dsv4.indexer_state_bytes(shape_, "nvfp4")


def test_the_plan_counts_the_indexer_at_the_profiles_dtype(capsys):
    common = ["--config", str(DSV4_FLASH), "--gpu-memory-gib", str(B200), "--tp", "2"]
    plans = {}
    for dtype in ("auto", "mxfp4"):
        code, out, err = run(capsys, *common, "--indexer-kv-dtype", dtype, "--format", "json")
        assert code == 0, err
        plans[dtype] = json.loads(out)
    assert plans["auto"]["layout"]["indexer_kv_dtype"] == "fp8"
    assert plans["mxfp4"]["layout"]["indexer_kv_dtype"] == "mxfp4"
    assert plans["mxfp4"]["per_rank"]["kv_tokens"] > plans["auto"]["per_rank"]["kv_tokens"]
    # GLM-5.x and DeepSeek-V3.2 keep an fp8 indexer whatever the setting: said, and counted so
    glm = ["--config", str(GLM53_FLASH), "--gpu-memory-gib", str(B200), "--tp", "4"]
    code, out, err = run(capsys, *glm, "--indexer-kv-dtype", "mxfp4", "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert any("only DeepSeek-V4 reads it" in w for w in doc["warnings"])
    assert doc["details"]["kv"]["indexer_bytes_per_state"] == 132


def test_dsv4_config_in_transformers_format_sizes_the_same():
    """transformers' DeepseekV4Config names a type per layer and a ratio per type (what vLLM's
    get_compress_ratios reads): the same ratios as the legacy compress_ratios list."""
    from mla_serve.sizing import dsv4

    legacy = config(DSV4_FLASH)
    names = {0: "sliding_attention", 4: "csa", 128: "hca"}
    text = dict(legacy)
    ratios = text.pop("compress_ratios")
    text["layer_types"] = [names[r] for r in ratios[: text["num_hidden_layers"]]]
    text["compress_rates"] = {"csa": 4, "hca": 128}
    assert dsv4.from_config(text).compress_ratios == dsv4.from_config(legacy).compress_ratios
    text.pop("compress_rates")
    with pytest.raises(sizing.SizingError, match="compress_rates with layer_types"):
        dsv4.from_config(text)


def test_dsv4_plan_on_the_profile_layout(capsys):
    code, out, err = run(
        capsys,
        "--config",
        str(DSV4_FLASH),
        "--gpu-memory-gib",
        str(B200),
        "--tp",
        "2",
        "--ep",
        "2",
        "--format",
        "json",
    )
    assert code == 0, err
    doc = json.loads(out)
    rank = doc["per_rank"]
    assert doc["layout"]["attention_backend"] == "FLASHMLA_SPARSE"
    assert doc["layout"]["kv_cache_dtype"] == "fp8_ds_mla"
    assert doc["warnings"] == []
    # the FlashMLA prefill gather vLLM reserves at warm-up, at the model's 1,048,576 tokens and
    # vLLM's 16384 batched tokens on a B200: the ratio-4 layers' 4 x (262,144 + 128 + 16,384)
    # bf16 rows of 512, 16,384 x 640 int32 indices, 16,384 int32 lengths
    assert doc["layout"]["max_model_len"] == 1_048_576
    gather = 4 * (262_144 + 128 + 16_384) * 512 * 2
    assert rank["workspace_bytes"] == gather + 16_384 * 640 * 4 + 16_384 * 4
    # the routed experts (MXFP4, 128 of 256 per rank under EP2) dominate the weights
    parts = doc["details"]["weights_breakdown"]
    experts = 43 * 128 * 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32)
    assert parts["routed_experts"] == experts
    assert rank["weights_bytes"] == sum(parts.values())
    budget = int(int(B200 * GiB) * 0.92) - rank["weights_bytes"] - rank["workspace_bytes"] - 8 * GiB
    assert rank["kv_budget_bytes"] == budget
    assert rank["kv_tokens"] == int(budget / rank["kv_bytes_per_token"])
    code, out, _ = run(
        capsys, "--config", str(DSV4_FLASH), "--gpu-memory-gib", str(B200), "--tp", "2"
    )
    assert code == 0 and "KV tokens" in out and "per sequence" in out


def test_every_format_flag_has_help():
    """`--format` says what each choice gives, in every command that has it."""
    from mla_serve import cli

    def walk(parser):
        for action in parser._actions:
            if "--format" in action.option_strings:
                yield parser.prog, action
            for sub in getattr(action, "choices", None) or {}:
                if isinstance(action.choices, dict):
                    yield from walk(action.choices[sub])

    found = list(walk(cli.parser()))
    assert {prog for prog, _ in found} >= {"mla-serve plan", "mla-serve patches list"}
    for prog, action in found:
        assert action.help and "json" in action.help.lower(), prog
