"""The chart renders with Helm's engine, lints clean, validates, and matches its goldens.

Goldens: tests/helm/golden/<case>.yaml, each what its case is about (helm_support.ASPECTS: a
profile's vLLM command line, the alert rules, the multi-node objects...), the default install
whole (default.yaml, default.NOTES.txt); the chart's version and appVersion as placeholders.
After an intended chart change:
    MLA_SERVE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/helm/test_helm_render.py
"""

from __future__ import annotations

import json
import os
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm import crd_schemas
from tests.helm.crd_subsets import CRD_SCHEMAS
from tests.helm.helm_support import (
    ASPECTS,
    CASES,
    CHART,
    GOLDEN_DIR,
    NAMESPACE,
    PROFILES,
    RELEASE,
    UPDATE_GOLDEN,
    case_documents,
    case_values,
    documents,
    find,
    flags,
    goldens,
    kinds,
    merge,
    render,
    sidecar_container,
    versionless,
    vllm_container,
)

# The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ["1.31.0", "1.37.0"]
BUILTIN = {
    "Deployment",
    "Service",
    "ServiceAccount",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ConfigMap",
    "Pod",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lints_clean(case: str) -> None:
    report = helm.lint(
        str(CHART), case_values(case), strict=True, namespace=NAMESPACE, kube_version="v1.31.0"
    )
    assert report["errors"] == []
    assert report["messages"] == [], report["messages"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_golden(case: str) -> None:
    for name, text in goldens(case).items():
        path = GOLDEN_DIR / name
        if UPDATE_GOLDEN:
            path.write_text(text)
            continue
        assert path.exists(), f"{path.name} missing: run with MLA_SERVE_UPDATE_GOLDEN=1"
        assert text == path.read_text(), (
            f"{path.name} differs from the rendered chart; if the change is intended, "
            "regenerate with MLA_SERVE_UPDATE_GOLDEN=1 and review the diff"
        )


def test_no_stale_goldens() -> None:
    assert set(ASPECTS) | {"default"} == set(CASES)
    expected = {name for case in CASES for name in goldens(case)}
    assert {p.name for p in GOLDEN_DIR.iterdir()} == expected


def test_goldens_hold_no_version() -> None:
    """A release or a version bump rewrites no golden: the chart's version and appVersion
    appear in none (nor the default vLLM release, which the appVersion names)."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    release = str(meta["appVersion"]).rsplit("-vllm", 1)[1]
    for path in sorted(GOLDEN_DIR.iterdir()):
        text = path.read_text()
        for value in (str(meta["appVersion"]), f"{meta['name']}-{meta['version']}", release):
            assert value not in text, f"{path.name} names {value}"
    assert "<appVersion>" in (GOLDEN_DIR / "default.yaml").read_text()


def test_versionless_replaces_exactly_the_chart_versions() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = f"image: x:{meta['appVersion']}\nhelm.sh/chart: mla-serve-{meta['version']}\nv: 0.2"
    assert versionless(text) == (
        "image: x:<appVersion>\nhelm.sh/chart: mla-serve-<version>\nv: 0.2"
    )


def _wrap_pod_template(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "t"},
        "template": template,
    }


def _wrap_selector(selector: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "s"},
        "spec": {"selector": selector},
    }


def _kube_validate(doc: dict[str, Any], what: str) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(p) for p in error.path)
            pytest.fail(f"{what} (Kubernetes {version}) at {path}: {error.message}")


@pytest.fixture(scope="module")
def operator_schemas() -> None:
    """The prometheus-operator's schemas (tests/helm/crd_schemas.py), installed once."""
    try:
        crd_schemas.install()
    except crd_schemas.SchemaUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(str(error))
        pytest.skip(str(error))


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifests_validate_strictly(case: str, operator_schemas: None) -> None:
    """kubernetes-validate --strict on built-in kinds; the prometheus-operator's kinds against
    its own schema (no unknown field either); LeaderWorkerSet and ComputeDomain against their
    strict subsets; the pod templates and label selectors inside CRDs through
    kubernetes-validate again."""
    docs = case_documents(case)
    operator = [doc for doc in docs if doc["kind"] in crd_schemas.KINDS]
    for doc, found in zip(operator, crd_schemas.validate(operator), strict=True):
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        assert found == {"errors": [], "unknown": []}, f"{what}: {found}"
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        what = f"{kind}/{name}"
        assert doc["metadata"].get("namespace") in (None, NAMESPACE)
        if kind in BUILTIN:
            _kube_validate(doc, what)
            continue
        if kind in crd_schemas.KINDS:
            if kind in ("PodMonitor", "ServiceMonitor"):
                _kube_validate(_wrap_selector(doc["spec"]["selector"]), f"{what} selector")
            continue
        assert kind in CRD_SCHEMAS, f"{what}: no validation for this kind"
        try:
            jsonschema.Draft202012Validator(CRD_SCHEMAS[kind]).validate(doc)
        except jsonschema.ValidationError as error:
            pytest.fail(f"{what} at {'/'.join(map(str, error.path))}: {error.message}")
        if kind == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            _kube_validate(_wrap_pod_template(lwt["leaderTemplate"]), f"{what} leaderTemplate")
            _kube_validate(_wrap_pod_template(lwt["workerTemplate"]), f"{what} workerTemplate")


def test_the_operator_schema_catches_bad_and_unknown_fields(operator_schemas: None) -> None:
    """The prometheus-operator's own schema refuses a wrong type and a bad duration, and a
    misspelt field is reported as unknown, so the check above can fail."""
    docs = case_documents("monitoring-dsv4-flash")
    monitor = json.loads(json.dumps(find(docs, "PodMonitor")))
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["intervl"] = endpoint.pop("interval")
    rule = json.loads(json.dumps(find(docs, "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = 5
    rule["spec"]["groups"][0]["interval"] = "every minute"
    typo, wrong = crd_schemas.validate([monitor, rule])
    assert typo == {"errors": [], "unknown": ["/spec/podMetricsEndpoints/0/intervl"]}
    assert any("groups/0/rules/0/for must be string" in e for e in wrong["errors"]), wrong
    assert any("groups/0/interval must match pattern" in e for e in wrong["errors"]), wrong


def test_kubernetes_validate_strict_rejects_unknown_fields() -> None:
    """The strict mode the tests rely on does catch a misspelt field."""
    deployment = find(case_documents("default"), "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)


# --- what each profile renders -------------------------------------------------------------

PROFILE_LAYOUT = {
    # profile: (flags vLLM must get, GPUs per pod, (product label value, node architecture))
    "gb300-tp4": (
        {
            "--tensor-parallel-size": "4",
            "--prefill-context-parallel-size": "1",
            "--decode-context-parallel-size": "1",
        },
        4,
        ("NVIDIA-GB300", "arm64"),
    ),
    "b200-tp2-pcp2": (
        {
            "--tensor-parallel-size": "2",
            "--prefill-context-parallel-size": "2",
            "--enable-expert-parallel": None,
            "--gpu-memory-utilization": "0.85",
            "--max-model-len": "262144",
        },
        4,
        ("NVIDIA-B200", "amd64"),
    ),
    "b200-tp1-pcp4": (
        {
            "--tensor-parallel-size": "1",
            "--prefill-context-parallel-size": "4",
            "--decode-context-parallel-size": "1",
            "--enable-expert-parallel": None,
            "--max-model-len": "262144",
        },
        4,
        ("NVIDIA-B200", "amd64"),
    ),
    "b200-tp1-pcp4-dcp4": (
        {
            "--tensor-parallel-size": "1",
            "--prefill-context-parallel-size": "4",
            "--decode-context-parallel-size": "4",
            "--gpu-memory-utilization": "0.96",
            "--max-num-batched-tokens": "4096",
            "--attention-backend": "FLASHMLA_SPARSE",
            "--dcp-comm-backend": "ag_rs",
            "--kv-cache-dtype": "fp8_ds_mla",
        },
        4,
        ("NVIDIA-B200", "amd64"),
    ),
    "dsv4-flash": (
        {
            "--tensor-parallel-size": "2",
            "--enable-expert-parallel": None,
            "--compilation-config": '{"cudagraph_mode": "FULL_AND_PIECEWISE"}',
        },
        2,
        ("NVIDIA-B200", "amd64"),
    ),
}


def test_every_profile_is_covered() -> None:
    assert sorted(PROFILE_LAYOUT) == PROFILES


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_layout(profile: str) -> None:
    expected, gpus, (product, arch) = PROFILE_LAYOUT[profile]
    docs = case_documents(f"profile-{profile}")
    assert "LeaderWorkerSet" not in kinds(docs)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    vllm = vllm_container(pod)
    got = flags(vllm)
    for flag, value in expected.items():
        assert flag in got, f"{profile}: {flag} missing from {vllm['args']}"
        assert got[flag] == value, f"{profile}: {flag}={got[flag]}, want {value}"
    assert vllm["command"] == ["mla-serve-entrypoint", "serve"]
    assert vllm["args"][0] == case_values(f"profile-{profile}")["model"]["name"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product, "kubernetes.io/arch": arch}


def test_every_profile_states_its_architecture() -> None:
    """The image is built per architecture (`make image`); GB300 trays are Grace (arm64)."""
    for profile in PROFILES:
        values = case_values(f"profile-{profile}")
        arch = values["gpu"].get("arch")
        assert arch in ("amd64", "arm64"), f"{profile}: gpu.arch {arch!r}"
        grace = values["gpu"]["product"] in ("NVIDIA-GB300", "NVIDIA-GB200")
        assert (arch == "arm64") == grace, profile


@pytest.mark.parametrize("case", sorted(CASES))
def test_pod_contract(case: str) -> None:
    """Shared engine-state dir, shm, cache, probes and the tight security context."""
    docs = case_documents(case)
    values = case_values(case)
    for pod in _pod_specs(docs):
        spec = pod["spec"]
        role = pod["metadata"]["labels"]["mla-serve.io/role"]
        assert spec["enableServiceLinks"] is False
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["shm"]["emptyDir"]["sizeLimit"]
        vllm, sidecar = vllm_container(spec), sidecar_container(spec)
        for container in (vllm, sidecar):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["MLA_SERVE_STATE_DIR"] == "/var/run/mla-serve"
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert mounts["state"] == "/var/run/mla-serve"
        assert {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}["shm"] == "/dev/shm"
        vllm_env = {e["name"]: e for e in vllm["env"]}
        assert vllm_env["HF_HOME"]["value"].startswith("/model-cache")
        secret = values.get("hfToken", {}).get("secretName")
        if secret:
            ref = vllm_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": "token"}
        # Readiness and liveness come from the sidecar, on every pod.
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert sidecar["command"] == ["mla-serve", "sidecar"]
        if role == "leader":
            assert sidecar["args"][:2] == ["--vllm-url", "http://127.0.0.1:8000"]
            probe = vllm["startupProbe"]
            budget = probe["periodSeconds"] * probe["failureThreshold"]
            startup = {**_defaults("startup"), **values.get("startup", {})}
            minutes = (
                startup["weightLoadMinutes"]
                + startup["compileMinutes"]
                + startup["cudaGraphCaptureMinutes"]
            )
            assert budget >= minutes * 60
            assert budget < minutes * 60 + probe["periodSeconds"]
        else:
            assert "ports" not in vllm and "startupProbe" not in vllm


def _defaults(key: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())[key]


def _pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = []
    for doc in docs:
        if doc["kind"] == "Deployment":
            pods.append(doc["spec"]["template"])
        if doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            pods += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    assert pods
    return pods


def test_default_deployment_is_recreate_with_pdb_and_pvc() -> None:
    docs = case_documents("default")
    assert find(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    pdb = find(docs, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pvc = find(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["hf", "download"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} not in init["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in vllm_container(pod)["env"]
    service = find(docs, "Service")["spec"]
    assert service["ports"][0]["targetPort"] == "sidecar-http"
    assert service["selector"]["mla-serve.io/role"] == "leader"


def test_passthrough_off_routes_to_vllm_and_uses_existing_offline_cache() -> None:
    docs = case_documents("passthrough-off-b200-tp2-pcp2")
    assert find(docs, "Service", f"{RELEASE}-mla-serve")["spec"]["ports"][0]["targetPort"] == (
        "vllm-http"
    )
    assert "PersistentVolumeClaim" not in kinds(docs)
    deployment = find(docs, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    claim = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert claim["persistentVolumeClaim"]["claimName"] == "glm52-weights"
    (init,) = pod["initContainers"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in init["env"]
    policy = find(docs, "NetworkPolicy")["spec"]
    api_rule = policy["ingress"][0]
    assert api_rule["ports"] == [{"port": "vllm-http", "protocol": "TCP"}]
    assert {"kubernetes.io/metadata.name": "gateway"} in [
        peer.get("namespaceSelector", {}).get("matchLabels") for peer in api_rule["from"]
    ]
    metrics = find(docs, "Service", f"{RELEASE}-mla-serve-metrics")["spec"]
    assert metrics["clusterIP"] == "None"
    monitor = find(docs, "ServiceMonitor")["spec"]
    assert [e["port"] for e in monitor["endpoints"]] == ["vllm-http", "sidecar-admin"]


def test_multinode_nvl72_leader_worker_set() -> None:
    docs = case_documents("multinode-nvl72")
    assert "Deployment" not in kinds(docs)
    lws = find(docs, "LeaderWorkerSet")["spec"]
    lwt = lws["leaderWorkerTemplate"]
    assert lwt["size"] == 2  # TP4 x PCP2 = 8 GPUs over 4-GPU trays
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurge"] == 0
    leader, worker = lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]
    lead, work = flags(vllm_container(leader)), flags(vllm_container(worker))
    for got in (lead, work):
        assert got["--nnodes"] == "2"
        assert got["--tensor-parallel-size"] == "4"
        assert got["--prefill-context-parallel-size"] == "2"
        assert got["--master-port"] == "29501"
    assert lead["--node-rank"] == "0"
    assert lead["--master-addr"] == "$(POD_IP)"
    assert lead["--port"] == "8000" and "--headless" not in lead
    assert work["--node-rank"] == "$(LWS_WORKER_INDEX)"
    assert work["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    assert "--headless" in work and "--port" not in work
    # The worker's sidecar follows the leader's engine.
    assert sidecar_container(worker)["args"][1] == "http://$(LWS_LEADER_ADDRESS):8000"
    # Multi-node NVLink: one IMEX channel per pod from the ComputeDomain's claim template.
    domain = find(docs, "ComputeDomain")
    template_name = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    for spec in (leader, worker):
        assert spec["resourceClaims"] == [
            {"name": "compute-domain-channel", "resourceClaimTemplateName": template_name}
        ]
        vllm = vllm_container(spec)
        assert vllm["resources"]["claims"] == [{"name": "compute-domain-channel"}]
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert vllm["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        affinity = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert affinity[0]["topologyKey"] == "nvidia.com/gpu.clique"
        assert affinity[0]["matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
        env = {e["name"] for e in vllm_container(spec)["env"]}
        assert "POD_IP" in env
    assert lwt["leaderTemplate"]["metadata"]["labels"]["mla-serve.io/role"] == "leader"
    assert lwt["workerTemplate"]["metadata"]["labels"]["mla-serve.io/role"] == "worker"
    service = find(docs, "Service")["spec"]
    assert service["selector"]["mla-serve.io/role"] == "leader"


def test_multinode_dp_without_compute_domain() -> None:
    docs = case_documents("multinode-dp")
    assert "ComputeDomain" not in kinds(docs)
    lwt = find(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2  # TP8 x DP2 = 16 GPUs over 8-GPU nodes
    leader = lwt["leaderTemplate"]["spec"]
    got = flags(vllm_container(leader))
    assert got["--data-parallel-size"] == "2" and got["--tensor-parallel-size"] == "8"
    assert "--enable-expert-parallel" in got
    assert "affinity" not in leader and "resourceClaims" not in leader
    assert leader["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "kubernetes.io/arch": "amd64",
    }


def test_monitoring_objects() -> None:
    docs = case_documents("monitoring-dsv4-flash")
    monitor = find(docs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["vllm-http", "sidecar-admin"]
    for endpoint in endpoints:
        targets = {r["targetLabel"] for r in endpoint["relabelings"]}
        assert {"mla_serve_release", "mla_serve_profile", "mla_serve_role"} <= targets
    dashboard = find(docs, "ConfigMap", f"{RELEASE}-mla-serve-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["mla-serve.json"])
    assert board["uid"] == "mla-serve"
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for metric in (
        "mla_serve_runaway_completions_total",
        "mla_serve_cudagraph_mode_info",
        "mla_serve_fix_info",
        "mla_serve_sparse_mla_workspace_bytes",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
    ):
        assert any(metric in e for e in exprs), metric
    # The canary: a long shared prefix (the runaways needed over 2048 cached tokens).
    canary = find(docs, "ConfigMap", f"{RELEASE}-mla-serve-canary")["data"]["prompt.txt"]
    assert len(canary.split()) > 2048
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    args = sidecar_container(pod)["args"]
    assert args[args.index("--canary-prompt-file") + 1] == "/etc/mla-serve/canary/prompt.txt"
    assert args[args.index("--model") + 1] == "deepseek-ai/DeepSeek-V4-Flash"


def test_optional_kinds_only_when_enabled() -> None:
    """The default install needs no CRD."""
    assert set(kinds(case_documents("default"))) <= BUILTIN


def test_helm_test_hook_pod() -> None:
    docs = case_documents("default")
    pod = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # Not selected by the Deployment (a ReplicaSet would adopt a matching orphan pod).
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["MLA_SERVE_TEST_URL"] == f"http://{RELEASE}-mla-serve.{NAMESPACE}.svc:8000"


HOPPER = {"gpu": {"product": "NVIDIA-H200", "arch": "amd64", "perNode": 8, "memoryGiB": 139.8}}


@pytest.mark.parametrize(
    ("change", "backend"),
    [
        ({}, "FLASH_ATTN_MLA_SPARSE"),
        ({"gpu": {"product": "NVIDIA-H100-80GB-HBM3"}}, "FLASH_ATTN_MLA_SPARSE"),
        ({"gpu": {"product": "NVIDIA-GH200-480GB", "arch": "arm64"}}, "FLASH_ATTN_MLA_SPARSE"),
        ({"model": {"name": "/models/glm-5.3-flash"}}, "FLASH_ATTN_MLA_SPARSE"),
        ({"vllm": {"kvCacheDtype": "bfloat16"}}, "FLASH_ATTN_MLA_SPARSE"),
        # the user's choice wins
        (
            {"vllm": {"attentionBackend": "FLASHINFER_MLA_SPARSE_SM90"}},
            "FLASHINFER_MLA_SPARSE_SM90",
        ),
        # where FLASH_ATTN_MLA_SPARSE would refuse the layout (vLLM 0.33.0's supports_combination)
        ({"vllm": {"kvCacheDtype": "fp8_ds_mla"}}, None),
        ({"parallelism": {"tensor": 2, "decodeContext": 2}}, None),
        # not Hopper, not GLM-5.3
        ({"gpu": {"product": "NVIDIA-GB300", "arch": "arm64", "perNode": 4}}, None),
        ({"gpu": {"product": "NVIDIA-B200"}}, None),
        ({"gpu": {"product": ""}}, None),
        ({"model": {"name": "deepseek-ai/DeepSeek-V4-Flash"}}, None),
    ],
)
def test_glm53_on_hopper_takes_the_faster_sparse_mla_backend(
    change: dict[str, Any], backend: str | None
) -> None:
    """GLM-5.3 on Hopper runs FLASH_ATTN_MLA_SPARSE unless the values say otherwise or the
    layout is one that backend refuses; everywhere else the chart leaves vLLM's choice."""
    values = merge(merge(case_values("profile-gb300-tp4"), HOPPER), change)
    pod = find(documents(render(values)), "Deployment")["spec"]["template"]["spec"]
    args = flags(vllm_container(pod))
    assert args.get("--attention-backend") == backend
