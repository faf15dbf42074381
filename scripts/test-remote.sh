#!/usr/bin/env bash
# Tests kernels on a "remote host": gateways that run in a network namespace of their own (only
# their own loopback, a private /tmp, their own process tree), reached from this machine through
# exactly one forwarded port (tests/remote_support.py). Two gateways:
#   - a plain `jupyter kernelgateway` from ipybox's own environment (ipykernel 7);
#   - Jupyter Enterprise Gateway 3.3 from PyPI, in a virtual environment of its own (it pins
#     jupyter_client<7, jupyter_server<2, pyzmq<25, tornado<7; its kernels run ipykernel 6), so
#     that none of its pins reach ipybox's environment.
# Then runs tests/app/tools/test_remote_channel.py and tests/app/kernels/test_remote_executor.py
# against both.
#
#   bash scripts/test-remote.sh [PYTEST_ARGS...]
#
# Where something cannot start it prints "test-remote: SKIPPED: <reason>" and exits 0 (the
# gateway whose part can still run is tested). The whole run is bounded by .ci/run's timeout;
# each gateway start by START_TIMEOUT in tests/remote_support.py.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_uv.sh
uv sync --frozen --quiet

skip() {
    echo "test-remote: SKIPPED: $*"
}

reason="$(uv run --frozen python -c 'from tests.remote_support import netns_unavailable; print(netns_unavailable() or "")')"
if [ -n "$reason" ]; then
    skip "no gateway can run in a network namespace here: $reason"
    exit 0
fi

# Outside /tmp: the namespace mounts a private /tmp, and the gateway runs from this folder.
eg_venv="${IPYBOX_EG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ipybox/enterprise-gateway-3.3}"
eg_python="$eg_venv/bin/python"
if ! "$eg_python" -c 'import enterprise_gateway, ipykernel' >/dev/null 2>&1; then
    echo "test-remote: installing Jupyter Enterprise Gateway 3.3 into $eg_venv"
    rm -rf "$eg_venv"
    if ! { timeout 300 uv venv --quiet --python 3.11 "$eg_venv" \
        && VIRTUAL_ENV="$eg_venv" timeout 600 uv pip install --quiet \
            "jupyter_enterprise_gateway==3.3.*" "ipykernel>=6.29,<7"; } >/dev/null 2>&1; then
        rm -rf "$eg_venv"
        eg_python=""
        skip "Jupyter Enterprise Gateway 3.3 could not be installed from PyPI; its cases are left out"
    fi
fi

# The Enterprise Gateway's pins stay in its own environment.
uv run --frozen python - <<'EOF'
import importlib.metadata as m
from packaging.version import Version
for name, floor in (("jupyter_client", "8"), ("jupyter_server", "2"), ("pyzmq", "25"), ("tornado", "6.5")):
    assert Version(m.version(name)) >= Version(floor), f"{name} {m.version(name)} in ipybox's environment"
EOF

IPYBOX_TEST_EG_PYTHON="$eg_python" \
    uv run --frozen pytest tests/app/tools/test_remote_channel.py tests/app/kernels/test_remote_executor.py -p no:cacheprovider "$@"
