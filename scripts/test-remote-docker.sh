#!/usr/bin/env bash
# Tests kernels in Docker containers through two real gateways, with the remote test cases (every
# test module that imports tests/remote_support.py's `gateway` fixture, e.g. test_remote_channel.py):
#   - eg-docker: Jupyter Enterprise Gateway 3.3 (its own environment, as scripts/test-remote.sh
#     makes it, plus the `docker` client) with its DockerProcessProxy; kernel image
#     ipybox-kernel:eg (ipykernel 6, EG's launcher vendored in deploy/eg-launchers);
#   - kg-docker: Jupyter Kernel Gateway 3 with gateway-provisioners 0.5 (another environment of
#     its own) with its DockerProvisioner; kernel image ipybox-kernel:gp (ipykernel 7).
# Both images are built from deploy/kernel-image/Dockerfile on the Debian base (debian:bookworm-slim,
# or docker/build-base.sh's debootstrap base where it cannot be pulled).
#
#   bash scripts/test-remote-docker.sh [PYTEST_ARGS...]
#
# The containers are on an internal Docker network (no route off it, no traffic between its
# containers) and a firewall chain on its bridge lets them reach exactly one thing on the host:
# the gateway's response port (8877 for EG, 8878 for gateway-provisioners) on the host's address
# in that network, where the launcher sends the kernel's (encrypted) connection details. The gateways connect to the kernels' ports in the
# containers, never the other way round. No IPv6 on the bridge. The kernel spec's launcher runs
# with a cleaned environment (deploy/kernelspecs/launch-with-clean-env.sh): the gateway's token
# never reaches a container.
#
# Without a Docker engine it starts one when it can (as root: docker.io from apt, dockerd; stopped
# again at the end). Where none can be had, or the firewall cannot be set, it prints
# "test-remote-docker: SKIPPED: <reason>" and exits 0. Time: about 2 minutes for the two images
# from scratch once the base exists (a few more for debootstrap on a fresh machine, and for the two
# environments), about 1.5 minutes for the tests: 3 to 4 minutes in all on a fresh clone, measured
# on a loaded 2-core machine. .ci/run bounds the whole run at 20 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
started_at=$SECONDS

network=ipybox-kernels
bridge=ipybox-k0
chain=IPYBOX-KERNELS
base="${BASE_IMAGE:-debian:bookworm-slim}"
eg_image=ipybox-kernel:eg
gp_image=ipybox-kernel:gp
eg_port=8877
gp_port=8878

say() {
    echo "test-remote-docker: $*"
}
skip() {
    say "SKIPPED: $*"
    exit 0
}

source scripts/_dockerd.sh
firewall_set=""
cleanup() {
    # Kernels the gateways left behind, then the network and its firewall, then the engine.
    if [ -n "$firewall_set" ]; then
        iptables -D INPUT -i "$bridge" -j "$chain" 2>/dev/null || true
        iptables -F "$chain" 2>/dev/null || true
        iptables -X "$chain" 2>/dev/null || true
        ip6tables -D INPUT -i "$bridge" -j DROP 2>/dev/null || true
    fi
    if docker info >/dev/null 2>&1; then
        leftover="$(docker ps -aq --filter label=component=kernel 2>/dev/null || true)"
        [ -z "$leftover" ] || docker rm -f $leftover >/dev/null 2>&1 || true
        docker network rm "$network" >/dev/null 2>&1 || true
    fi
    find docker/ca-certificates -name '*.crt' -delete 2>/dev/null || true
    stop_dockerd
}
trap cleanup EXIT

# 1. A Docker engine (scripts/_dockerd.sh, as scripts/test-docker.sh gets one).
ensure_dockerd
[ "$(id -u)" -eq 0 ] || skip "confining the kernels' network (iptables on the Docker bridge) needs root"
command -v iptables >/dev/null 2>&1 || skip "iptables is missing: the kernels' network cannot be confined"

