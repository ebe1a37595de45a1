"""The tiny models of tests/e2e/model.py against vLLM 0.33.0's own code, on the CPU.

Serving them (the CUDA model classes, the kernels, CUDA graphs) is `make e2e`'s, on a
GPU. Here, for each model a layout serves (and the tiny GLM-5.2):

* the directories are byte-for-byte reproducible, with the token layout the e2e tests
  rely on, and transformers' strict config classes load them;
* vLLM's own render server (the CPU-only server of `vllm launch render`), started with
  the layout's serve flags, renders chat with thinking on and off to the prompt the
  reasoning parser expects, and its derender endpoint splits a sample reply into
  reasoning and content, and a tool call into a tool call, with the profile's parsers;
* `vllm serve`'s arguments make the engine config, and the model class vLLM picks for
  the CPU platform is built on the meta device where vLLM allows it (tests/e2e/cpu_check.py);
* GLM-5.3-Flash, whose model module needs a CUDA build of torchvision (no render server
  here): transformers' config, vLLM's tokenizer and chat-template path and its glm45 and
  glm47 parsers; GLM-5.3 always thinks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests import trees
from tests.e2e import layouts, model
from tests.http_server import free_port

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "0.33.0"  # the release the tiny models are made for (model.py)
START_S = 300  # a vLLM start-up on a loaded 2-core machine
QUESTION = [{"role": "user", "content": "Why do sparse attention kernels need a top-k?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_DSML = "\uff5cDSML\uff5c"
TOOL_CALL_TEXT = {  # the tool parser -> a call of get_weather(city="Paris") in its markup
    "deepseek_v4": (
        f'<{_DSML}tool_calls>\n<{_DSML}invoke name="get_weather">\n<{_DSML}parameter '
        f'name="city" string="true">Paris</{_DSML}parameter>\n</{_DSML}invoke>\n'
        f"</{_DSML}tool_calls>"
    ),
    "glm47": (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    common = tmp_path_factory.mktemp("common")
    model.write_all(common)
    return common


@pytest.fixture(scope="module")
def scaled() -> dict[str, dict[str, Any]]:
    return layouts.layouts(gpus=2)


def vllm_env() -> dict[str, str]:
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(trees.pristine(RELEASE))]),
    )


def cpu_check(*argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.cpu_check", *argv],
        cwd=ROOT, env=vllm_env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("CPU-CHECK ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return dict(json.loads(lines[0].split(" ", 1)[1]))


def test_model_directories_are_reproducible_with_the_layout_the_tests_use(
    models: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again"
    written = model.write_all(again)
    assert sorted(p.name for p in written) == sorted(p.name for p in models.iterdir())
    for directory in written:
        for file in directory.iterdir():
            assert file.read_bytes() == (models / directory.name / file.name).read_bytes()
    for tiny in model.MODELS.values():
        tokenizer = Tokenizer.from_file(str(models / tiny.directory() / "tokenizer.json"))
        assert tokenizer.get_vocab_size() == model.VOCAB_SIZE
        added = tokenizer.get_added_tokens_decoder()
        # <think> and </think> (and GLM's tool-call markup) are text to the parsers: not special
        for text in tiny.added:
            assert not added[tiny.token_id(text)].special, (tiny.name, text)
        for token in tiny.stop_ids:
            assert added[token].special and added[token].content in tiny.special
        encoded = tokenizer.encode("Hello").ids
        assert (encoded[0] == 0) == (tiny.bos is not None)  # DeepSeek's BOS; GLM's template
    with pytest.raises(ValueError, match="no 32-head variant"):
        model.DEEPSEEK_V4_FLASH.config_for(32)


def test_transformers_loads_each_config_with_its_strict_class(models: Path) -> None:
    from transformers import AutoConfig

    expected = {
        "deepseek-v3.2": "DeepseekV32Config",
        "deepseek-v4-flash": "DeepseekV4Config",
        "glm-5.3-flash": "Glm5NextTextConfig",
        "glm-5.2": "GlmMoeDsaConfig",
    }
    for name, tiny in model.MODELS.items():
        for heads in tiny.variants:
            config = AutoConfig.from_pretrained(models / tiny.directory(heads))
            assert type(config).__name__ == expected[name]
            assert config.num_attention_heads == heads
    v4 = AutoConfig.from_pretrained(models / model.DEEPSEEK_V4_FLASH.directory())
    assert (v4.head_dim, v4.qk_rope_head_dim, v4.index_topk) == (512, 64, 512)
    assert [v4.compress_rates.get(t, 0) for t in v4.layer_types] == [0, 4, 128]


@pytest.fixture
def render_server(tmp_path: Path) -> Iterator[Any]:
    """Start vLLM's CPU-only render server for a model directory and a layout's flags."""
    started: list[subprocess.Popen[bytes]] = []

    def start(directory: Path, tiny: model.Tiny, argv: list[str]) -> str:
        port = free_port()
        log = tmp_path / f"render-{tiny.name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.render.entry",
             "--model", str(directory), "--served-model-name", tiny.served_name,
             "--host", "127.0.0.1", "--port", str(port), *argv],
            cwd=tmp_path, env=vllm_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail(f"vLLM's render server did not start:\n{log.read_text()[-4000:]}")

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def served_layout(scaled: dict[str, dict[str, Any]], name: str) -> tuple[model.Tiny, list[str]]:
    """The tiny model and the serve flags a layout gives it; `glm-5.2`: the GLM-5.2 profiles'
    own tiny model on one GPU (no layout serves it yet)."""
    if name == model.GLM52.name:
        chart = scaled["b200-tp2-pcp2"]["chart_argv"]
        return model.GLM52, layouts.scale("b200-tp2-pcp2", chart, 1, model.GLM52)["argv"]
    return model.MODELS[scaled[name]["model"]], scaled[name]["argv"]


@pytest.mark.parametrize("name", ["tp1", "dsv4-flash@1", "glm-5.2"])
def test_vllm_renders_and_parses_chat_with_the_layouts_flags(
    name: str, models: Path, scaled: dict[str, dict[str, Any]], render_server: Any
) -> None:
    tiny, argv = served_layout(scaled, name)
    url = render_server(models / tiny.directory(), tiny, argv)
    tokenizer = Tokenizer.from_file(str(models / tiny.directory() / "tokenizer.json"))
    think, think_end = tiny.token_id(model.THINK), tiny.token_id(model.THINK_END)
    assert tiny.thinking_switch is not None
    for on in (True, False):
        chat = {"model": tiny.served_name, "messages": QUESTION,
                "chat_template_kwargs": {tiny.thinking_switch: on}}  # fmt: skip
        rendered = httpx.post(f"{url}/v1/chat/completions/render", json=chat, timeout=60)
        assert rendered.status_code == 200, rendered.text
        prompt = rendered.json()
        # The generation prompt opens the reasoning, or closes it at once.
        assert prompt["token_ids"][-1] == (think if on else think_end), prompt["token_ids"]
        assert prompt["reasoning_ended"] is (not on)
        answer = tokenizer.encode(" the answer", add_special_tokens=False).ids
        reasoning = [*tokenizer.encode("step one", add_special_tokens=False).ids, think_end]
        message = derender(url, chat, prompt["token_ids"], reasoning + answer if on else answer)
        if on:
            assert (message["reasoning"], message["content"]) == ("step one", " the answer")
        else:
            assert message["reasoning"] is None and message["content"] == " the answer"
    if "--tool-call-parser" in dict(layouts.split(argv)):
        assert tiny.tool_parser in TOOL_CALL_TEXT, tiny.tool_parser
        chat = {"model": tiny.served_name, "messages": QUESTION, "tools": [WEATHER],
                "chat_template_kwargs": {tiny.thinking_switch: False}}  # fmt: skip
        prompt = httpx.post(f"{url}/v1/chat/completions/render", json=chat, timeout=60).json()
        reply = tokenizer.encode(TOOL_CALL_TEXT[tiny.tool_parser], add_special_tokens=False).ids
        message = derender(url, chat, prompt["token_ids"], reply)
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def derender(url: str, chat: dict[str, Any], prompt: list[int], reply: list[int]) -> Any:
    """vLLM's derender of a generated reply: the chat completion message it returns."""
    body = {
        "generate_response": {
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": reply}]
        },
        "prompt_token_ids": prompt,
        "chat_request": chat,
    }
    answered = httpx.post(f"{url}/v1/chat/completions/derender", json=body, timeout=60)
    assert answered.status_code == 200, answered.text
    return answered.json()["choices"][0]["message"]


