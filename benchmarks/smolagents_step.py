"""One smolagents step on `IpyboxExecutor` against smolagents' own local executor, in one run.

The same steps as a `CodeAgent` sends them (``executor(code)``), timed per step after a warm-up:
  - a trivial step (``x = x + 1``), and a step that prints;
  - a step that calls one of the agent's tools (``lookup(item=...)``): smolagents' local executor
    calls the Python object in its own process; ipybox reaches it from the kernel through the tool
    server (policy and approval on the way, auto-approved here) and runs it in the application;
  - ipybox unsandboxed and, with ``--sandbox``, in srt;
  - smolagents' ``DockerExecutor``: a Jupyter Kernel Gateway in a container, reached over a new
    websocket per step; the agent's tools are copied into its kernel and run there. Its own image
    starts ``FROM python:3.12-bullseye``, which a machine without Docker Hub cannot pull, so it is
    given the same image (ipykernel, jupyter_client and jupyter_kernel_gateway from PyPI, the same
    command) on the Debian base that ``docker/build-base.sh`` builds (``--docker-base`` names
    another), as ``image_name`` and ``dockerfile_content``. The image trusts the machine's extra CA certificates
    (``--ca-cert``, by default those in /usr/local/share/ca-certificates), for a TLS-intercepting
    proxy on the way to PyPI. Skipped, with the reason, where no Docker engine answers.

    uv run --frozen --with docker python benchmarks/smolagents_step.py [--steps N] [--sandbox] [--no-docker]
        [--docker-base IMAGE] [--ca-cert FILE]...
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

from smolagents import tool
from smolagents.local_python_executor import LocalPythonExecutor
from smolagents.monitoring import AgentLogger, LogLevel

from ipybox.integrations.smolagents import IpyboxExecutor


@tool
def lookup(item: str) -> int:
    """Look up an item's price.

    Args:
        item: The item.
    """
    return len(item)


STEPS = {
    "trivial step (x = x + 1)": "x = x + 1",
    "printing step": "print('x is', x)",
    "step calling one agent tool": "y = lookup(item='tea')",
}


def timed(run: Callable[[str], Any], code: str, steps: int) -> tuple[float, float]:
    for _ in range(5):
        run(code)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run(code)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def measure(name: str, executor: Any, steps: int) -> list[str]:
    executor.send_tools({"lookup": lookup})
    executor.send_variables({"x": 0})
    lines = []
    for label, code in STEPS.items():
        median, p90 = timed(executor, code, steps)
        lines.append(f"{name:<26}: {label:<28} median {median:7.2f} ms   p90 {p90:7.2f} ms   ({steps} steps)")
    return lines


DOCKER_IMAGE = "smolagents-kernel-bench"
KERNEL_VERSIONS = (
    "import platform, ipykernel, jupyter_client, kernel_gateway\n"
    "print(f'Python {platform.python_version()}, ipykernel {ipykernel.__version__}, '\n"
    "      f'jupyter_client {jupyter_client.__version__}, jupyter_kernel_gateway {kernel_gateway.__version__}')"
)


def kernel_dockerfile(base: str, ca_certs: list[Path]) -> str:
    """smolagents' default image (its packages, its command) on `base`, a Debian image."""
    certs = "".join(
        f" && echo {base64.b64encode(cert.read_bytes()).decode()} | base64 -d"
        f" > /usr/local/share/ca-certificates/bench-{index}.crt"
        for index, cert in enumerate(ca_certs)
    )
    return f"""\
FROM {base}
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        ca-certificates python3 python3-venv \\
    && rm -rf /var/lib/apt/lists/*
RUN mkdir -p /usr/local/share/ca-certificates{certs} && update-ca-certificates
RUN python3 -m venv /opt/kernel \\
    && /opt/kernel/bin/pip install --no-cache-dir jupyter_kernel_gateway jupyter_client ipykernel
ENV PATH=/opt/kernel/bin:$PATH
EXPOSE 8888
CMD ["jupyter", "kernelgateway", "--KernelGatewayApp.ip=0.0.0.0", "--KernelGatewayApp.port=8888"]
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def docker_executor(base: str, ca_certs: list[Path]) -> Any:
    """smolagents' `DockerExecutor` on an image built from `base`, or the reason it cannot start."""
    try:
        from smolagents.remote_executors import DockerExecutor

        import docker
    except ImportError as error:
        return f"the docker package is not installed ({error}); run with `uv run --frozen --with docker`"
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        return f"no Docker engine answers ({error})"
    try:
        client.images.get(base)
    except docker.errors.ImageNotFound:
        return f"no base image {base}: build it with `docker/build-base.sh`, or name one with --docker-base"
    # Built here rather than by DockerExecutor, whose build keeps every step's container on the
    # engine; it is then told the image is there (and given the same Dockerfile).
    dockerfile = kernel_dockerfile(base, ca_certs)
    try:
        client.images.build(fileobj=BytesIO(dockerfile.encode()), tag=DOCKER_IMAGE, rm=True, forcerm=True)
    except docker.errors.BuildError as error:
        said = "".join(str(chunk.get("stream", "")) for chunk in error.build_log)
        errors = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", said).splitlines() if "ERROR" in line]
        return f"its image {DOCKER_IMAGE} did not build ({error}: {errors[-1:]})"
    except docker.errors.APIError as error:
        return f"its image {DOCKER_IMAGE} did not build ({error})"
    try:
        return DockerExecutor(
            [],
            AgentLogger(level=LogLevel.OFF),
            port=free_port(),
            image_name=DOCKER_IMAGE,
            build_new_image=False,
            dockerfile_content=dockerfile,
        )
    except RuntimeError as error:
        return f"DockerExecutor did not start: {error}"


def measure_docker(args: argparse.Namespace) -> list[str]:
    executor = docker_executor(args.docker_base, args.ca_cert)
    if isinstance(executor, str):
        print(f"smolagents DockerExecutor skipped: {executor}")
        return [f"{'smolagents DockerExecutor':<26}: skipped: {executor}"]
    try:
        versions = executor(KERNEL_VERSIONS).logs.strip()
        return [*measure("smolagents DockerExecutor", executor, args.steps), f"  its container: {versions}"]
    finally:
        executor.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sandbox", action="store_true")
    parser.add_argument("--no-docker", action="store_true", help="leave smolagents' DockerExecutor out")
    parser.add_argument("--docker-base", default="ipybox-base:bookworm", help="a Debian image to build it on")
    parser.add_argument(
        "--ca-cert", type=Path, action="append", help="a CA certificate its image trusts (repeatable)"
    )
    args = parser.parse_args()
    if args.ca_cert is None:
        args.ca_cert = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    os.environ.setdefault("IPYBOX_STATE_DIR", tempfile.mkdtemp(prefix="ipybox-bench-state-"))
    os.chdir(tempfile.mkdtemp(prefix="ipybox-bench-"))
    lines = measure("smolagents local executor", LocalPythonExecutor([]), args.steps)
    with IpyboxExecutor() as executor:
        lines += measure("ipybox", executor, args.steps)
    if args.sandbox:
        with IpyboxExecutor(sandbox=True) as executor:
            lines += measure("ipybox, sandboxed", executor, args.steps)
    if not args.no_docker:
        lines += measure_docker(args)
    lines.append("load average: " + " ".join(f"{load:.2f}" for load in os.getloadavg()))
    text = "\n".join(lines)
    print(text)
    (Path(__file__).with_suffix(".txt")).write_text(text + "\n")


if __name__ == "__main__":
    main()