# 2. The two gateways, each in an environment of its own; ipybox's stays as it is.
source scripts/_uv.sh
uv sync --frozen --quiet
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ipybox"
eg_venv="${IPYBOX_EG_VENV:-$cache/enterprise-gateway-3.3}"
kg_venv="${IPYBOX_KG_DOCKER_VENV:-$cache/kg-provisioners-0.5}"
install_venv() {  # VENV CHECK PACKAGES...
    local venv="$1" check="$2"
    shift 2
    "$venv/bin/python" -c "$check" >/dev/null 2>&1 && return 0
    say "installing $* into $venv"
    rm -rf "$venv"
    if ! { timeout 300 uv venv --quiet --python 3.11 "$venv" \
        && VIRTUAL_ENV="$venv" timeout 600 uv pip install --quiet "$@"; } >/dev/null 2>&1; then
        rm -rf "$venv"
        return 1
    fi
}
install_venv "$eg_venv" 'import enterprise_gateway, ipykernel, docker' \
    "jupyter_enterprise_gateway==3.3.*" "ipykernel>=6.29,<7" docker \
    || skip "Jupyter Enterprise Gateway 3.3 and docker could not be installed from PyPI"
install_venv "$kg_venv" 'import kernel_gateway, gateway_provisioners, docker' \
    "jupyter_kernel_gateway==3.*" "gateway_provisioners[docker]==0.5.*" \
    || skip "Kernel Gateway 3 and gateway-provisioners 0.5 could not be installed from PyPI"
uv run --frozen python - <<'EOF'
import importlib.metadata as m
from packaging.version import Version
for name, floor in (("jupyter_client", "8"), ("jupyter_server", "2"), ("pyzmq", "25"), ("tornado", "6.5")):
    assert Version(m.version(name)) >= Version(floor), f"{name} {m.version(name)} in ipybox's environment"
for name in ("gateway_provisioners", "jupyter_enterprise_gateway", "docker"):
    try:
        m.version(name)
    except m.PackageNotFoundError:
        continue
    raise AssertionError(f"{name} reached ipybox's environment")
EOF

# 3. The kernel images, from the Debian base.
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 120 docker pull -q "$base" >/dev/null 2>&1; then
    say "$base cannot be pulled here; building a Debian base from Debian packages"
    bash docker/build-base.sh ipybox-base:bookworm || skip "no Debian base image could be built (docker/build-base.sh failed)"
    base=ipybox-base:bookworm
fi
rm -f dist/ipybox-*.whl
uv build --wheel --quiet --out-dir dist >/dev/null
for cert in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$cert" ] && cp "$cert" "docker/ca-certificates/extra-$(basename "$cert")"
done
# matplotlib: the executor's remote cases make plots, as an agent's code does.
extra_packages="${IPYBOX_KERNEL_EXTRA_PACKAGES:-matplotlib}"
build_log="$(mktemp)"
for route in eg gp; do
    image="ipybox-kernel:$route"
    say "building $image from $base"
    if ! timeout 900 docker build -f deploy/kernel-image/Dockerfile --build-arg "BASE_IMAGE=$base" \
        --build-arg "KERNEL_ROUTE=$route" --build-arg "EXTRA_PACKAGES=$extra_packages" \
        --force-rm -t "$image" . >"$build_log" 2>&1; then
        tail -40 "$build_log"
        rm -f "$build_log"
        say "FAILED: $image did not build"
        exit 1
    fi
done
rm -f "$build_log"
say "images ready after $((SECONDS - started_at)) s"

# 4. The kernel specs, in each gateway's environment (kernels/ipybox_docker).
"$eg_venv/bin/python" - "$eg_venv" "$eg_image" <<'EOF'
import json, shutil, sys
from pathlib import Path

