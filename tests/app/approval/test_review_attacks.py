"""A fresh reviewer's attacks on shell rules (issue 38), run in a sandboxed kernel whose commands
need approval and whose policy is ``deny rm`` before ``allow *`` (or ``allow`` of harmless tools).

An attack that still gets through is marked ``xfail(strict=True)`` with ``open: ...``: the test
asserts what should hold (the victim file survives, no marker appears), so it fails today and the
suite stays green; once fixed, the strict xfail turns into a failure that asks to drop the mark.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutionResult, CodeExecutor, KernelPool
from ipybox.policy import Policy, Rule
from tests.sandbox_support import attack, numbered_folders, require_sandbox, sandboxed_workdir

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from sandboxed_workdir(tmp_path_factory, "review-attacks")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def walled(workdir: Path) -> AsyncIterator[CodeExecutor]:
    policy = Policy((Rule("deny", program=["rm"]), Rule("allow", program=["*"])), default="ask")
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir, policy=policy) as ex:
        yield ex


def victim(workdir: Path, name: str) -> Path:
    path = workdir / name
    path.write_text("keep me\n")
    return path


async def test_deny_rm_stops_rm_by_path_and_in_a_substitution(walled: CodeExecutor, workdir: Path) -> None:
    """Control: what the README promises for `deny rm` holds."""
    target = victim(workdir, "control-victim")
    _, text = await attack(walled, f"!ls; /bin/rm {target.name}\n!echo $(rm {target.name})")
    assert target.exists(), text
    assert "refused by policy rule 1" in text


async def test_setarch_runs_a_denied_program(walled: CodeExecutor, workdir: Path) -> None:
    target = victim(workdir, "setarch-victim")
    _, text = await attack(walled, f"!setarch x86_64 rm {target.name}")
    assert target.exists(), text


async def test_linux64_runs_a_denied_program(walled: CodeExecutor, workdir: Path) -> None:
    target = victim(workdir, "linux64-victim")
    _, text = await attack(walled, f"!linux64 rm {target.name}")
    assert target.exists(), text


async def test_rbash_runs_a_denied_program(walled: CodeExecutor, workdir: Path) -> None:
    target = victim(workdir, "rbash-victim")
    _, text = await attack(walled, f"!rbash -c 'rm {target.name}'")
    assert target.exists(), text


async def test_split_filter_runs_a_denied_program(walled: CodeExecutor, workdir: Path) -> None:
    target = victim(workdir, "split-victim")
    _, text = await attack(walled, f"!split --filter='rm {target.name}' {target.name}")
    assert target.exists(), text


PLANT = (
    "import os, pathlib\n"
    "pathlib.Path({path!r}).write_text('#!/bin/sh\\ncat >/dev/null\\ntouch {marker}\\n')\n"
    "os.chmod({path!r}, 0o755)\n"
)


async def test_diff3_runs_a_planted_program(walled: CodeExecutor, workdir: Path) -> None:
    marker = workdir / "diff3-ran"
    for name in ("d1", "d2", "d3"):
        victim(workdir, name)
    code = PLANT.format(path="planted-diff", marker=marker) + "!diff3 --diff-program=./planted-diff d1 d2 d3"
    _, text = await attack(walled, code)
    assert not marker.exists(), text


async def test_sort_compress_program_runs_a_planted_program(walled: CodeExecutor, workdir: Path) -> None:
    marker = workdir / "sort-ran"
    big = workdir / "big.txt"
    big.write_text("".join(f"{i:08d}\n" for i in range(200_000)))
    code = (
        PLANT.format(path="planted-gzip", marker=marker)
        + "!sort -S 64K --compress-program=./planted-gzip big.txt > sorted.txt"
    )
    _, text = await attack(walled, code)
    assert not marker.exists(), text


async def test_script_magic_for_rbash_runs_a_denied_program(walled: CodeExecutor, workdir: Path) -> None:
    target = victim(workdir, "script-rbash-victim")
    _, text = await attack(walled, f"%%script rbash\nrm {target.name}\n")
    assert target.exists(), text


async def test_script_magic_for_setarch_bash_runs_a_denied_program(
    walled: CodeExecutor, workdir: Path
) -> None:
    target = victim(workdir, "script-setarch-victim")
    _, text = await attack(walled, f"%%script setarch x86_64 bash\nrm {target.name}\n")
    assert target.exists(), text


async def test_question_shows_the_programs_of_a_padded_shell_line_up_front() -> None:
    import random

    # private: the question text `ipybox --approve-tool-calls` puts to the person, built alone
    from ipybox.mcp_server._question import HEAD_CHARS, shown_call

    rng = random.Random(38)
    padding = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(50_000))
    cmd = f"echo '{padding}'; rm -rf ~/projects"

    async def respond(*_: object, **__: object) -> bool:
        return False

    shown = shown_call(ApprovalRequest("ipybox", "shell", {"cmd": cmd}, respond))
    assert shown is not None
    assert "rm" in shown[:HEAD_CHARS].split("]", 1)[0], (
        "the person must see that this line runs rm without reading 50,000 characters"
    )
    assert shown.startswith("[runs: echo, rm] "), shown[:100]


async def test_a_program_remembered_for_the_session_runs_a_command_unasked(workdir: Path) -> None:
    marker = workdir / "remembered-split-ran"
    victim(workdir, "split-input")
    asked: list[dict[str, object]] = []
    policy = Policy((), default="ask")
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir, policy=policy) as ex:
        async for item in ex.stream("!split -l 1 split-input part-", timeout=60):
            if isinstance(item, ApprovalRequest):
                await item.accept(remember=True)
        asked, text = await attack(ex, f"!split --filter='touch {marker}' split-input")
    assert asked or not marker.exists(), (asked, text)


STOPPED = [
    "command rm {v}",
    "builtin command rm {v}",
    "exec rm {v}",
    "time rm {v}",
    "\\time rm {v}",
    "coproc rm {v}",
    "r''m {v}",
    "$'rm' {v}",
    "$'\\x72m' {v}",
    "{{r,}}m {v}",
    "IFS=_; x=rm_{v}; $x",
    "ls <(rm {v})",
    "cat <<EOF\n$(rm {v})\nEOF",
    "alias ls=rm; ls {v}",
    'f() {{ rm "$@"; }}; f {v}',
    "ls\rrm {v}",
    "ls;\u037e rm {v}",
    "ls &\nrm {v}",
    "eval rm {v}",
    "env rm {v}",
    "xargs rm <<< {v}",
    "find . -name {v} -delete",
    "nice rm {v}",
    "busybox rm {v}",
    "hash -p /bin/rm ls; ls {v}",
    "enable -n echo; echo {v}",
]


@pytest.mark.parametrize("line", STOPPED)
async def test_a_wrapped_or_disguised_rm_is_asked_or_refused(
    walled: CodeExecutor, workdir: Path, line: str
) -> None:
    """Keywords, builtins, quoting, expansions, here-documents, aliases, functions and control
    characters around `rm`: each line is asked about (here: rejected) or refused by `deny rm`."""
    target = victim(workdir, f"stopped-{STOPPED.index(line)}")
    cmd = line.format(v=target.name)
    asked, text = await attack(walled, f"get_ipython().system({cmd!r})")
    assert target.exists(), (asked, text)
    assert asked == [{"cmd": cmd}] or "refused by policy rule 1" in text, (asked, text)


async def test_remember_without_a_policy_allows_the_program_for_the_session(workdir: Path) -> None:
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir) as ex:
        async for item in ex.stream("!ls", timeout=60):
            if isinstance(item, ApprovalRequest):
                await item.accept(remember=True)
        asked, text = await attack(ex, "!ls")
    assert asked == [], text


async def accept_all(ex: CodeExecutor, code: str) -> str:
    text = ""
    try:
        async for item in ex.stream(code, timeout=60):
            if isinstance(item, ApprovalRequest):
                await item.accept()
            elif isinstance(item, CodeExecutionResult):
                text = item.text or ""
    except CodeExecutionError as exc:
        text = str(exc)
    return text


async def test_a_pooled_session_cannot_reach_another_sessions_folder(tmp_path: Path) -> None:
    """Session A, its commands approved, reads and plants in session B's folder by path, by
    `os.chdir` (the command's cwd comes from the kernel) and by `cd` in the line: each fails."""
    require_sandbox()
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    new_folder = numbered_folders(sessions)

    options = {"sandbox": True, "approve_shell_cmds": True, "sandbox_hidden": (sessions,)}
    async with KernelPool(size=2, working_dir=tmp_path, new_folder=new_folder, **options) as pool:  # type: ignore[arg-type]
        a, b = pool.claim(), pool.claim()
        (b / "secret.txt").write_text("b's secret")
        async with (
            CodeExecutor(working_dir=a, pool=pool, **options) as ea,  # type: ignore[arg-type]
            CodeExecutor(working_dir=b, pool=pool, **options) as eb,  # type: ignore[arg-type]
        ):
            texts = [
                await accept_all(ea, f"!cat {b}/secret.txt; touch {b}/planted"),
                await accept_all(ea, f"print(open('{b}/secret.txt').read())"),
                await accept_all(ea, f"import os\nos.chdir('{b}')\n!cat secret.txt; touch planted"),
                await accept_all(ea, f"!cd {b} && cat secret.txt && touch planted"),
            ]
            assert await accept_all(eb, "!cat secret.txt") == "b's secret"
    assert not (b / "planted").exists()
    assert not any("b's secret" in text for text in texts), texts
