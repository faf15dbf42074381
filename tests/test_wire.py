"""The wire contract: writers and readers of each name agree (``ipybox._wire``)."""

from __future__ import annotations

# private-ok: the wire contract (ipybox._wire) and the private writers and readers on each side of
# it are what this module checks agree; none of them is public.
import dataclasses
import json
from typing import get_args

import pytest

from ipybox._wire import (
    CALL_FIELDS,
    REQUEST_FIELDS,
    GatewayEnv,
    KernelEnv,
    PoolEnv,
    RunFields,
    ShellAnswerFields,
    ShellFields,
    StdinChannel,
    ToolServerEnv,
    ToolServerPaths,
)
from ipybox.app.sandbox._shell import ShellRequest, ShellResult
from ipybox.app.tools._calls import _RunRequest
from ipybox.app.tools._http import _error
from ipybox.app.tools._stdin_channel import _Call, _Request
from ipybox.errors import ToolCallOutcome
from ipybox.gateway._limits import KernelLimits
from ipybox.kernel import _calls
from ipybox.kernel._calls import Step
from ipybox.kernel._http import Response
from ipybox.kernel._tool_client import ToolRunner


@pytest.mark.parametrize(
    "address",
    [
        ToolServerEnv(),
        ToolServerEnv(
            host="127.0.0.1", port=1234, token="t0k", proxy="http://proxy:3128", socket="/run/tools.sock"
        ),
        ToolServerEnv(token=""),
        ToolServerEnv(channel="stdin"),
    ],
)
def test_the_tool_server_address_round_trips_through_the_environment(address: ToolServerEnv) -> None:
    env = address.to_env()
    assert set(env) <= {
        ToolServerEnv.HOST,
        ToolServerEnv.PORT,
        ToolServerEnv.TOKEN,
        ToolServerEnv.PROXY,
        ToolServerEnv.SOCKET,
        ToolServerEnv.CHANNEL,
    }
    assert ToolServerEnv.from_env(env) == address


def test_an_empty_environment_gives_the_default_address() -> None:
    assert ToolServerEnv.from_env({}) == ToolServerEnv()


def test_the_tool_servers_model_has_the_run_fields() -> None:
    assert set(_RunRequest.model_fields) == RunFields.ALL


def test_the_stdin_channels_models_have_the_request_and_call_fields() -> None:
    assert set(_Request.model_fields) == REQUEST_FIELDS
    assert set(_Call.model_fields) == CALL_FIELDS
    # A call is a /run body without server_params (never taken from a kernel) and with an id.
    assert CALL_FIELDS == (RunFields.ALL - {RunFields.SERVER_PARAMS}) | {
        StdinChannel.ID,
        StdinChannel.ASK_ONLY,
    }


@pytest.mark.parametrize("content", [False, True])
@pytest.mark.parametrize("server_params", [None, {"command": "uvx", "args": ["x"]}])
def test_the_body_the_kernel_writes_is_the_one_the_tool_server_reads(
    content: bool, server_params: dict[str, object] | None
) -> None:
    runner = ToolRunner("demo", server_params or {}, token="", proxy="", socket_path="")
    body = runner._calls.body("echo", {"text": "hi"}, content=content)
    request = _RunRequest.model_validate_json(body)
    assert (request.server_name, request.tool_name, request.tool_args) == ("demo", "echo", {"text": "hi"})
    assert request.server_params == server_params
    assert request.content is content
    assert set(json.loads(body)) <= RunFields.ALL


def test_the_tool_servers_shell_model_has_the_shell_fields_and_kinds() -> None:
    assert set(ShellRequest.model_fields) == ShellFields.ALL
    assert set(get_args(ShellRequest.model_fields[ShellFields.KIND].annotation)) == ShellFields.KINDS
    assert {field.name for field in dataclasses.fields(ShellResult)} == ShellAnswerFields.ALL


@pytest.mark.parametrize(
    ("kind", "argv"), [(ShellFields.SHELL, None), (ShellFields.SHELL_MAGIC, ["bash", "-e"])]
)
def test_the_shell_request_the_kernel_writes_is_the_one_the_tool_server_reads(
    kind: str, argv: list[str] | None
) -> None:
    runner = ToolRunner("ipybox", {}, token="", proxy="", socket_path="")
    exchange = runner._calls.shell(kind, "echo hi", "/work", argv)
    assert next(exchange) is Step.ACQUIRE
    assert exchange.send(False) is Step.ACQUIRE  # a new connection; the request made, asked again
    request = exchange.send(True)  # still open: the next step sends the request
    assert isinstance(request, bytes)
    assert request.startswith(f"POST {ToolServerPaths.SHELL} HTTP/1.1\r\n".encode())
    body = ShellRequest.model_validate_json(request.partition(b"\r\n\r\n")[2])
    assert (body.kind, body.cmd, body.argv, body.cwd) == (kind, "echo hi", argv, "/work")
    exchange.close()


@pytest.mark.parametrize("kind", sorted(get_args(ToolCallOutcome)))
def test_the_kernel_reads_the_error_the_tool_server_writes(kind: ToolCallOutcome) -> None:
    status, body = _error(403, kind, "No, not this one.")
    runner = ToolRunner("demo", {}, token="", proxy="", socket_path="")
    error = runner._calls.error(Response(status, body, keep_alive=True), "echo")
    assert (error.kind, str(error)) == (kind, "No, not this one.")


def test_the_kernel_knows_every_outcome_kind() -> None:
    assert _calls._KINDS == frozenset(get_args(ToolCallOutcome))


def test_the_limits_launcher_writes_the_name_the_gateway_reads() -> None:
    # ``gateway/_limits.py`` also runs as ``python -I -S <file>``, so it keeps the name as a literal.
    limits = KernelLimits(memory=None, processes=None)
    limits.groups = {"/sys/fs/cgroup/ipybox-test": {}}
    assert set(limits.gateway_env()) == {GatewayEnv.KERNEL_GROUPS}


def test_the_sandboxed_kernel_launcher_reads_the_tool_server_socket_by_its_name() -> None:
    # ``gateway/_kernel_launch.py`` runs as ``python -I -S <file>`` too.
    from ipybox.gateway import _kernel_launch

    assert _kernel_launch.TOOL_SERVER_SOCKET == ToolServerEnv.SOCKET
    assert _kernel_launch.KERNEL_SETTINGS == PoolEnv.SETTINGS
    assert _kernel_launch.START_DIR == KernelEnv.START_DIR
