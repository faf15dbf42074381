"""Gateways on a "remote host" for the remote test cases, and the `gateway` fixture that picks them.

The `gateway` fixture (module scope) yields a `NetnsGateway`: the URL and token of a running gateway
to connect to, whose default kernel spec starts a kernel apart from this process. Test modules use
it by importing it on a line ``from tests.remote_support import ..., gateway`` (that is how
``scripts/test-remote-docker.sh`` finds the modules to run). Which gateways it runs against is
chosen by ``IPYBOX_TEST_GATEWAYS``, a comma-separated list of these kinds (default
``kg-netns,eg-netns``; a kind whose parts are missing is skipped with the reason):

- ``kg-netns``: a plain Jupyter Kernel Gateway from ipybox's environment (ipykernel 7), in a network
  namespace of its own (below).
- ``eg-netns``: Jupyter Enterprise Gateway 3.3 (ipykernel 6), in a network namespace of its own;
  needs ``IPYBOX_TEST_EG_PYTHON``, the Python of its environment (``scripts/test-remote.sh``).
- ``eg-docker``: Enterprise Gateway 3.3 on this host, starting each kernel in a Docker container
  through its ``DockerProcessProxy`` (kernel spec ``ipybox_docker``, ipykernel 6).
- ``kg-docker``: Kernel Gateway 3 with gateway-provisioners 0.5 on this host, starting each kernel
  in a Docker container through its ``DockerProvisioner`` (kernel spec ``ipybox_docker``,
  ipykernel 7).

The Docker kinds need what ``scripts/test-remote-docker.sh`` sets up: ``IPYBOX_TEST_EG_PYTHON`` /
``IPYBOX_TEST_KG_DOCKER_PYTHON`` (each gateway's environment, with the kernel spec installed),
``IPYBOX_TEST_DOCKER_NETWORK`` (an internal Docker network) and ``IPYBOX_TEST_DOCKER_HOST_IP`` (the
host's address on it, where the gateway's response port listens: 8877 for Enterprise Gateway, 8878
for gateway-provisioners; the script's firewall lets the containers reach nothing else of the host).
For them `NetnsGateway.kernel_host_address` is that address; it is None where the kernel runs
beside the gateway.

The namespace kinds: `gateway_in_netns` starts a gateway command inside ``unshare --net --mount
--pid``: the namespace has only its own loopback (no route to the host's network), a private
``/tmp`` and Jupyter runtime folder, and its own process tree (every process in it dies with it).
The gateway listens on the namespace's loopback; one Unix socket, alone in a folder outside
``/tmp``, carries that one port out, and ``socat`` on the host turns it into a TCP port on the
host's loopback. Nothing in the namespace can open a connection to the host: the socket only
forwards connections from the host in.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import psutil
import pytest

# The port inside the namespace: the namespace is private, so a fixed port cannot collide.
INNER_PORT = 8888
START_TIMEOUT = 90.0  # a cold Enterprise Gateway start on a loaded 2-core machine
# A new network, mount and process namespace, whose processes all die with this command.
_UNSHARE = [
    "unshare",
    "--net",
    "--mount",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
]

_INSIDE = r"""
set -eu
ip link set lo up
# An address outside 127/8, which Enterprise Gateway insists on; on loopback, it leads nowhere.
ip addr add 10.254.0.1/32 dev lo
# What the gateway runs from may live under /tmp (a clone there, with its .venv): those folders are
# carried over into the private /tmp, nothing else of the host's.
i=0
while IFS= read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "$STATE/keep/$i"
    mount --bind "$path" "$STATE/keep/$i"
    i=$((i + 1))
done <<< "$KEEP"
mount -t tmpfs -o mode=1777 tmpfs /tmp
i=0
while IFS= read -r path; do
    [ -n "$path" ] || continue
    mkdir -p "$path"
    mount --bind "$STATE/keep/$i" "$path"
    i=$((i + 1))
