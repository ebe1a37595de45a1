"""Label values are closed sets: no request and no upstream answer can grow the series."""

from __future__ import annotations

from mla_serve.sidecar.passthrough import labels
from mla_serve.sidecar.passthrough.labels import OTHER, UNKNOWN, Labels, finished_reason


def test_a_model_is_a_label_only_when_vllm_serves_it_or_the_settings_name_it() -> None:
    served = ["glm-5.3-flash"]
    values = Labels(lambda: served, configured=["canary-model"])
    assert values.model("glm-5.3-flash") == "glm-5.3-flash"
    assert values.model("canary-model") == "canary-model"
    assert values.model("m-1-xyz") == OTHER
    assert values.model(None) == UNKNOWN
    served.append("lora-a")  # an adapter loaded at run time: a label from then on
    assert values.model("lora-a") == "lora-a"


def test_at_most_max_models_model_values_are_ever_used() -> None:
    served = [f"lora-{i}" for i in range(labels.MAX_MODELS + 10)]
    values = Labels(lambda: served)
    used = {values.model(name) for name in served}
    assert len(used - {OTHER}) == labels.MAX_MODELS and OTHER in used
    assert values.model("lora-0") == "lora-0"  # a value once used stays one


def test_finished_reasons_are_vllms_else_other() -> None:
    for reason in ("stop", "length", "tool_calls", "abort", "repetition"):
        assert finished_reason(reason) == reason
    assert finished_reason(None) == "error"
    assert finished_reason("made-up-reason-42") == OTHER
