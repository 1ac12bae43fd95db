"""The Kubernetes examples: every manifest valid against the Kubernetes API's schema (strict: no
unknown fields), and the autoscaler wired to a metric the server exports."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import httpx
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO_ROOT = Path(__file__).resolve().parent.parent
K8S = REPO_ROOT / "examples" / "kubernetes"
K8S_VERSION = "1.33.0"


def _docs() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", _docs(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_manifest_is_valid_kubernetes(name, doc):
    _validate(doc)


def test_the_validator_rejects_bad_manifests():
    (hpa,) = [d for _, d in _docs() if d["kind"] == "HorizontalPodAutoscaler"]
    typo = copy.deepcopy(hpa)
    typo["spec"]["maxReplica"] = typo["spec"].pop("maxReplicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    wrong_type = copy.deepcopy(hpa)
    wrong_type["spec"]["minReplicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong_type)


def test_autoscaler_scales_a_deployment_on_the_exported_waiting_requests(server):
    docs = dict(((d["kind"], d["metadata"]["name"]), d) for _, d in _docs())
    (hpa,) = [d for (k, _), d in docs.items() if k == "HorizontalPodAutoscaler"]
    ref = hpa["spec"]["scaleTargetRef"]
    dep = docs[(ref["kind"], ref["name"])]
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    hpa_name = metric["pods"]["metric"]["name"]
    # the adapter rule maps the server's metric to the name the autoscaler asks for
    (adapter,) = [d for (k, _), d in docs.items() if k == "ConfigMap"]
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    series = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series) and rule["name"]["as"] == hpa_name
    assert series == "vllm:num_requests_waiting"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(rf"^{re.escape(series)}\{{[^}}]*\}} \d", metrics, re.M), metrics[:500]
    # Prometheus scrapes the pods on the container's HTTP port
    pod = dep["spec"]["template"]
    notes = pod["metadata"]["annotations"]
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == ports["http"]
    # the model comes from a volume mounted read-only
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    model_arg = c["args"][0]
    (model_mount,) = [m for m in mounts.values() if model_arg.startswith(m["mountPath"] + "/")]
    assert model_mount["readOnly"] and "persistentVolumeClaim" in vols[model_mount["name"]]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