done <<< "$KEEP"
export TMPDIR=/tmp JUPYTER_RUNTIME_DIR=/tmp/jupyter-runtime
socat -lf /dev/null "UNIX-LISTEN:$FORWARD_SOCKET,fork,mode=600,backlog=256" "TCP:127.0.0.1:$INNER_PORT,nodelay" &
exec "$@"
"""


@dataclass(frozen=True)
class NetnsGateway:
    """A running gateway in its own network namespace."""

    url: str
    token: str
    log: Path
    # The host's address as the kernels see it, where kernels run apart from the gateway's host
    # (Docker containers); None where they run beside the gateway.
    kernel_host_address: str | None = None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the gateway's output, for failure messages."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def netns_unavailable() -> str | None:
    """Why a gateway cannot run in a network namespace here, or None when it can."""
    for tool in ("unshare", "ip", "socat"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(
        [*_UNSHARE, "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return (
            f"`unshare --net --mount --pid` is not permitted here: {probe.stderr.strip() or probe.returncode}"
        )
    return None


def kernel_gateway_argv(python: str) -> list[str]:
    """A plain Jupyter Kernel Gateway on the namespace's loopback (token from ``KG_AUTH_TOKEN``)."""
    return [
        python,
        "-m",
        "kernel_gateway",
        "--KernelGatewayApp.ip=127.0.0.1",
        f"--KernelGatewayApp.port={INNER_PORT}",
        "--KernelGatewayApp.port_retries=0",
    ]


def enterprise_gateway_argv(python: str) -> list[str]:
    """Jupyter Enterprise Gateway on the namespace's loopback (token from ``KG_AUTH_TOKEN``)."""
    # Enterprise Gateway refuses kernels for root by default; the tests run as root.
    return [
        "env",
        "EG_UNAUTHORIZED_USERS=nobody",
        python,
        "-m",
        "enterprise_gateway",
        "--EnterpriseGatewayApp.ip=127.0.0.1",
        f"--EnterpriseGatewayApp.port={INNER_PORT}",
        "--EnterpriseGatewayApp.port_retries=0",
    ]


