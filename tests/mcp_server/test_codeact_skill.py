"""A scripted walk through the codeact skill's own steps against the real ipybox MCP server.

An agent following plugins/codeact/skills/codeact/ would: register a server, find its tools with
``search_tools`` (then by listing folders and reading the package docstring), read one tool's interface, run one code
action that chains two tools, give a text-only tool an output parser, save the code action as
a gentool and use that in a fresh kernel. The code it runs is taken from the skill's files
wherever they show it, so the skill's examples are tested as written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, stdio_params, text_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SKILL = ROOT / "plugins" / "codeact" / "skills" / "codeact"
LIBRARY = ROOT / "examples" / "library_server.py"


def _python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), re.DOTALL)


def _folders(path: Path) -> list[str]:
    """What listing a folder shows an agent, without Python's caches."""
    return sorted(p.name for p in path.iterdir() if p.is_dir() and p.name != "__pycache__")


def _dedent(block: str) -> str:
    """Code blocks inside numbered list items are indented by three spaces."""
    lines = block.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines) + "\n"


@pytest.mark.timeout(300)
async def test_an_agent_following_the_codeact_skill_reaches_every_step(tmp_path: Path) -> None:
    workspace = tmp_path
    async with connected(stdio_params(workspace)) as client:
        # Register the shipped example server (the skill's "What you work with").
        registered = await client.call_tool(
            "register_mcp_server",
            {"server_name": "library", "server_params": {"command": sys.executable, "args": [str(LIBRARY)]}},
        )
        assert not registered.is_error, text_of(registered)

        # Step 1: search before reading; then gentools/ (names only), and a package's docstring.
        found = await client.call_tool("search_tools", {"query": "find books about a subject", "limit": 3})
        assert not found.is_error, text_of(found)
        assert "    from mcptools.library import search_books" in text_of(found).splitlines()
        assert not (workspace / "gentools").exists()
        assert _folders(workspace / "mcptools") == ["library"]
        overview = (workspace / "mcptools" / "library" / "__init__.py").read_text()
        assert re.search(r"^- search_books: ", overview, re.MULTILINE)
        assert re.search(r"^- get_book: ", overview, re.MULTILINE)

        # Step 2: the interface of one tool.
        interface = (workspace / "mcptools" / "library" / "search_books.py").read_text()
        for name in ["class Params", "class Result", "def run(params: Params | dict[str, Any]) -> Result"]:
            assert name in interface

        # Step 3: the skill's own code action, chaining two tools in one cell.
        (action,) = _python_blocks(SKILL / "SKILL.md")
        chained = await run(client, action)
        assert not chained.is_error, text_of(chained)
        assert text_of(chained).strip() == "Fluent Python (4.7)"

        # Step 4: an output parser for a tool without an output schema (the demo server's greet).
        registered = await client.call_tool(
            "register_mcp_server",
            {"server_name": "demo", "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]}},
        )
        assert not registered.is_error, text_of(registered)
        greet_module = workspace / "mcptools" / "demo" / "greet.py"
        assert "class Result" not in greet_module.read_text(), "greet returns plain text"
        sample = await run(
            client,
            "from mcptools.demo import greet\nraw = greet.run(greet.Params(name='Ada'))\nprint(raw[:800])",
        )
        assert text_of(sample).strip() == "Hello, Ada!"
        (workspace / "mcpparse" / "demo").mkdir(parents=True)
        (workspace / "mcpparse" / "__init__.py").write_text("")
        (workspace / "mcpparse" / "demo" / "__init__.py").write_text("")
        (workspace / "mcpparse" / "demo" / "greet.py").write_text(
            '"""Parser for the output of the `greet` tool of the `demo` MCP server."""\n\n'
            "import re\nfrom typing import Any\n\n\n"
            "def parse(raw: str) -> dict[str, Any]:\n"
            r"    match = re.fullmatch(r'(\w+), (.+?)(\W*)', raw.strip())" + "\n"
            "    if match is None:\n"
            "        raise ValueError(f'unexpected greet output: {raw!r}')\n"
            "    return {'salutation': match[1], 'name': match[2], 'punctuation': match[3]}\n"
        )
        # The block the reference appends, with this tool's fields.
        appended = _dedent(_python_blocks(SKILL / "references" / "output-parsers.md")[1])
        appended = appended.replace("<server>", "demo").replace("<tool>", "greet")
        appended = re.sub(
            r"class ParseItem\(BaseModel\):.*?\n\n\n", "", appended, count=1, flags=re.DOTALL
        ).replace(
            "    total: int\n    items: list[ParseItem]\n",
            "    salutation: str\n    name: str\n    punctuation: str\n",
        )
        with greet_module.open("a") as module:
            module.write("\n\n" + appended)
        await client.call_tool("reset", {})
        parsed = await run(
            client,
            "from mcptools.demo import greet\n"
            "result = greet.run_parsed(greet.Params(name='Grace Hopper', punctuation='?!'))\n"
            "print(type(result).__name__, result.name, result.punctuation)",
        )
        assert not parsed.is_error, text_of(parsed)
        assert text_of(parsed).strip() == "ParseResult Grace Hopper ?!"

        # Step 5: save the code action as a gentool, with the reference's own files.
        api, impl, init, check = (
            _dedent(b) for b in _python_blocks(SKILL / "references" / "saving-code-actions.md")
        )
        package = workspace / "gentools" / "library" / "top_rated_books"
        package.mkdir(parents=True)
        (workspace / "gentools" / "__init__.py").write_text("")
        (workspace / "gentools" / "library" / "__init__.py").write_text("")
        (package / "api.py").write_text(api)
        (package / "impl.py").write_text(impl)
        (package / "__init__.py").write_text(init)

        # ... and use it from a fresh kernel, as a later code action would.
        await client.call_tool("reset", {})
        saved = await run(client, check)
        assert not saved.is_error, text_of(saved)
        assert text_of(saved).strip().splitlines() == ["Fluent Python 4.7", "Python Crash Course 4.5"]

        # A later discovery finds the saved tool first and needs only its interface.
        assert _folders(workspace / "gentools") == ["library"]
        interface = (package / "api.py").read_text()
        assert interface.startswith('"""Find the best-rated books')
        assert "def run(subject: str, top_n: int = 3) -> list[RatedBook]:" in interface
        composed = await run(
            client,
            "from gentools.library.top_rated_books import run as top_rated\n"
            "from mcptools.library import borrow_book, search_books\n"
            "best = top_rated(subject='data', top_n=1)[0]\n"
            "book_id = search_books.run(search_books.Params(query=best.title)).books[0].id\n"
            "loan = borrow_book.run(borrow_book.Params(book_id=book_id, borrower='ada'))\n"
            "print(best.title, loan.due_in_days)",
        )
        assert text_of(composed).strip() == "Designing Data-Intensive Applications 14", text_of(composed)
