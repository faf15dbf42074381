"""Hostile kernel code against the agent's tools that `IpyboxExecutor` serves from the application.

The tools are an MCP server on 127.0.0.1; kernel code that finds its port must still not call a
tool around the tool server (and its policy and approval): unsandboxed it lacks the token, and
sandboxed it cannot even connect.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from smolagents import tool

from ipybox.integrations.smolagents import IpyboxExecutor
from tests.sandbox_support import require_sandbox

# Each test starts an executor (a gateway and a kernel): over the 2 s a quick run allows.
pytestmark = pytest.mark.slow

RAN: list[str] = []


@tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
def transfer(amount: int) -> str:
    """Transfer money.

    Args:
        amount: How much.
    """
    RAN.append(f"transfer {amount}")
    return "done"


ATTACK = """
import http.client, json
initialize = {{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {{"protocolVersion": "2025-06-18",
    "capabilities": {{}}, "clientInfo": {{"name": "x", "version": "1"}}}}}}
call = {{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {{"name": "transfer", "arguments": {{"amount": 1000}}}}}}
headers = {{"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
    "Host": "127.0.0.1:{port}"}}
outcomes = []
for token in (None, "Bearer guessed"):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", {port}, timeout=10)
        sent = dict(headers, **({{"Authorization": token}} if token else {{}}))
        for body in (initialize, call):
            conn.request("POST", "/mcp", json.dumps(body), sent)
            response = conn.getresponse()
            outcomes.append(response.status)
            response.read()
            session = response.getheader("mcp-session-id")
            if session:
                sent = dict(sent, **{{"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}})
    except OSError as exc:
        outcomes.append(type(exc).__name__)
print(json.dumps(outcomes))
"""


@pytest.mark.parametrize("sandbox", [False, True])
def test_kernel_code_cannot_call_the_agents_tools_around_the_tool_server(
    workdir: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    with IpyboxExecutor(sandbox=sandbox) as executor:
        executor.send_tools({"transfer": transfer})
        # private: the served tools' port, which an attacker would find by scanning the loopback ports
        port = executor._tools.params["url"].rsplit(":", 1)[1].split("/")[0]
        output = executor(ATTACK.format(port=port))
    outcomes = json.loads(output.logs.strip().splitlines()[-1])
    assert outcomes, output.logs
    if sandbox:
        assert all(isinstance(outcome, str) for outcome in outcomes), outcomes  # no connection at all
    else:
        assert outcomes == [401, 401, 401, 401]
    assert RAN == []