@contextlib.contextmanager
def gateway_in_netns(argv: list[str], start_timeout: float = START_TIMEOUT) -> Iterator[NetnsGateway]:
    """Run the gateway command `argv` in a new network namespace; yield where to reach it.

    Raises:
        RuntimeError: The gateway did not answer ``GET /api`` within `start_timeout` seconds.
    """
    token = secrets.token_urlsafe(24)
    # Outside /tmp (the namespace mounts its own there) and readable by root only.
    state = Path(tempfile.mkdtemp(prefix="ipybox-netns-", dir="/var/tmp"))
    forward_socket = state / "gateway.sock"
    log = state / "gateway.log"
    env = {
        **os.environ,
        "KG_AUTH_TOKEN": token,
        "FORWARD_SOCKET": str(forward_socket),
        "INNER_PORT": str(INNER_PORT),
        "STATE": str(state),
        "KEEP": "\n".join(_kept_under_tmp(argv)),
    }
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, state, True)
        log_file = stack.enter_context(log.open("wb"))
        inner = subprocess.Popen(
            [*_UNSHARE, "bash", "-c", _INSIDE, "netns-gateway", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        stack.callback(_stop, inner)
        outer = subprocess.Popen(
            [
                "socat",
                "TCP-LISTEN:0,bind=127.0.0.1,fork,reuseaddr,nodelay,backlog=256",
                f"UNIX-CONNECT:{forward_socket}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        stack.callback(_stop, outer)
        gateway = NetnsGateway(url=f"http://127.0.0.1:{_listening_port(outer.pid)}", token=token, log=log)
        _wait_ready(gateway, inner, start_timeout)
        yield gateway


def _kept_under_tmp(argv: list[str]) -> list[str]:
    """The folders directly in /tmp that hold what the gateway runs from (its Python, this checkout)."""
    needed = [Path(sys.prefix), Path(sys.base_prefix), Path(__file__).resolve().parents[1]]
    needed += [Path(arg) for arg in argv if arg.startswith("/")]
    kept = []
    for path in needed:
        for candidate in (path, path.resolve()):
            parts = candidate.parts
            if len(parts) > 2 and parts[:2] == ("/", "tmp"):
                kept.append(str(Path("/tmp", parts[2])))
    return sorted(set(kept))


def _listening_port(pid: int, timeout: float = 10.0) -> int:
    """The port that the process `pid` (socat on port 0) listens on, once it does."""
    deadline = time.monotonic() + timeout
    process = psutil.Process(pid)
    while time.monotonic() < deadline:
        for conn in process.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                return int(conn.laddr.port)
        time.sleep(0.01)
    raise RuntimeError(f"socat (pid {pid}) did not start listening within {timeout} s")


def _wait_ready(gateway: NetnsGateway, inner: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"token {gateway.token}"}
    with httpx2.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if inner.poll() is not None:
                raise RuntimeError(f"the gateway exited ({inner.returncode}):\n{gateway.log_tail()}")
            with contextlib.suppress(httpx2.HTTPError):
                if client.get(f"{gateway.url}/api/kernelspecs", headers=headers).status_code == 200:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"the gateway did not answer within {timeout} s:\n{gateway.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    # `--kill-child` makes the namespace's first process die with unshare, and with it every process
    # of the namespace's own process tree.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, 15)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait(timeout=10)


# The kinds of gateway the `gateway` fixture knows, and the default selection.
GATEWAY_KINDS = ("kg-netns", "eg-netns", "eg-docker", "kg-docker")
DEFAULT_GATEWAYS = "kg-netns,eg-netns"
# The kernel spec that the Docker kinds' gateways start by default (scripts/test-remote-docker.sh).
DOCKER_KERNEL_NAME = "ipybox_docker"
# The response ports on the host's address in the kernels' Docker network: the only ports of the
# host that the containers may reach.
EG_RESPONSE_PORT = 8877
GP_RESPONSE_PORT = 8878
# A container start on a loaded 2-core machine, the launcher's handshake included.
DOCKER_LAUNCH_TIMEOUT = 120


def selected_gateways() -> list[str]:
    """The gateway kinds chosen by ``IPYBOX_TEST_GATEWAYS`` (default `DEFAULT_GATEWAYS`).

    Raises:
        ValueError: The variable names a kind that does not exist.
    """
    kinds = [
        k.strip() for k in os.environ.get("IPYBOX_TEST_GATEWAYS", DEFAULT_GATEWAYS).split(",") if k.strip()
    ]
    unknown = sorted(set(kinds) - set(GATEWAY_KINDS))
    if unknown:
        raise ValueError(
            f"IPYBOX_TEST_GATEWAYS names unknown gateway kinds {unknown}; choose from {', '.join(GATEWAY_KINDS)}"
        )
    return kinds


@pytest.fixture(scope="module", params=selected_gateways())
def gateway(request: pytest.FixtureRequest) -> Iterator[NetnsGateway]:
    """A running gateway of each kind that ``IPYBOX_TEST_GATEWAYS`` selects (module docstring)."""
    with running_gateway(request.param) as running:
        yield running


@contextlib.contextmanager
def running_gateway(kind: str) -> Iterator[NetnsGateway]:
    """Start a gateway of `kind` (one of `GATEWAY_KINDS`); skip the test where its parts are missing."""
    if kind in ("kg-netns", "eg-netns"):
        reason = netns_unavailable()
        if reason is not None:
            pytest.skip(f"no gateway can run in a network namespace here: {reason}")
        if kind == "kg-netns":
            argv = kernel_gateway_argv(sys.executable)
        else:
            argv = enterprise_gateway_argv(_required_env("IPYBOX_TEST_EG_PYTHON", "scripts/test-remote.sh"))
        with gateway_in_netns(argv) as running:
            yield running
        return
    host_ip = _required_env("IPYBOX_TEST_DOCKER_HOST_IP", "scripts/test-remote-docker.sh")
    network = _required_env("IPYBOX_TEST_DOCKER_NETWORK", "scripts/test-remote-docker.sh")
    if kind == "eg-docker":
        python = _required_env("IPYBOX_TEST_EG_PYTHON", "scripts/test-remote-docker.sh")
        argv = enterprise_gateway_argv(python)
        env = {
            "EG_DOCKER_NETWORK": network,
            "EG_RESPONSE_IP": host_ip,
            "EG_RESPONSE_PORT": str(EG_RESPONSE_PORT),
            "EG_RESPONSE_PORT_RETRIES": "0",
            "EG_KERNEL_LAUNCH_TIMEOUT": str(DOCKER_LAUNCH_TIMEOUT),
        }
    else:
        python = _required_env("IPYBOX_TEST_KG_DOCKER_PYTHON", "scripts/test-remote-docker.sh")
        argv = kernel_gateway_argv(python)
        env = {
            # As Enterprise Gateway, gateway-provisioners refuses kernels for root by default.
            "GP_UNAUTHORIZED_USERS": "nobody",
            "GP_DOCKER_NETWORK": network,
            "GP_RESPONSE_IP": host_ip,
            "GP_RESPONSE_PORT": str(GP_RESPONSE_PORT),
            "GP_RESPONSE_PORT_RETRIES": "0",
        }
    argv = [*argv, f"--MappingKernelManager.default_kernel_name={DOCKER_KERNEL_NAME}"]
    with gateway_on_host(argv, env, kernel_host_address=host_ip) as running:
        yield running


def _required_env(name: str, script: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        pytest.skip(f"{name} is not set; `bash {script}` sets up this gateway")
    return value


@contextlib.contextmanager
def gateway_on_host(
    argv: list[str],
    env: dict[str, str],
    kernel_host_address: str | None = None,
    start_timeout: float = START_TIMEOUT,
) -> Iterator[NetnsGateway]:
    """Run the gateway command `argv` on this host's loopback, with `env` added; yield where to reach it.

    `argv` listens on `INNER_PORT`; that is replaced by a free port of the host's loopback.

    Raises:
        RuntimeError: The gateway did not answer ``GET /api/kernelspecs`` within `start_timeout` seconds.
    """
    token = secrets.token_urlsafe(24)
    port = _free_port()
    argv = [arg.replace(f".port={INNER_PORT}", f".port={port}") for arg in argv]
    state = Path(tempfile.mkdtemp(prefix="ipybox-gateway-", dir="/var/tmp"))
    log = state / "gateway.log"
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, state, True)
        log_file = stack.enter_context(log.open("wb"))
        process = subprocess.Popen(
            argv,
            env={**os.environ, **env, "KG_AUTH_TOKEN": token, "JUPYTER_RUNTIME_DIR": str(state / "runtime")},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        stack.callback(_stop, process)
        gateway = NetnsGateway(
            url=f"http://127.0.0.1:{port}", token=token, log=log, kernel_host_address=kernel_host_address
        )
        _wait_ready(gateway, process, start_timeout)
        yield gateway


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


# The kinds of remote gateway the executor suite (tests/app/kernels/test_remote_executor.py) runs against;
# `remote_gateway` starts one, with the suite's own kernel specs.
EXECUTOR_GATEWAY_KINDS = tuple(
    # With Docker-backed gateways selected (scripts/test-remote-docker.sh), the suite runs there.
    [kind for kind in selected_gateways() if kind.endswith("-docker")]
    or ["kernel-gateway", "enterprise-gateway"]
)
# The kernel spec the suites start: ipybox's kernel arguments without its extension, which the
# executor's setup cell loads once it has applied the kernel's environment.
KERNEL_NAME = "ipybox-remote"
# A kernel spec whose kernel never comes up (a pod that is never scheduled).
NEVER_STARTS = "ipybox-never-starts"
SRC = str(Path(__file__).resolve().parents[1] / "src")


@dataclass(frozen=True)
class RemoteGateway:
    """A running gateway for the remote suites: where it is, its token, the kernel spec to use."""

    kind: str
    url: str
    token: str
    kernel_name: str
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        """The end of the gateway's output, for failure messages."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def remote_gateway_unavailable(kind: str) -> str | None:
    """Why a gateway of `kind` cannot run here, or None when it can."""
    if kind.endswith("-docker"):
        return None  # `running_gateway` skips with the reason where its parts are missing
    reason = netns_unavailable()
    if reason is not None:
        return f"no gateway can run in a network namespace here: {reason}"
    if kind == "enterprise-gateway" and not os.environ.get("IPYBOX_TEST_EG_PYTHON"):
        return "IPYBOX_TEST_EG_PYTHON is not set; `bash scripts/test-remote.sh` installs Enterprise Gateway"
    return None


@contextlib.contextmanager
def remote_gateway(kind: str) -> Iterator[RemoteGateway]:
    """Start a gateway of `kind` in a network namespace, with the suites' kernel specs."""
    from ipybox.app.kernels._spec import KERNEL_ARGS  # private: the kernel arguments ipybox's own spec uses

    if kind.endswith("-docker"):
        # Kernels in containers, from the image's kernel spec (scripts/test-remote-docker.sh).
        with running_gateway(kind) as running:
            yield RemoteGateway(kind, running.url, running.token, DOCKER_KERNEL_NAME, running.log)
        return
    if kind == "kernel-gateway":
        python, argv_of = sys.executable, kernel_gateway_argv
    elif kind == "ipybox-gateway":
        # ipybox's own gateway entry: the stock Kernel Gateway with TCP_NODELAY on its WebSockets
        # (and lighter activity tracking), as the local executor runs it (for benchmarks).
        python = sys.executable

        def argv_of(python: str) -> list[str]:
            argv = kernel_gateway_argv(python)
            argv[2] = "ipybox.gateway._main"
            return argv

    elif kind == "enterprise-gateway":
        python, argv_of = os.environ["IPYBOX_TEST_EG_PYTHON"], enterprise_gateway_argv
    else:
        raise ValueError(f"unknown gateway kind {kind!r}")
    # Outside /tmp, which the namespace replaces with its own.
    jupyter_path = Path(tempfile.mkdtemp(prefix="ipybox-kernelspecs-", dir="/var/tmp"))
    try:
        args = [
            arg
            for arg in KERNEL_ARGS
            if not arg.startswith(("--IPKernelApp.extensions", "--IPKernelApp.kernel_class"))
        ]
        # Enterprise Gateway's environment lacks ipybox: its kernels take the kernel side (standard
        # library only) from this checkout, as an image with ipybox installed would have it.
        # Enterprise Gateway starts a kernel with only the spec's and KERNEL_* variables: the spec
        # gives it a PATH, as an image's environment does (shell commands need `sh`).
        env = (
            {"PYTHONPATH": SRC, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            if kind == "enterprise-gateway"
            else {}
        )
        specs = {
            KERNEL_NAME: [python, "-P", "-m", "ipykernel_launcher", "-f", "{connection_file}", *args],
            NEVER_STARTS: [python, "-c", "import time; time.sleep(3600)", "{connection_file}"],
        }
        for name, argv in specs.items():
            spec_dir = jupyter_path / "kernels" / name
            spec_dir.mkdir(parents=True)
            spec = {"argv": argv, "display_name": name, "language": "python", "env": env}
            (spec_dir / "kernel.json").write_text(json.dumps(spec))
        # Listing kernels lets the suites check that none is left behind.
        listing = ["KG_LIST_KERNELS=True", "EG_LIST_KERNELS=True"]
        command = ["env", f"JUPYTER_PATH={jupyter_path}", *listing, *argv_of(python)]
        with gateway_in_netns(command) as running:
            yield RemoteGateway(kind, running.url, running.token, KERNEL_NAME, running.log)
    finally:
        shutil.rmtree(jupyter_path, ignore_errors=True)