def test_vllm_builds_the_tiny_deepseek_v4_flash_on_the_meta_device(
    models: Path, scaled: dict[str, dict[str, Any]]
) -> None:
    """The layout's flags make vLLM's engine config; the CPU platform's DeepSeek-V4 class
    (sharing the attention, indexer and compressor layers with the CUDA one) builds one
    layer of each attention kind, the indexer only on C4A, hash routing on the first."""
    built = cpu_check("build", str(models / model.DEEPSEEK_V4_FLASH.directory()),
                      *scaled["dsv4-flash@1"]["argv"])  # fmt: skip
    assert built["architecture"] == "DeepseekV4ForCausalLM"
    assert built["tokenizer_mode"] == "deepseek_v4"
    assert (built["dtype"], built["quantization"]) == ("torch.bfloat16", None)
    assert built["is_moe"] and built["expert_parallel"]
    assert built["reasoning_parser"] == "deepseek_v4"
    attention = [built["attention"][f"model.layers.{i}.attn"] for i in range(3)]
    assert [a["compress_ratio"] for a in attention] == [1, 4, 128]
    assert [a["indexer"] for a in attention] == [False, True, False]
    assert {a["heads"] for a in attention} == {64}
    experts = [built["experts"][f"model.layers.{i}.ffn"] for i in range(3)]
    assert [e["hash_routed"] for e in experts] == [True, False, False]
    assert {e["routed_experts"] for e in experts} == {16}


