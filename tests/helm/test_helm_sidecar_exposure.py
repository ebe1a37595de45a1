"""The chart's side of the sidecar's hardening: what the Service exposes, the
admin port, vLLM's API key for both containers, and the drain on pod termination."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest

from tests.helm.helm_support import (
    NOTES,
    case_documents,
    case_values,
    documents,
    find,
    merge,
    render,
    sidecar_container,
    sidecar_settings,
    vllm_container,
)


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(find(docs, "Deployment")["spec"]["template"]["spec"])


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


def test_service_exposes_only_the_pass_through_and_probes_use_the_admin_port() -> None:
    docs = case_documents("default")
    service = find(docs, "Service")["spec"]
    assert [port["targetPort"] for port in service["ports"]] == ["sidecar-http"]
    sidecar = sidecar_container(_pod(docs))
    ports = {port["name"]: port["containerPort"] for port in sidecar["ports"]}
    assert ports == {"sidecar-http": 8080, "sidecar-admin": 8081}
    assert _arg(sidecar, "--port") == "8080" and _arg(sidecar, "--admin-port") == "8081"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["httpGet"]["port"] == "sidecar-admin", probe


def test_monitors_and_network_policy_scrape_the_admin_port() -> None:
    docs = case_documents("monitoring-dsv4-flash")
    endpoints = find(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["vllm-http", "sidecar-admin"]
    docs = case_documents("passthrough-off-b200-tp2-pcp2")
    metrics = find(docs, "Service", "mla-mla-serve-metrics")["spec"]["ports"]
    assert [p["targetPort"] for p in metrics] == ["vllm-http", "sidecar-admin"]
    policy = find(docs, "NetworkPolicy")["spec"]["ingress"]
    assert {"port": "sidecar-admin", "protocol": "TCP"} in policy[1]["ports"]


def test_api_key_from_one_secret_for_vllm_and_the_sidecar() -> None:
    values = merge(case_values("default"), {"vllm": {"apiKey": {"secretName": "vllm-key"}}})
    pod = _pod(documents(render(values)))
    ref = {"secretKeyRef": {"name": "vllm-key", "key": "api-key"}}
    assert {"name": "VLLM_API_KEY", "valueFrom": ref} in vllm_container(pod)["env"]
    assert {"name": "MLA_SERVE_VLLM_API_KEY", "valueFrom": ref} in sidecar_container(pod)["env"]
    assert "--api-key" not in " ".join(vllm_container(pod)["args"])  # never on a command line
    plain = _pod(case_documents("default"))
    names = [e["name"] for c in plain["containers"] for e in c.get("env", [])]
    assert "VLLM_API_KEY" not in names and "MLA_SERVE_VLLM_API_KEY" not in names


def test_drain_on_termination_fits_the_grace_period() -> None:
    values = merge(
        case_values("default"),
        {"sidecar": {"drain": {"delaySeconds": 7, "timeoutSeconds": 40},
                     "extraRoutes": ["/v1/load_lora_adapter"],
                     "trustedProxies": ["10.0.0.0/8", "192.168.1.1"]}},
    )  # fmt: skip
    pod = _pod(documents(render(values)))
    sidecar, vllm = sidecar_container(pod), vllm_container(pod)
    assert sidecar["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert vllm["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "47"]
    assert _arg(sidecar, "--drain-timeout") == "40"
    assert _arg(sidecar, "--extra-routes") == "/v1/load_lora_adapter"
    assert _arg(sidecar, "--trusted-proxies") == "10.0.0.0/8,192.168.1.1"
    assert pod["terminationGracePeriodSeconds"] >= 7 + 40 + 10


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"terminationGracePeriodSeconds": 30}, "terminationGracePeriodSeconds=30 is shorter"),
        ({"sidecar": {"adminPort": 8080}}, "sidecar.adminPort 8080 is already taken"),
        ({"sidecar": {"adminPort": 8000}}, "sidecar.adminPort 8000 is already taken"),
    ],
)
def test_chart_refuses_an_exposed_admin_port_or_a_short_grace(
    override: dict[str, Any], expected: str
) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(merge(case_values("default"), override))
    assert expected in str(caught.value)


ADMIN_ROUTES = ("/livez", "/readyz", "/startupz", "/status", "/metrics")


@pytest.mark.parametrize("case", ["default", "multinode-nvl72"])
def test_install_notes_name_the_admin_port_for_the_sidecars_own_routes(case: str) -> None:
    """The notes asked for /status on sidecar.port, the pass-through port, which answers
    404 there: the sidecar's own routes are on sidecar.adminPort."""
    values = merge(case_values(case), {"sidecar": {"port": 9090, "adminPort": 9191}})
    notes = render(values)[NOTES]
    named = re.findall(r"127\.0\.0\.1:(\d+)(/[a-z]+)", notes)
    assert ("9191", "/status") in named, notes
    for port, path in named:
        assert port == ("9191" if path in ADMIN_ROUTES else "9090"), f"{path} on port {port}"


def test_deadlines_reach_the_sidecar() -> None:
    settings = sidecar_settings({})
    assert (settings.body_deadline, settings.response_deadline, settings.write_timeout) == (
        300.0, 300.0, 60.0
    )  # fmt: skip
    deadlines = {"requestBodySeconds": 120, "responseSeconds": 90, "clientWriteSeconds": 15}
    settings = sidecar_settings({"sidecar": {"deadlines": deadlines}})
    assert (settings.body_deadline, settings.response_deadline, settings.write_timeout) == (
        120.0, 90.0, 15.0
    )  # fmt: skip
    with pytest.raises(helm.HelmError, match="clientWriteSeconds"):
        render({"sidecar": {"deadlines": {"clientWriteSeconds": 0}}})
