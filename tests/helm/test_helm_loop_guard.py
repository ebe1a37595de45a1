"""sidecar.loopGuard: the rendered sidecar flags, read back by the sidecar's own argument parser
and settings, and the checks that refuse values vLLM or the sidecar cannot use."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.helm.helm_support import render, sidecar_settings


def test_defaults_observe_with_the_documented_loop_definition() -> None:
    settings = sidecar_settings({})
    policy = settings.loop_policy
    assert policy.action == "observe" and dict(policy.model_actions) == {}
    config = policy.config
    assert (config.min_repeats, config.window_chars, config.min_chars) == (4, 4096, 1024)
    assert policy.repetition_detection is None and policy.thinking_token_budget is None


def test_stop_per_model_and_vllm_defaults_reach_the_sidecar() -> None:
    values = {
        "vllm": {"reasoningParser": "deepseek_v3"},
        "sidecar": {
            "loopGuard": {
                "action": "off",
                "modelActions": {"dsv4": "stop", "glm": "observe"},
                "minRepeats": 3,
                "windowChars": 6000,
                "minChars": 800,
                "vllmDefaults": {
                    "repetitionDetection": {"maxPatternSize": 64, "minCount": 8},
                    "thinkingTokenBudget": 16384,
                },
            }
        },
    }
    policy = sidecar_settings(values).loop_policy
    assert policy.action == "off"
    assert dict(policy.model_actions) == {"dsv4": "stop", "glm": "observe"}
    assert (policy.config.min_repeats, policy.config.window_chars) == (3, 6000)
    assert policy.config.min_chars == 800
    assert policy.repetition_detection == {
        "max_pattern_size": 64,
        "min_pattern_size": 0,
        "min_count": 8,
    }
    assert policy.thinking_token_budget == 16384


@pytest.mark.parametrize(
    ("guard", "message"),
    [
        (
            {"vllmDefaults": {"thinkingTokenBudget": 100}},
            "thinkingTokenBudget needs vllm.reasoningParser",
        ),
        (
            {"vllmDefaults": {"repetitionDetection": {"maxPatternSize": 8, "minCount": 1}}},
            "vLLM needs minCount >= 2",
        ),
        ({"windowChars": 512}, "windowChars must be at least"),
    ],
)
def test_unusable_values_fail_the_render(guard: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render({"sidecar": {"loopGuard": guard}})
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "guard",
    [{"action": "kill"}, {"modelActions": {"dsv4": "halt"}}, {"minRepeats": 1}, {"extra": 1}],
)
def test_the_schema_refuses_bad_guard_values(guard: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"sidecar": {"loopGuard": guard}})
