"""OAuth-protected HTTP MCP servers, against a real authorization server and real MCP servers.

`tests/servers/oauth_server.py` runs the MCP SDK's authorization server routes (auto-approving)
and token-checking MCP servers; the test plays the browser: it follows the authorization URL
with an HTTP client and delivers the redirect to ipybox's loopback callback.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources

# Private: the OAuth store, MCP session and parameter resolution are internal; they are driven
# directly against a real OAuth server.
from ipybox.app.mcp_client import _oauth
from ipybox.app.mcp_client._params import resolve_params
from ipybox.app.mcp_client._session import MCPSession
from ipybox.errors import AuthorizationError, MCPServerError, ServerParamsError
from tests.sandbox_support import require_sandbox

OAUTH_SERVER = Path(__file__).resolve().parents[2] / "servers" / "oauth_server.py"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """The URLs of the authorization server and the MCP servers (one process per module)."""
    process = subprocess.Popen([sys.executable, str(OAUTH_SERVER)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=60):
                raise RuntimeError("the OAuth test servers did not start within 60 s")
        line = process.stdout.readline().strip()
        assert line.startswith("READY "), line
        yield json.loads(line.removeprefix("READY "))
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()


class Browser:
    """Stands in for the person: opens the authorization URL, follows the redirect to the callback."""

    def __init__(self) -> None:
        self.visits: list[str] = []
        self.forge_first = False
        self.callback_answers: list[int] = []

    async def __call__(self, server_name: str, authorization_url: str) -> str | None:
        self.visits.append(authorization_url)
        async with httpx2.AsyncClient() as client:
            approved = await client.get(authorization_url)
            assert approved.status_code in (302, 303, 307), approved.text
            callback = approved.headers["location"]
            if self.forge_first:
                forged = callback.split("?")[0] + "?code=forged&state=not-the-state"
                self.callback_answers.append((await client.get(forged)).status_code)
            self.callback_answers.append((await client.get(callback)).status_code)
        return None


@pytest.fixture
def browser() -> Iterator[Browser]:
    person = Browser()
    _oauth.set_authorization_handler(person)
    try:
        yield person
    finally:
        _oauth.set_authorization_handler(None)


def stats(
    servers: dict[str, str], action: str = "stats", body: dict[str, Any] | None = None
) -> dict[str, Any]:
    answer = httpx2.post(f"{servers['as']}/admin/{action}", json=body or {})
    answer.raise_for_status()
    return dict(answer.json())


def notes(servers: dict[str, str], name: str = "mcp") -> dict[str, Any]:
    return {"url": f"{servers[name]}/mcp", "oauth": True}


async def call(params: dict[str, Any], text: str, server_name: str = "notes") -> Any:
    session = MCPSession(server_name, resolve_params(params))
    await session.start()
    try:
        return await session.call_tool("add_note", {"text": text})
    finally:
        await session.close()


def stored(server_name: str = "notes") -> dict[str, Any]:
    login = next(entry for entry in _oauth.list_logins() if entry.server_name == server_name)
    record = _oauth.TokenStore(server_name, login.url).read()
    assert record
    return record


def all_tokens() -> list[str]:
    """Every token value in the store (for looking for leaks)."""
    values = []
    for path in _oauth.oauth_dir().glob("*.json"):
        tokens = json.loads(path.read_text()).get("tokens") or {}
        values += [tokens[key] for key in ("access_token", "refresh_token") if tokens.get(key)]
    assert values
    return values


async def test_the_first_call_authorizes_and_later_executors_reuse_the_stored_tokens(
    servers: dict[str, str], browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = stats(servers)
    # Generating the API is the server's first use: it runs the authorization.
    tools = await generate_mcp_sources("notes", notes(servers), tmp_path / "mcptools")
    assert tools == ["add_note"]
    assert len(browser.visits) == 1 and browser.callback_answers == [200]
    folder = _oauth.oauth_dir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    code = "from mcptools.notes import add_note\nprint(add_note.run(add_note.Params(text='hi')).result)"
    for _ in range(2):  # two executors, one after the other
        async with CodeExecutor() as ex:
            assert (await ex.execute(code)).text == "noted: hi"
            environment = (await ex.execute("import os\nprint(repr(dict(os.environ)))")).text or ""
        for token in all_tokens():
            assert token not in environment
    after = stats(servers)
    assert after["authorizations"] - before["authorizations"] == 1
    assert after["calls"] - before["calls"] == 2
    assert len(browser.visits) == 1  # no new login
    sources = "".join(path.read_text() for path in (tmp_path / "mcptools").rglob("*.py"))
    for token in all_tokens():
        assert token not in sources


async def test_an_sse_server_logs_in_on_first_use_and_reuses_the_login(
    servers: dict[str, str], browser: Browser
) -> None:
    params = {"url": f"{servers['sse']}/sse", "oauth": True}
    assert resolve_params(params).transport == "sse"  # type: ignore[union-attr]
    assert await call(params, "one", server_name="feed") == {"result": "noted: one"}
    assert await call(params, "two", server_name="feed") == {"result": "noted: two"}
    assert len(browser.visits) == 1
    assert [entry.state for entry in _oauth.list_logins()] == ["active"]


async def test_a_token_due_to_expire_is_refreshed_without_a_new_login(
    servers: dict[str, str], browser: Browser
) -> None:
    assert await _oauth.login("notes", notes(servers)) == 1
    old = stored()["tokens"]
    before = stats(servers)
    # Time passes: the stored token is past its refresh time, and the server has ended it.
    login = next(entry for entry in _oauth.list_logins() if entry.server_name == "notes")
    store = _oauth.TokenStore("notes", login.url)
    record = json.loads(store.path.read_text())
    record["expires_at"] = record["refresh_due"] = 1.0
    store.path.write_text(json.dumps(record))
    stats(servers, "expire-access")
    assert await call(notes(servers), "after refresh") == {"result": "noted: after refresh"}
    after = stats(servers)
    assert after["refreshes"] - before["refreshes"] == 1
    assert after["authorizations"] == before["authorizations"]
    new = stored()["tokens"]
    assert new["access_token"] != old["access_token"] and new["refresh_token"] != old["refresh_token"]
    assert stored()["refresh_due"] > 1.0
    assert len(browser.visits) == 1


async def test_a_token_the_server_ended_early_is_refreshed_and_the_call_sent_once(
    servers: dict[str, str], browser: Browser, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await _oauth.login("notes", notes(servers))
    first = all_tokens()
    before = stats(servers)
    stats(servers, "expire-access")  # the client still thinks its token good for an hour
    assert await call(notes(servers), "refused once") == {"result": "noted: refused once"}
    after = stats(servers)
    assert after["refreshes"] - before["refreshes"] == 1
    assert after["calls"] - before["calls"] == 1
    assert len(browser.visits) == 1
    # Nothing logged it, at any level.
    assert caplog.records
    for token in [*first, *all_tokens()]:
        assert token not in caplog.text


def test_the_mcp_server_asks_for_ipybox_auth_login_instead_of_waiting_on_its_stderr(
    servers: dict[str, str],
) -> None:
    import asyncio

    # Private: the CLI's refusal of the browser step, on its own.
    from ipybox.mcp_server._auth_cli import refuse_browser_step

    refuse_browser_step()
    try:
        with pytest.raises(AuthorizationError, match="ipybox auth login notes --url"):
            asyncio.run(call(notes(servers), "x"))
    finally:
        _oauth.set_authorization_handler(None)


async def test_a_revoked_login_fails_with_one_clear_error_and_the_call_is_not_retried(
    servers: dict[str, str], browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    await generate_mcp_sources("notes", notes(servers), tmp_path / "mcptools")
    code = "from mcptools.notes import add_note\nprint(add_note.run(add_note.Params(text='x')).result)"
    async with CodeExecutor() as ex:
        assert (await ex.execute(code)).text == "noted: x"
        stats(servers, "revoke")
        before = stats(servers)
        for _ in range(2):
            with pytest.raises(CodeExecutionError) as caught:
                await ex.execute(code)
            assert "ipybox auth login notes" in str(caught.value)
            assert "no longer valid" in str(caught.value)
        assert stats(servers)["calls"] == before["calls"]  # the tool never ran again
        assert len(browser.visits) == 1  # no login started behind the user's back
        assert [entry.state for entry in _oauth.list_logins()] == ["login required"]
        # What the error says to run, run: the next call works again.
        await _oauth.login("notes", notes(servers))
        assert (await ex.execute(code)).text == "noted: x"
    assert len(browser.visits) == 2


async def test_a_token_for_another_resource_is_refused_and_never_sent_to_it(
    servers: dict[str, str], browser: Browser
) -> None:
    # The authorization server binds tokens to a resource; the other MCP server refuses one of this one.
    token = stats(servers, "token-for", {"resource": f"{servers['mcp']}/mcp"})["access_token"]
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    assert httpx2.post(f"{servers['other']}/mcp", json=body, headers=headers).status_code == 401
    # ipybox keeps a login per server and URL: the same name at another URL gets none of it,
    # and its own login asks for its own resource.
    await _oauth.login("notes", notes(servers))
    assert _oauth.TokenStore("notes", f"{servers['other']}/mcp").read() == {}
    assert await call(notes(servers, "other"), "elsewhere") == {"result": "noted: elsewhere"}
    assert len(browser.visits) == 2
    assert "resource=" + httpx2.URL(f"{servers['other']}/mcp").raw_path.decode() not in browser.visits[0]
    assert httpx2.QueryParams(browser.visits[1].split("?", 1)[1])["resource"] == f"{servers['other']}/mcp"


async def test_authorization_metadata_naming_another_origin_is_refused(
    servers: dict[str, str], browser: Browser
) -> None:
    before = stats(servers)["foreign"]
    with pytest.raises(AuthorizationError) as caught:
        await call(notes(servers, "foreign"), "x", server_name="foreign")
    message = str(caught.value)
    assert "'foreign'" in message and "issuer" in message.lower() and "ipybox auth login foreign" in message
    # Nothing was registered with or asked of the impostor, and no browser was sent to it.
    assert stats(servers)["foreign"] == before
    assert browser.visits == []


async def test_a_redirect_to_another_host_never_carries_the_token(
    servers: dict[str, str], browser: Browser
) -> None:
    await _oauth.login("notes", notes(servers))
    stats(servers, "redirect", {"to": f"{servers['evil']}/mcp"})
    try:
        with pytest.raises(MCPServerError):
            await call(notes(servers), "x")
    finally:
        stats(servers, "redirect", {"to": None})
    assert stats(servers)["evil"] == []  # not followed at all
    assert await call(notes(servers), "back") == {"result": "noted: back"}


async def test_a_callback_with_another_state_is_refused(servers: dict[str, str], browser: Browser) -> None:
    # At the loopback listener: the forged redirect gets 400 and the login waits for the real one.
    browser.forge_first = True
    await _oauth.login("notes", notes(servers))
    assert browser.callback_answers == [400, 200]

    # At the application's own callback: a redirect whose state is not the one sent is refused.
    async def application(server_name: str, authorization_url: str) -> str:
        async with httpx2.AsyncClient() as client:
            location = (await client.get(authorization_url)).headers["location"]
        params = dict(httpx2.QueryParams(location.split("?", 1)[1]))
        return f"https://app.example/callback?code={params['code']}&state=stale"

    _oauth.set_authorization_handler(application)
    url = f"{servers['other']}/mcp"
    with pytest.raises(AuthorizationError, match="state does not match"):
        await _oauth.login("other", {"url": url, "oauth": {"redirect_uri": "https://app.example/callback"}})
    assert not _oauth.TokenStore("other", url).read().get("tokens")


async def test_a_redirect_uri_other_than_the_registered_one_is_refused_on_both_sides(
    servers: dict[str, str],
) -> None:
    evil = f"{servers['evil']}/callback"
    seen: list[str] = []

    async def elsewhere(server_name: str, authorization_url: str) -> str:
        seen.append(authorization_url)
        query = dict(httpx2.QueryParams(authorization_url.split("?", 1)[1]))
        # The authorization server sends no code to a redirect_uri the client did not register.
        base = authorization_url.split("?", 1)[0]
        moved = f"{base}?{httpx2.QueryParams({**query, 'redirect_uri': evil})}"
        async with httpx2.AsyncClient() as client:
            answer = await client.get(moved)
        assert answer.status_code == 400 and "location" not in answer.headers
        # ipybox takes no code that came back anywhere but its own callback, right state or not.
        return f"{evil}?code=stolen&state={query['state']}"

    _oauth.set_authorization_handler(elsewhere)
    try:
        with pytest.raises(AuthorizationError, match="did not come back to"):
            await _oauth.login("notes", notes(servers))
    finally:
        _oauth.set_authorization_handler(None)
    assert len(seen) == 1 and stats(servers)["evil"] == []


def test_oauth_parameters_are_checked() -> None:
    with pytest.raises(ServerParamsError, match="callback_port"):
        resolve_params({"url": "http://h/mcp", "oauth": {"callback_port": "x"}})
    with pytest.raises(ServerParamsError, match="Authorization"):
        resolve_params({"url": "http://h/mcp", "oauth": True, "headers": {"Authorization": "Bearer x"}})
    with pytest.raises(ServerParamsError, match="allowed are"):
        resolve_params({"url": "http://h/mcp", "oauth": {"password": "x"}})


def test_the_auth_command_logs_in_lists_and_forgets_without_showing_tokens(
    servers: dict[str, str], state_dir: Path
) -> None:
    env = {**os.environ, "IPYBOX_STATE_DIR": str(state_dir)}
    url = f"{servers['mcp']}/mcp"
    login = subprocess.Popen(
        [sys.executable, "-m", "ipybox", "auth", "login", "notes", "--url", url, "--no-browser"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert login.stderr is not None
    try:
        # The person: reads the URL the command prints, opens it, and the browser comes back.
        lines = iter(login.stderr.readline, "")
        authorization_url = next(line.strip() for line in lines if line.strip().startswith("http"))
        callback = httpx2.get(authorization_url).headers["location"]
        assert httpx2.get(callback).status_code == 200
        out, err = login.communicate(timeout=60)
    finally:
        if login.poll() is None:
            login.kill()
            login.communicate()
    assert login.returncode == 0, err
    assert "Logged in to MCP server 'notes'; it offers 1 tool." in out

    def ipybox(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "ipybox", *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    listing = ipybox("auth", "list")
    assert "notes" in listing and "active" in listing and "refreshable" in listing
    for token in all_tokens():
        assert token not in listing
    assert "Forgot" in ipybox("auth", "logout", "notes")
    assert "No stored OAuth logins" in ipybox("auth", "list")
    assert "--workspace" in ipybox("--help")


@pytest.fixture
async def logged_in(servers: dict[str, str], browser: Browser) -> AsyncIterator[list[str]]:
    await _oauth.login("notes", notes(servers))
    yield all_tokens()


@pytest.mark.slow  # a sandboxed executor
async def test_hostile_sandboxed_code_cannot_read_the_token_store(
    logged_in: list[str], servers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_sandbox()
    monkeypatch.chdir(tmp_path)
    await generate_mcp_sources("notes", notes(servers), tmp_path / "mcptools")
    # A config that lets the kernel read everything: the token store stays denied whatever it says.
    config = tmp_path.parent / f"{tmp_path.name}-open.json"
    config.write_text(
        json.dumps({"network": {"allowedDomains": []}, "filesystem": {"allowWrite": [str(tmp_path)]}})
    )
    folder = _oauth.oauth_dir()
    attack = f"""