def test_vllms_scheduler_serves_a_resent_deepseek_v4_prompt_from_its_prefix_cache(
    models: Path, scaled: dict[str, dict[str, Any]]
) -> None:
    """vllm#42948 (a re-sent request gets 0 % prefix-cache hits on DeepSeek-V4-Flash) against
    vLLM's own KV-cache planning, Scheduler and KV cache manager over the tiny model's layer
    specs (its sliding-window, compressed, indexer and compressor-state groups), the layout's
    flags, chunked prefill: the re-sent prompt is served from every 256-token block but the
    last token's. A prompt sharing only a 1000-token prefix gets no hit the first time (the
    sliding-window groups kept their window only where the first prompt ended: vLLM records
    the uncached common prefix) and 768 tokens the next time."""
    found = cpu_check("prefix-cache", str(models / model.DEEPSEEK_V4_FLASH.directory()),
                      *scaled["dsv4-flash@1"]["argv"])  # fmt: skip
    kinds = {kind for kind, _, _ in found["groups"]}
    assert kinds == {"SlidingWindowMLASpec", "MLAAttentionSpec"}, found["groups"]
    assert len(found["groups"]) > 2  # a hybrid cache: several groups per kind
    unit = found["cache_hit_alignment_tokens"]
    assert unit == found["block_size"] == 256
    prompt, shared = found["prompt_tokens"], found["shared_tokens"]
    assert found["hits"] == [0, (prompt - 1) // unit * unit, 0, shared // unit * unit]


def test_plans_deepseek_v4_memory_outside_the_kv_cache_is_vllms(
    models: Path, scaled: dict[str, dict[str, Any]]
) -> None:
    """`mla-serve plan`'s non-KV figures for the tiny DeepSeek-V4-Flash against what vLLM's own
    code fixes before it profiles (vllm#54677, #49224: more non-KV memory than planned): the
    FlashMLA prefill gather workspace vLLM's warm-up run reserves, byte for byte, and the
    weights, every matrix as vLLM builds it; what the plan leaves out of the weights is the
    small tensors (norms, fp32 compressor position biases and mixers, the hash-routing
    table), under 0.2 %. The activation peak and the CUDA graph pool are measured on a GPU
    (the plan's reserve stands for them)."""
    tiny = model.DEEPSEEK_V4_FLASH
    found = cpu_check("memory", str(models / tiny.directory()), *scaled["dsv4-flash@1"]["argv"])
    reserved = found["prefill_workspace_bytes"]
    assert len(reserved) == 3 and len(set(reserved.values())) == 3  # one per attention kind
    args = [
        "plan", "--config", str(models / tiny.directory() / "config.json"),
        "--gpu-memory-gib", "139.8", "--format", "json",
        "--max-model-len", str(found["max_model_len"]),
        "--max-num-batched-tokens", str(found["max_num_batched_tokens"]),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "mla_serve.cli", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)["per_rank"]
    assert planned["workspace_bytes"] == max(reserved.values())
    left_out = found["parameter_bytes"] - planned["weights_bytes"]
    assert 0 <= left_out < 0.002 * found["parameter_bytes"], (found, planned)


def test_vllm_takes_the_tiny_glm52_config_and_declines_sparse_mla_on_cpu(
    models: Path, scaled: dict[str, dict[str, Any]]
) -> None:
    """GLM-5.2's engine config is vLLM's; its V3.2 layers are CUDA's only: vLLM's CPU
    platform refuses them, in its own words."""
    tiny, argv = served_layout(scaled, model.GLM52.name)
    built = cpu_check("build", str(models / tiny.directory()), *argv)
    assert built["architecture"] == "GlmMoeDsaForCausalLM"
    assert built["is_moe"] and built["reasoning_parser"] == "glm45"
    assert built["refused"] == "Sparse Attention is not supported on CPU."


def test_glm53_always_thinks_by_vllms_own_parser(models: Path) -> None:
    checked = cpu_check("glm53", str(models / model.GLM53_FLASH.directory()))
    assert (checked["config_class"], checked["qk_rope_head_dim"]) == ("Glm5NextTextConfig", 0)
    assert checked["extra"] == {"mhc": True, "mla_use_nope": True}
    assert checked["layer_types"].count("linear_attention") == 3
    assert checked["linear"] == [64, 128, -5.0]
    # No switch: thinking=false renders the same prompt, opening <think>; effort is kept.
    assert checked["prompt_thinking_off"].endswith("<|assistant|><think>")
    assert "Reasoning Effort: max" in checked["prompt_thinking_off"]
    assert "Reasoning Effort: low" in checked["prompt_effort_low"]
    assert checked["always_thinks"] is True
    assert checked["parsed"]["thinking_off"] == ["step one", " the answer"]
    assert checked["parsed"]["default"] == ["step one", " the answer"]
    assert checked["tool_calls"] == [["get_weather", {"city": "Paris"}]]