venv, image = Path(sys.argv[1]), sys.argv[2]
spec_dir = venv / "share/jupyter/kernels/ipybox_docker"
shutil.rmtree(spec_dir, ignore_errors=True)
(spec_dir / "scripts").mkdir(parents=True)
shutil.copy("deploy/eg-launchers/kernel-launchers/docker/scripts/launch_docker.py", spec_dir / "scripts")
shutil.copy("deploy/kernelspecs/launch-with-clean-env.sh", spec_dir / "scripts")
spec = json.loads(Path("deploy/kernelspecs/ipybox_docker/kernel.json").read_text())
spec["metadata"]["process_proxy"]["config"]["image_name"] = image
spec["argv"][:3] = [
    str(spec_dir / "scripts/launch-with-clean-env.sh"),
    str(venv / "bin/python"),
    str(spec_dir / "scripts/launch_docker.py"),
]
(spec_dir / "kernel.json").write_text(json.dumps(spec, indent=2))
EOF
"$kg_venv/bin/jupyter-docker-spec" install --sys-prefix --replace --kernel-name ipybox_docker \
    --image-name "$gp_image" --display-name "Python for ipybox in Docker (gateway-provisioners)" >/dev/null 2>&1
"$kg_venv/bin/python" - "$kg_venv" <<'EOF'
import json, shutil, sys
from pathlib import Path

venv = Path(sys.argv[1])
spec_dir = venv / "share/jupyter/kernels/ipybox_docker"
shutil.copy("deploy/kernelspecs/launch-with-clean-env.sh", spec_dir / "scripts")
spec = json.loads((spec_dir / "kernel.json").read_text())
assert spec["argv"][0] == "python", spec["argv"]
spec["argv"][:1] = [str(spec_dir / "scripts/launch-with-clean-env.sh"), str(venv / "bin/python")]
spec["metadata"]["kernel_provisioner"]["config"]["launch_timeout"] = 120
(spec_dir / "kernel.json").write_text(json.dumps(spec, indent=2))
EOF

# 5. The kernels' network: internal (no route off it), no traffic between its containers (one
#    session's kernel cannot reach another's), no IPv6, and of the host only the two gateways'
#    response ports on the host's address in it.
docker network rm "$network" >/dev/null 2>&1 || true
docker network create --internal --opt "com.docker.network.bridge.name=$bridge" \
    --opt com.docker.network.bridge.enable_icc=false "$network" >/dev/null \
    || skip "the Docker network $network could not be created"
host_ip="$(docker network inspect -f '{{(index .IPAM.Config 0).Gateway}}' "$network")"
[ -n "$host_ip" ] || skip "the Docker network $network has no gateway address"
firewall_set=1
iptables -N "$chain" 2>/dev/null || iptables -F "$chain" || skip "iptables cannot make a chain here"
iptables -A "$chain" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
iptables -A "$chain" -p tcp -d "$host_ip" --dport "$eg_port" -j ACCEPT
iptables -A "$chain" -p tcp -d "$host_ip" --dport "$gp_port" -j ACCEPT
iptables -A "$chain" -j DROP
iptables -I INPUT -i "$bridge" -j "$chain" || skip "iptables cannot add a rule for the Docker bridge here"
sysctl -qw "net.ipv6.conf.$bridge.disable_ipv6=1" 2>/dev/null || true
ip6tables -I INPUT -i "$bridge" -j DROP 2>/dev/null || true
say "kernels on $network ($bridge); of the host they reach only $host_ip:$eg_port and $host_ip:$gp_port"

# 6. The remote cases against both: every test module that imports tests/remote_support.py's
#    `gateway` fixture (on its `from tests.remote_support import ...` line).
mapfile -t modules < <(grep -rlE --include='test_*.py' '^from tests\.remote_support import .*\bgateway\b' tests | sort)
# And the executor suite, whose gateways follow IPYBOX_TEST_GATEWAYS too (its own fixture).
modules+=(tests/app/kernels/test_remote_executor.py)
status=0
IPYBOX_TEST_GATEWAYS=eg-docker,kg-docker \
    IPYBOX_TEST_EG_PYTHON="$eg_venv/bin/python" \
    IPYBOX_TEST_KG_DOCKER_PYTHON="$kg_venv/bin/python" \
    IPYBOX_TEST_DOCKER_NETWORK="$network" \
    IPYBOX_TEST_DOCKER_HOST_IP="$host_ip" \
    uv run --frozen pytest "${modules[@]}" -p no:cacheprovider "$@" || status=$?
say "done in $((SECONDS - started_at)) s"
exit "$status"
