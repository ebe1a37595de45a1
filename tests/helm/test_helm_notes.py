"""What NOTES.txt tells a user after `helm install`: the GPU count in words, the Secret to
create for the Hugging Face token, the labels a Prometheus selects monitors and rules by."""

from __future__ import annotations

from tests.helm.helm_support import CHART, NAMESPACE, NOTES, render


def notes(values: dict[str, object]) -> str:
    return render(values)[NOTES]


def test_gpu_count_agrees_with_its_noun() -> None:
    assert "DP1 = 1 GPU\n" in notes({})
    assert "DP1, EP = 2 GPUs\n" in notes({"parallelism": {"tensor": 2, "expert": True}})


def test_the_token_secret_is_shown_with_its_key() -> None:
    text = notes({"hfToken": {"secretName": "hf-token"}})
    command = (
        f'kubectl -n {NAMESPACE} create secret generic hf-token --from-literal=token="$HF_TOKEN"'
    )
    assert command in text
    keyed = notes({"hfToken": {"secretName": "hub", "secretKey": "HF_TOKEN"}})
    assert "create secret generic hub --from-literal=HF_TOKEN=" in keyed
    assert "create secret" not in notes({})
    readme = (CHART / "README.md").read_text() + (CHART.parents[1] / "README.md").read_text()
    assert 'kubectl create secret generic hf-token --from-literal=token="$HF_TOKEN"' in readme


def test_monitoring_names_the_labels_prometheus_selects_by() -> None:
    off = notes({})
    assert "--set monitoring.podMonitor.labels.release=kube-prometheus-stack" in off
    assert "--set monitoring.prometheusRule.labels.release=kube-prometheus-stack" in off
    bare = notes({"monitoring": {"podMonitor": {"enabled": True}}})
    assert "a PodMonitor with the chart's labels only." in bare
    assert "set monitoring.podMonitor.labels and" in bare
    labelled = notes(
        {
            "monitoring": {
                "podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
            }
        }
    )
    assert "a PodMonitor labelled release=kps, a PrometheusRule labelled release=kps." in labelled
    assert "set monitoring.podMonitor.labels" not in labelled
    assert "{.spec.podMonitorSelector}" in labelled
