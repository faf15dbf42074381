"""Every code block of README.md and docs/**/*.md runs, as a reader meets them, page by page.

Sybil reads the pages (its Markdown lexer finds the fenced blocks, and its `<!-- skip: next
"reason" -->` is the marker the pages use); this module runs them. Sybil rather than
pytest-examples because it has that skip marker and one namespace per document built in, where
pytest-examples checks each block on its own.

- ``python`` blocks share one namespace per page and run in order in this process, compiled with
  top-level ``await`` allowed and run on one event loop per page; their working directory is a
  temporary folder per page that links to each top-level entry of the clone, so that a block that
  writes files (an `mcptools/`, a `workspace/`) writes them there.
- An ``output`` block right after a python block holds what that block prints; a line ``...``
  stands for any lines.
- ``bash`` blocks run with bash from the clone's root, standard input answering ``y`` to each
  prompt as a reader would; a block that changes a file git knows of fails.
- ``json``, ``toml`` and ``yaml`` blocks are parsed; an MCP client configuration (``mcpServers``)
  is read by the MCP SDK's model of a stdio server, a policy file by `ipybox.policy.load_policy`.
- Any other block fails unless `<!-- skip: next "the reason" -->` precedes it; a skip without a
  reason fails too.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import json
import re
import subprocess
import tempfile
import tomllib
import unittest
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the environment
from mcp.client.stdio import StdioServerParameters
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from ipybox.policy import load_policy

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
_INFO = re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE)
_REASON = re.compile(r"""\s*(["']).+\1\s*$""")
_POLICY_KEYS = {"default", "trusted_servers", "rule"}


@dataclass
class _Page:
    """What the blocks of one page share: the event loop, the folder, the last block's output."""

    workdir: Path
    loop: asyncio.AbstractEventLoop
    printed: str | None = None
    printed_end: int = -1
    ran: list[str] = field(default_factory=list)


class _ReasonedSkipParser(SkipParser):
    """Sybil's skip marker, refused without a reason (a bare one would skip silently)."""

    def __call__(self, document: Document) -> Iterator[Region]:
        for region in super().__call__(document):
            action, reason = region.parsed
            if action in ("next", "start") and not (reason and _REASON.match(reason)):
                line = document.text.count("\n", 0, region.start) + 1
                raise ValueError(
                    f'{document.path}:{line}: say why the block cannot run: <!-- skip: {action} "the reason" -->'
                )
            yield region


def _matches(expected: str, printed: str) -> bool:
    pattern = "".join(
        r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"[ \t]*\n"
        for line in expected.splitlines()
    )
    text = "\n".join(line.rstrip() for line in printed.splitlines()) + "\n"
    return re.fullmatch(pattern, text if printed else "") is not None


def _check_config(language: str, source: str) -> None:
    if language == "json":
        data = json.loads(source)
        for name, server in (data.get("mcpServers", {}) if isinstance(data, dict) else {}).items():
            assert isinstance(server, dict) and "command" in server, f"the MCP server {name!r} has no command"
            StdioServerParameters(**server)
    elif language == "toml":
        data = tomllib.loads(source)
        if data and set(data) <= _POLICY_KEYS:
            with tempfile.TemporaryDirectory() as folder:
                (Path(folder) / "policy.toml").write_text(source)
                load_policy(Path(folder) / "policy.toml")
    else:
        list(yaml.safe_load_all(source))


class _Runner:
    """Sybil's evaluator for every fenced block of one page."""

    def __init__(self, page: _Page) -> None:
        self.page = page

    def __call__(self, example: Example) -> None:
        language = example.parsed["info"].split()[0] if example.parsed["info"].split() else ""
        source = str(example.parsed["source"])
        where = f"{_shown(Path(example.path))}:{example.line}"
        if language == "python":
            self._python(source, example, where)
        elif language == "output":
            self._output(source, example, where)
        elif language == "bash":
            self._bash(source, where)
        elif language in ("json", "toml", "yaml"):
            try:
                _check_config(language, source)
            except Exception as exc:  # any error of a parser or loader is the page's
                raise AssertionError(f"{where}: the {language} block is refused: {exc}") from exc
        else:
            raise AssertionError(
                f"{where}: a ```{language} block is neither runnable (python, output, bash, json, toml, yaml) "
                'nor marked: put <!-- skip: next "the reason" --> before it'
            )
        self.page.ran.append(f"{where} {language}")

    def _python(self, source: str, example: Example, where: str) -> None:
        # Blank lines in front, so that a traceback names the line of the page.
        code = compile(
            "\n" * example.line + source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        )
        printed = io.StringIO()
        with contextlib.chdir(self.page.workdir), contextlib.redirect_stdout(printed):
            result = eval(code, example.namespace)
            if asyncio.iscoroutine(result):
                self.page.loop.run_until_complete(result)
        self.page.printed, self.page.printed_end = printed.getvalue(), example.end

    def _output(self, expected: str, example: Example, where: str) -> None:
        between = example.document.text[self.page.printed_end : example.start]
        if self.page.printed is None or self.page.printed_end < 0 or between.strip():
            raise AssertionError(
                f"{where}: an output block must come right after the python block whose output it shows"
            )
        if not _matches(expected, self.page.printed):
            raise AssertionError(
                f"{where}: the block above printed:\n{self.page.printed}\nbut the page shows:\n{expected}"
            )

    def _bash(self, source: str, where: str) -> None:
        before = _git_status()
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", source],
            cwd=ROOT,
            input="y\n" * 100,
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
        assert result.returncode == 0, (
            f"{where}: exit status {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
        assert _git_status() == before, (
            f"{where}: the block changed files of the clone; run it elsewhere or mark it"
        )


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def _document(page: _Page, path: Path) -> Document:
    fences = RawFencedCodeBlockLexer(info_pattern=_INFO)
    runner = _Runner(page)

    def blocks(document: Document) -> Iterator[Region]:
        for region in fences(document):
            region.parsed = region.lexemes
            region.evaluator = runner
            yield region

    return Sybil(parsers=[_ReasonedSkipParser(), blocks]).parse(path)


def _marks(path: Path) -> list[pytest.MarkDecorator]:
    runs = re.search(r"^\s*```(?:python|bash)\s*$", path.read_text(), re.MULTILINE)
    return [pytest.mark.slow] if runs else []


def _run_page(path: Path, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Runs the blocks of the page at `path`; returns what ran and what was skipped, and why."""
    workdir = tmp_path / "clone"
    workdir.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "mcptools", "images", "workspace"):
            (workdir / entry.name).symlink_to(entry)
    skipped = []
    with asyncio.Runner() as runner:
        page = _Page(workdir, runner.get_loop())
        for example in _document(page, path):
            try:
                example.evaluate()
            except unittest.SkipTest as reason:
                skipped.append(f"line {example.line}: {reason}")
    return page.ran, skipped


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "path",
    [pytest.param(path, id=str(path.relative_to(ROOT)), marks=_marks(path)) for path in PAGES],
)
def test_every_code_block_of_the_page_runs_or_says_why_not(path: Path, tmp_path: Path) -> None:
    ran, skipped = _run_page(path, tmp_path)
    print(f"{path.relative_to(ROOT)}: ran {len(ran)} blocks, skipped {len(skipped)}")
    print("\n".join(skipped))


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("# A page\n\n```text\nraw\n```\n", "neither runnable"),
        ("```\nno language\n```\n", "neither runnable"),
        ("<!-- skip: next -->\n```text\nraw\n```\n", "say why the block cannot run"),
        ("```python\nprint(1 + 1)\n```\n```output\n3\n```\n", "printed:\n2"),
        ("```python\nprint(2)\n```\n\nSome text.\n\n```output\n2\n```\n", "right after the python block"),
        ("```output\n2\n```\n", "right after the python block"),
        ('```json\n{"mcpServers": {"x": {"args": []}}}\n```\n', "has no command"),
        ('```toml\ndefault = "maybe"\n```\n', "should be 'allow', 'ask' or 'deny'"),
        ("```bash\nexit 3\n```\n", "exit status 3"),
    ],
)
def test_a_page_fails_on_an_unmarked_block_a_reasonless_skip_or_a_wrong_output_or_config(
    tmp_path: Path, text: str, complaint: str
) -> None:
    with pytest.raises((AssertionError, ValueError)) as failure:
        _run_page(_page(tmp_path, text), tmp_path)
    assert complaint in str(failure.value)


def test_a_page_shares_one_namespace_and_one_event_loop_and_checks_shown_output(tmp_path: Path) -> None:
    text = (
        "```python\nimport asyncio\nawait asyncio.sleep(0)\nloop = asyncio.get_running_loop()\nx = 20\n```\n\n"
        '<!-- skip: next "cannot run here" -->\n```text\nraw\n```\n\n'
        "```python\nawait asyncio.sleep(0)\nassert asyncio.get_running_loop() is loop\nprint(x + 1)\nprint('a')\nprint('b')\n```\n"
        "```output\n21\n...\n```\n\n"
        '```json\n{"mcpServers": {"ipybox": {"command": "uvx", "args": ["ipybox"]}}}\n```\n'
        "```yaml\na: 1\n```\n"
    )
    ran, skipped = _run_page(_page(tmp_path, text), tmp_path)
    assert [entry.split()[-1] for entry in ran] == ["python", "python", "output", "json", "yaml"]
    assert skipped == ["line 9: cannot run here"]
