"""deploy/ (Kubernetes on paper), checked offline: what a typo would break without anyone noticing.

`scripts/lint-deploy.sh` adds the linters this machine can install from package registries
(yamllint, hadolint, Kubernetes' own schemas through kubernetes-validate).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

# Every key of Enterprise Gateway 3.3's chart values (etc/kubernetes/helm/enterprise-gateway/values.yaml
# at tag v3.3.0, commit 0344929cbca688440ba1bc8f5faa074fe54bd595), and the keys its templates read
# that the defaults leave out (kernel.infoTimeout, namespace).
CHART_KEYS = frozenset(
    {
        *("authToken", "image", "imagePullPolicy", "logLevel", "mirrorWorkingDirs", "namespace"),
        *("deployment", "deployment.affinity", "deployment.annotations", "deployment.enabled"),
        *("deployment.extraEnv", "deployment.nodeSelector", "deployment.replicas", "deployment.resources"),
        *("deployment.serviceAccountName", "deployment.terminationGracePeriodSeconds"),
        *(
            "deployment.tolerations",
            "global",
            "global.commonLabels",
            "global.imagePullSecrets",
            "global.rbac",
        ),
        *("imagePullSecretsCreate", "imagePullSecretsCreate.annotations", "imagePullSecretsCreate.enabled"),
        *("imagePullSecretsCreate.secrets", "ingress", "ingress.annotations", "ingress.enabled"),
        *("ingress.hostName", "ingress.ingressClassName", "ingress.path", "ingress.pathType", "ingress.tls"),
        *("kernel", "kernel.allowedKernels", "kernel.clusterRole", "kernel.cullConnected"),
        *("kernel.cullIdleTimeout", "kernel.defaultKernelName", "kernel.defaultServiceAccountName"),
        *("kernel.infoTimeout", "kernel.launchTimeout", "kernel.shareGatewayNamespace"),
        *("kernelspecs", "kernelspecs.image", "kernelspecs.imagePullPolicy"),
        *("kernelspecsPvc", "kernelspecsPvc.enabled", "kernelspecsPvc.name"),
        *("kip", "kip.affinity", "kip.annotations", "kip.criSocket", "kip.defaultContainerRegistry"),
        *(
            "kip.enabled",
            "kip.fetcher",
            "kip.image",
            "kip.imagePullPolicy",
            "kip.interval",
            "kip.nodeSelector",
        ),
        *("kip.podSecurityPolicy", "kip.podSecurityPolicy.annotations", "kip.podSecurityPolicy.create"),
        *("kip.pullPolicy", "kip.resources", "kip.server", "kip.server.port", "kip.server.protocol"),
        *("kip.server.validate_cert", "kip.serviceAccountName", "kip.serviceName", "kip.tolerations"),
        *("nfs", "nfs.enabled", "nfs.internalServerIPAddress", "service", "service.externalIPs"),
        *("service.externalIPs.k8sMasterPublicIP", "service.ports", "service.type"),
    }
)
# Values the chart passes on whole (toYaml, or a map of names): any key may be under them.
FREE_FORM = (
    "resources",
    "extraEnv",
    "annotations",
    "tolerations",
    "affinity",
    "nodeSelector",
    "commonLabels",
)


def _key_paths(node: Any, prefix: str = "") -> list[str]:
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            paths.append(path)
            if str(key) not in FREE_FORM:
                paths += _key_paths(value, path)
    return paths


def test_every_yaml_and_json_file_in_deploy_parses() -> None:
    yamls = sorted(DEPLOY.rglob("*.yaml"))
    jsons = sorted(DEPLOY.rglob("*.json"))
    assert len(yamls) >= 3 and len(jsons) >= 3
    for path in yamls:
        assert [doc for doc in yaml.safe_load_all(path.read_text()) if doc], path
    for path in jsons:
        json.loads(path.read_text())


def test_the_helm_values_use_only_keys_of_enterprise_gateways_chart() -> None:
    values = yaml.safe_load((DEPLOY / "values.yaml").read_text())
    unknown = sorted(set(_key_paths(values)) - CHART_KEYS)
    assert unknown == [], f"keys the chart does not read: {unknown}"
    # What the rest of deploy/ rests on: kernels in the gateway's namespace (where the network
    # policy applies), the response port the policy allows, only ipybox's kernel spec.
    assert values["kernel"]["shareGatewayNamespace"] is True
    assert [port["port"] for port in values["service"]["ports"]] == [8888, 8877]
    assert (
        values["kernel"]["allowedKernels"] == [values["kernel"]["defaultKernelName"]] == ["ipybox_kubernetes"]
    )
    assert values["deployment"]["extraEnv"] == {"EG_INHERITED_ENVS": "PATH"}
    assert values["authToken"] == ""


def test_kernel_pods_may_reach_only_the_gateways_response_port() -> None:
    policy = yaml.safe_load((DEPLOY / "kubernetes" / "kernel-networkpolicy.yaml").read_text())
    gateway = {
        "podSelector": {"matchLabels": {"app": "enterprise-gateway", "component": "enterprise-gateway"}}
    }
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app": "enterprise-gateway", "component": "kernel"}
    }
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == [{"to": [gateway], "ports": [{"protocol": "TCP", "port": 8877}]}]
    assert policy["spec"]["ingress"] == [{"from": [gateway]}]


@pytest.mark.parametrize("name", ["ipybox_docker", "ipybox_kubernetes"])
def test_the_enterprise_gateway_kernel_specs_pass_what_the_launchers_need(name: str) -> None:
    spec = json.loads((DEPLOY / "kernelspecs" / name / "kernel.json").read_text())
    assert spec["metadata"]["process_proxy"]["class_name"].startswith(
        "enterprise_gateway.services.processproxies."
    )
    assert spec["metadata"]["process_proxy"]["config"]["image_name"]
    argv = " ".join(spec["argv"])
    for placeholder in ("{kernel_id}", "{response_address}", "{public_key}"):
        assert placeholder in argv


def test_the_agent_sandbox_documents_match_the_crds() -> None:
    crds = json.loads((DEPLOY / "agent-sandbox" / "crd-schemas-v0.5.6.json").read_text())["kinds"]
    docs = list(yaml.safe_load_all((DEPLOY / "agent-sandbox" / "ipybox-kernel-gateway.yaml").read_text()))
    assert [doc["kind"] for doc in docs] == ["SandboxTemplate", "SandboxWarmPool", "SandboxClaim"]
    for doc in docs:
        crd = crds[doc["kind"]]
        assert doc["apiVersion"] == crd["apiVersion"]
        _validate_structural(doc, crd["schema"], doc["kind"])
    template, pool, claim = docs
    assert pool["spec"]["sandboxTemplateRef"]["name"] == template["metadata"]["name"]
    assert claim["spec"]["warmPoolRef"]["name"] == pool["metadata"]["name"]
    assert template["spec"]["networkPolicy"]["egress"] == []


def _validate_structural(doc: dict[str, Any], schema: dict[str, Any], where: str) -> None:
    """JSON Schema validation, plus what the API server adds: no field the schema does not name."""
    jsonschema.validate(doc, schema)
    _no_unknown_fields(doc, schema, where)


def _no_unknown_fields(node: Any, schema: dict[str, Any], where: str) -> None:
    if isinstance(node, dict) and "properties" in schema:
        for key, value in node.items():
            assert key in schema["properties"], f"{where}.{key} is not a field of the CRD"
            _no_unknown_fields(value, schema["properties"][key], f"{where}.{key}")
    elif isinstance(node, list) and "items" in schema:
        for item in node:
            _no_unknown_fields(item, schema["items"], f"{where}[]")
