"""The CPU stand-in speaks vLLM 0.33.0's protocol: checked by vLLM's own classes.

Streamed chunks must survive vLLM's `model_validate` + `model_dump(exclude_unset=True)`
unchanged (that is how vLLM serializes them); whole responses must equal vLLM's full
`model_dump()` (how its routers serialize them); metric names must exist in vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import vllm_standin
from tests.vllm_standin import Script, model_list

STANDIN_RELEASE = vllm_standin.VERSION
OUTCOMES = ("answer", "runaway", "tools")


@pytest.fixture(autouse=True)
def only_the_release_it_imitates(expect):
    if expect.release != STANDIN_RELEASE:
        pytest.skip(f"the stand-in imitates vLLM {STANDIN_RELEASE}")


def _body(stream: bool) -> dict[str, object]:
    return {"model": "m", "max_tokens": 6, "stream": stream,
            "stream_options": {"include_usage": True}}  # fmt: skip


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("chat", [True, False])
def test_stream_chunks_are_what_vllm_serializes(outcome, chat):
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionStreamResponse as Chunk,
        )
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse as Chunk
    for chunk in Script(outcome, _body(True), chat, 5).chunks():
        parsed = Chunk.model_validate(chunk)
        assert parsed.model_dump(exclude_unset=True, exclude_none=not chunk["choices"]) == chunk


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("chat", [True, False])
def test_whole_responses_are_what_vllm_serializes(outcome, chat):
    if chat:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse as Response,
        )
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse as Response
    whole = Script(outcome, _body(False), chat, 5).whole()
    assert Response.model_validate(whole).model_dump() == whole


def test_models_and_metrics_are_vllms():
    from vllm.entrypoints.serve.engine.protocol import ModelList

    listing = model_list(["a", "b"], 4096)
    assert ModelList.model_validate(listing).model_dump() == listing
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    names = {line.split("{")[0] for line in vllm_standin.VLLM_METRICS.splitlines()
             if line.startswith("vllm:")}  # fmt: skip
    for name in names:
        assert f'"{name.removesuffix("_total")}"' in source, name
