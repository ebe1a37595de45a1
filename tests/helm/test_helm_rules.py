"""The PrometheusRule's alerts: promtool check rules, and promtool test rules with cases that
must fire and cases that must not (tests/helm/promtool/alerts_test.yaml).

promtool comes from Debian's `prometheus` package (.ci/run installs it). Without it these tests
skip, unless MLA_SERVE_REQUIRE_PROMTOOL=1 (set by CI) makes them fail.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.helm_support import CHART, HERE, case_documents, find, promtool, run

RULES_CASE = "monitoring-dsv4-flash"
ALERTS_TEST = HERE / "promtool" / "alerts_test.yaml"


@pytest.fixture(scope="module")
def promtool_bin() -> str:
    found = promtool()
    if found is None:
        message = "promtool not found (apt-get install prometheus; .ci/run does)"
        if os.environ.get("MLA_SERVE_REQUIRE_PROMTOOL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def rule_spec(case: str) -> dict[str, Any]:
    """The PrometheusRule's .spec: a plain Prometheus rule file."""
    spec: dict[str, Any] = find(case_documents(case), "PrometheusRule")["spec"]
    return spec


def alerts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in spec["groups"] for rule in group["rules"] if "alert" in rule]


def without_annotations(spec: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(spec)
    for rule in alerts(stripped):
        rule.pop("annotations", None)
    return stripped


@pytest.mark.parametrize("case", ["monitoring-dsv4-flash", "passthrough-off-b200-tp2-pcp2"])
def test_promtool_check_rules(case: str, promtool_bin: str, tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_spec(case), sort_keys=False))
    result = run([promtool_bin, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts(rule_spec(case)))} rules found" in result.stdout


def test_promtool_alert_cases(promtool_bin: str, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump(without_annotations(rule_spec(RULES_CASE)), sort_keys=False)
    )
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    result = run([promtool_bin, "test", "rules", ALERTS_TEST.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_cases_that_fire_and_that_do_not() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for group in tests:
        for check in group["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alerts(rule_spec(RULES_CASE))}
    assert names - fires == set(), "alerts never expected to fire"
    assert names - quiet == set(), "alerts never expected to stay quiet"


def test_rules_do_not_depend_on_the_pass_through_setting() -> None:
    """With the pass-through off the same rules apply: the runaway alert falls back at run time
    on vLLM's length share wherever the sidecar relays no completions."""
    on = {r["alert"]: r["expr"] for r in alerts(rule_spec(RULES_CASE))}
    off = {r["alert"]: r["expr"] for r in alerts(rule_spec("passthrough-off-b200-tp2-pcp2"))}
    assert on["MlaServeLengthCapRunaways"] == off["MlaServeLengthCapRunaways"]
    assert "vllm:request_success_total" in on["MlaServeLengthCapRunaways"]
    assert 'finished_reason="length"' in on["MlaServeLengthCapRunaways"]


def test_intent_and_budget_follow_the_profile() -> None:
    """The CUDA graph intent and the not-ready delay are rendered from the values."""
    by_name = {r["alert"]: r for r in alerts(rule_spec("multinode-nvl72"))}  # gb300-tp4 based
    assert 'mode!="FULL_AND_PIECEWISE"' in by_name["MlaServeCudaGraphModeMismatch"]["expr"]
    assert by_name["MlaServeEngineNotReady"]["for"] == "55m"  # 20 + 15 + 15 + 5


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_every_alert_has_a_runbook_and_a_severity() -> None:
    runbooks = (CHART / "RUNBOOKS.md").read_text()
    anchors = {_anchor(h) for h in re.findall(r"^## (.+)$", runbooks, flags=re.M)}
    for rule in alerts(rule_spec(RULES_CASE)):
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"#{name.lower()}"), url
        assert name.lower() in anchors, f"RUNBOOKS.md has no section for {name}"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_annotations_expand(promtool_bin: str, tmp_path: Path) -> None:
    """The annotation templates expand as written (full rules, exact strings)."""
    spec = rule_spec(RULES_CASE)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    by_name = {r["alert"]: r["annotations"] for r in alerts(spec)}

    def expected(name: str, summary: str) -> dict[str, str]:
        return {**by_name[name], "summary": summary}

    sel = 'namespace="serving",mla_serve_release="mla",mla_serve_role="leader",pod="mla-0"'
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'mla_serve_completions_total{{{sel},model="dsv4",'
                        'finished_reason="length"}',
                        "values": "0+100x40",
                    },
                    {
                        "series": f'mla_serve_runaway_completions_total{{{sel},model="dsv4"}}',
                        "values": "0+5x40",
                    },
                    {
                        "series": f'mla_serve_cudagraph_mode_info{{{sel},rank="2",mode="NONE"}}',
                        "values": "1x40",
                    },
                    {
                        "series": f'mla_serve_reasoning_loops_total{{{sel},model="dsv4",'
                        'channel="reasoning"}',
                        "values": "0+2x40",
                    },
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "20m",
                        "alertname": "MlaServeLengthCapRunaways",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "critical",
                                    "intended_cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "namespace": "serving",
                                    "pod": "mla-0",
                                    "model": "dsv4",
                                    "signal": "sidecar",
                                },
                                "exp_annotations": expected(
                                    "MlaServeLengthCapRunaways",
                                    "dsv4 on mla-0: 5% of completions ran away to the length cap "
                                    "with no answer",
                                ),
                            }
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "MlaServeCudaGraphModeMismatch",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "intended_cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "namespace": "serving",
                                    "pod": "mla-0",
                                    "rank": "2",
                                    "mode": "NONE",
                                },
                                "exp_annotations": expected(
                                    "MlaServeCudaGraphModeMismatch",
                                    "mla-0 rank 2 runs CUDA graph mode NONE, "
                                    "not FULL_AND_PIECEWISE",
                                ),
                            }
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "MlaServeReasoningLoops",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "namespace": "serving",
                                    "pod": "mla-0",
                                    "model": "dsv4",
                                },
                                "exp_annotations": expected(
                                    "MlaServeReasoningLoops",
                                    "dsv4 on mla-0: 10 generations caught in an exact loop in 5m",
                                ),
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "annotations_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run([promtool_bin, "test", "rules", "annotations_test.yaml"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