import os
found = []
for root, dirs, files in os.walk({str(folder)!r}):
    for name in files:
        try:
            found.append(open(os.path.join(root, name)).read())
        except OSError as exc:
            found.append(type(exc).__name__)
try:
    found += os.listdir({str(folder)!r})
except OSError as exc:
    found.append(type(exc).__name__)
found.append(repr(dict(os.environ)))
print(repr(found))
"""
    async with CodeExecutor(sandbox=True, sandbox_config=config) as ex:
        seen = (await ex.execute(attack)).text or ""
        # The tool still works: the token is used outside the sandbox.
        code = "from mcptools.notes import add_note\nprint(add_note.run(add_note.Params(text='s')).result)"
        assert (await ex.execute(code)).text == "noted: s"
        # And what the kernel may read of the state folder around it shows no token either.
        around = (await ex.execute(f"import os\nprint(os.listdir({str(folder.parent)!r}))")).text or ""
    assert "refresh_token" not in seen and "access_token" not in seen
    sources = "".join(path.read_text() for path in (tmp_path / "mcptools").rglob("*.py"))
    for token in logged_in:
        assert token not in seen and token not in sources and token not in around


async def test_the_ipybox_mcp_server_uses_a_login_made_with_ipybox_auth_login(
    servers: dict[str, str], browser: Browser, tmp_path: Path, state_dir: Path
) -> None:
    from tests.mcp_server.support import connected, server_env, stdio_params

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    params = notes(servers)
    env = server_env(IPYBOX_STATE_DIR=str(state_dir))
    async with connected(stdio_params(workspace, env=env)) as client:
        # Without a login: the command to run, at once (no URL waits on the server's stderr).
        refused = await client.call_tool(
            "register_mcp_server", {"server_name": "notes", "server_params": params}
        )
        assert refused.is_error and "ipybox auth login notes --url" in str(refused.content)
        await _oauth.login("notes", params)  # what `ipybox auth login notes --url ...` does
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "notes", "server_params": params}
        )
        assert not registered.is_error, registered.content
        code = "from mcptools.notes import add_note\nprint(add_note.run(add_note.Params(text='mcp')).result)"
        ran = await client.call_tool("execute_ipython_cell", {"code": code})
        assert "noted: mcp" in str(ran.content)
    sources = "".join(path.read_text() for path in (workspace / "mcptools").rglob("*.py"))
    for token in all_tokens():
        assert token not in sources and token not in str(ran.content)
