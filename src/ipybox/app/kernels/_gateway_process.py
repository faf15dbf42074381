"""The kernel gateway's child process: spawned, its output read, awaited until it answers, stopped.

Application side only. `GatewayProcess` is one start of the ``ipybox.gateway._main`` process that
:class:`ipybox.app.kernels._gateway.KernelGateway` runs: started with pipes of its own, its output read
(the last lines kept for error messages, and forwarded to stderr if asked), waited on until it
answers ``GET /api`` under one deadline, and stopped with every kernel it started; and its
command line, `gateway_command`. What else it is given (environment, kernel spec, srt's
settings) is the gateway's (``_gateway.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import time
from pathlib import Path

import httpx2
import psutil

from ipybox._infra import OwnPipes, kill_tree, running, spawn_with_own_pipes
from ipybox.app.kernels._spec import KERNEL_NAME
from ipybox.errors import GatewayError


def gateway_command(host: str, port: int, log_level: str, sandbox: bool) -> list[str]:
    """The command line of a gateway on `host`:`port` (``--KernelGatewayApp.*`` options)."""
    return [
        sys.executable,
        # Isolated: the working directory, which kernel code can write, is not on sys.path
        # and PYTHON* variables (e.g. a PYTHONPATH meant for kernels) are ignored; unbuffered
        # so that its log lines arrive as written.
        "-I",
        "-u",
        "-m",
        "ipybox.gateway._main",
        f"--KernelGatewayApp.ip={host}",
        f"--KernelGatewayApp.port={port}",
        "--KernelGatewayApp.port_retries=0",
        f"--KernelGatewayApp.log_level={log_level}",
        f"--KernelGatewayApp.default_kernel_name={KERNEL_NAME}",
        "--KernelManager.transport_encryption=auto",
        # Agents read all output; the notebook's output throttling would drop some.
        "--ZMQChannelsWebsocketConnection.limit_rate=False",
        # A sandboxed kernel has no network namespace of its own to share: Unix sockets in
        # its own folder, the one private folder bound into its sandbox, reach it.
        *(["--KernelManager.transport=ipc"] if sandbox else []),
    ]


class GatewayProcess:
    """One running gateway process and the task that reads its output into `log_tail`."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        pipes: OwnPipes,
        log_tail: collections.deque[str],
        log_to_stderr: bool,
    ) -> None:
        self.process = process
        self.log_tail = log_tail
        self._pipes = pipes
        self._log_to_stderr = log_to_stderr
        self._announced = asyncio.Event()
        self._reader = asyncio.create_task(self._read_output(pipes.output))

    @classmethod
    async def spawn(
        cls,
        command: list[str],
        env: dict[str, str],
        cwd: Path,
        log_tail: collections.deque[str],
        log_to_stderr: bool,
    ) -> GatewayProcess:
        """Start `command` in `cwd` with `env`; its output lines go to `log_tail`."""
        process, pipes = await spawn_with_own_pipes(command, env, cwd)
        return cls(process, pipes, log_tail, log_to_stderr)

    @property
    def running(self) -> bool:
        """Whether the process is alive (one that exited but is not reaped yet is not)."""
        if self.process.returncode is not None:
            return False
        try:
            return running(psutil.Process(self.process.pid))
        except psutil.Error:
            return False

    def failure(self, what: str) -> GatewayError:
        """`what` went wrong, with the process's last lines of output."""
        tail = "\n".join(self.log_tail) or "(no output)"
        return GatewayError(f"{what}\nLast lines of the gateway's output:\n{tail}")

    async def wait_ready(self, host: str, port: int, auth_token: str | None, timeout: float) -> None:
        """Wait until the gateway on `host`:`port` answers ``GET /api``.

        Raises:
            GatewayError: If the process exits first, or does not answer within `timeout` seconds.
        """
        process = self.process
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"token {auth_token}"} if auth_token else {}
        async with httpx2.AsyncClient(timeout=1.0, headers=headers) as http:
            while True:
                if process.returncode is not None or self._reader.done():
                    # Broad: the gateway is already gone; its exit code and output are read below.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(process.wait(), 2)
                    # Broad: as above; the output read so far is what the error shows.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self._reader, 1)
                    raise self.failure(
                        f"The kernel gateway exited during start (exit code {process.returncode}) "
                        f"on {host}:{port}; if the port is in use, choose another or pass port=None."
                    )
                try:
                    response = await http.get(f"{url}/api")
                    if response.status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise self.failure(f"The kernel gateway did not answer on {url} within {timeout:g} s.")
                # The gateway logs a line once it listens; until then, re-check now and then
                # in case its log level hides that line.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._announced.wait(), 0.25)

    async def terminate(self, timeout: float) -> None:
        """Terminate the process and all its descendants; kill what outlives `timeout`."""
        # Kernels are terminated together with the gateway rather than left to its own shutdown,
        # which waits for each kernel in turn. The gateway is our child: asyncio reaps it. Each
        # kernel's process group goes too: a sandboxed kernel's srt may start its proxy bridges after
        # the tree was listed, and they would outlive a kill of the listed processes.
        await kill_tree(self.process.pid, timeout, groups=True)
        await self.process.wait()

    async def close(self) -> None:
        """Stop reading the output of the ended process and close its pipes."""
        # The pipe closes with the process; the reader then ends by itself.
        await asyncio.wait({self._reader}, timeout=1)
        self._reader.cancel()
        self._pipes.close()

    async def _read_output(self, output: asyncio.StreamReader) -> None:
        async for raw in output:
            line = raw.decode(errors="replace").rstrip()
            self.log_tail.append(line)
            if "is available at" in line:
                self._announced.set()
            if self._log_to_stderr:
                print(line, file=sys.stderr, flush=True)
