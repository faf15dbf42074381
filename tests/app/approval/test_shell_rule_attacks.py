"""Attacks on shell rules from a sandboxed kernel whose commands need approval (issue 38).

Each attack is a command line that an ``allow`` rule for harmless programs let through unasked
while the shell ran something else: a program the kernel planted, a substitution, a git alias,
a builtin that evaluates a subscript, a command that read the rest of its own script. Now each
is asked about (here: rejected) or refused, and the marker it would touch never appears.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import CodeExecutor
from ipybox.policy import Policy, Rule
from tests.sandbox_support import attack, sandboxed_workdir

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ALLOWED = ["ls", "cat", "head", "git", "printf"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from sandboxed_workdir(tmp_path_factory, "shell-rules")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def walled(workdir: Path) -> AsyncIterator[CodeExecutor]:
    policy = Policy((Rule("allow", program=ALLOWED),), default="ask")
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir, policy=policy) as ex:
        yield ex


PLANT = (
    "import os, pathlib\n"
    "pathlib.Path({folder!r}).mkdir(exist_ok=True)\n"
    "pathlib.Path({path!r}).write_text('#!/bin/sh\\ntouch {marker}\\n')\n"
    "os.chmod({path!r}, 0o755)\n"
)


async def test_an_assignment_before_an_allowed_program_is_asked_about(
    walled: CodeExecutor, workdir: Path
) -> None:
    marker = workdir / "planted-path-ls-ran"
    code = PLANT.format(folder="bin", path="bin/ls", marker=marker) + "!PATH=./bin:/usr/bin:/bin ls"
    asked, text = await attack(walled, code)
    assert asked == [{"cmd": "PATH=./bin:/usr/bin:/bin ls"}], text
    assert "rejected" in text
    assert not marker.exists()


async def test_a_substitution_hidden_behind_an_escaped_brace_is_asked_about(
    walled: CodeExecutor, workdir: Path
) -> None:
    marker = workdir / "brace-ran"
    cell = f"ls ${{x:-\\}} #$(touch {marker}; id)}}\n"
    asked, text = await attack(walled, "%%bash\n" + cell)
    assert asked == [{"magic": "bash", "cmd": cell}], text
    assert not marker.exists()


async def test_a_script_program_given_by_a_path_is_refused(walled: CodeExecutor, workdir: Path) -> None:
    marker = workdir / "planted-bash-ran"
    await attack(walled, PLANT.format(folder=".", path="bash", marker=marker))
    asked, text = await attack(walled, "%%script ./bash\nls\n")
    assert asked == []
    assert "given by a path" in text and "name it instead" in text
    assert not marker.exists()


async def test_a_git_alias_allowed_by_git_by_name_is_asked_about(walled: CodeExecutor, workdir: Path) -> None:
    marker = workdir / "git-alias-ran"
    cmd = f"git -c alias.x='!touch {marker}' x"
    asked, _ = await attack(walled, "!" + cmd)
    assert asked == [{"cmd": cmd}]
    assert not marker.exists()


async def test_a_builtin_that_evaluates_a_subscript_is_asked_about(
    walled: CodeExecutor, workdir: Path
) -> None:
    marker = workdir / "subscript-ran"
    cell = f"printf -v 'a[$(touch {marker})]' x\n"
    asked, _ = await attack(walled, "%%bash\n" + cell)
    assert asked == [{"magic": "bash", "cmd": cell}]
    assert not marker.exists()


async def test_a_command_cannot_read_the_rest_of_its_script_and_change_what_runs_next(
    walled: CodeExecutor, workdir: Path
) -> None:
    # Every line is allowed; fed on stdin, `head -c 4` would eat "ls '" and bash would run the touch.
    marker = workdir / "stdin-ran"
    cell = f"head -c 4\nls 'x;touch {marker};'\nls '\n'\n"
    asked, _ = await attack(walled, "%%bash\n" + cell)
    assert asked == []
    assert not marker.exists()


async def test_a_plain_allowed_line_still_runs_unasked(walled: CodeExecutor, workdir: Path) -> None:
    (workdir / "visible.txt").write_text("seen\n")
    asked, text = await attack(walled, "!ls visible.txt && cat visible.txt")
    assert (asked, text) == ([], "visible.txt\nseen")


async def test_a_large_script_cell_still_runs_whole(walled: CodeExecutor, workdir: Path) -> None:
    (workdir / "last.txt").write_text("")
    cell = "ls -d 'last.txt'" + " " * 200_000 + "\nls last.txt\n"  # too long for one argument
    asked, text = await attack(walled, "%%bash\n" + cell)
    assert (asked, text) == ([], "last.txt\nlast.txt"), text[-400:]


@pytest.mark.parametrize(
    "spelling",
    ['"r\\\nm" {marker}', "a+=1 rm {marker}", "ls ${{x:-\\}} #$(rm {marker})}}"],
    ids=["backslash-newline-in-quotes", "append-assignment", "escaped-brace"],
)
async def test_a_denied_program_in_disguise_is_never_allowed(
    walled: CodeExecutor, workdir: Path, spelling: str
) -> None:
    # `deny rm` before `allow *`: a spelling the shell reads as rm must not be allowed as another program.
    marker = workdir / f"kept-{abs(hash(spelling))}"
    marker.write_text("")
    saved = walled.policy
    walled.policy = Policy((Rule("deny", program="rm"), Rule("allow", program="*")), default="ask")
    try:
        await attack(walled, "%%bash\n" + spelling.format(marker=marker) + "\n")
    finally:
        walled.policy = saved
    assert marker.exists()
