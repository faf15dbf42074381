"""ipybox quickstart: generate a typed API for an MCP server, then run agent code that uses it.

Runs offline against the library-catalogue MCP server in this folder. Every tool call the
code makes stops for your decision: answer ``Approve? (Y/n)``, or pass ``--yes`` to approve
all calls (for scripts).

    python examples/quickstart.py [--yes]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path

from ipybox import ApprovalRequest, CodeExecutionResult, CodeExecutor, generate_mcp_sources

SERVER_PARAMS = {
    "command": sys.executable,
    "args": [str(Path(__file__).with_name("library_server.py"))],
}

# What an agent would write: several tool calls chained with ordinary Python.
CODE = """
from mcptools.library import search_books, get_book, borrow_book

found = search_books.run(search_books.Params(query="python"))
print(f"{found.total} books match 'python'")
details = [get_book.run(get_book.Params(book_id=book.id)) for book in found.books]
best = max(details, key=lambda book: book.rating)
print(f"best rated: {best.title} by {best.author} ({best.rating})")
loan = borrow_book.run(borrow_book.Params(book_id=best.id, borrower="Ada"))
print(f"lent to {loan.borrower}, due in {loan.due_in_days} days")
"""


async def ask(prompt: str) -> bool:
    # input() runs in a daemon thread: Ctrl-C at the prompt then ends the program at once (a
    # thread of asyncio's pool would hold the exit until Enter was pressed).
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[str | None] = loop.create_future()

    def read() -> None:
        try:
            line: str | None = input(prompt)
        except EOFError:
            line = None
        with contextlib.suppress(RuntimeError):  # the program ended meanwhile
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(line))

    threading.Thread(target=read, daemon=True).start()
    line = await answer
    if line is None:  # no terminal to answer from
        print("\nno answer (standard input is closed); run with --yes to approve every call")
        return False
    return line.strip().lower() in ("", "y", "yes")


async def main(approve_all: bool) -> None:
    modules = await generate_mcp_sources("library", SERVER_PARAMS, Path("mcptools"))
    print(f"generated mcptools/library/ with modules: {', '.join(sorted(modules))}")

    async with CodeExecutor() as executor:
        async for item in executor.stream(CODE):
            match item:
                case ApprovalRequest():
                    if approve_all or await ask(f"Tool call: {item}\nApprove? (Y/n): "):
                        print(f"approved: {item}")
                        await item.accept()
                    else:
                        print(f"rejected: {item}")
                        await item.reject()
                case CodeExecutionResult():
                    print(item.text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--yes", action="store_true", help="approve every tool call without asking")
    args = parser.parse_args()
    try:
        asyncio.run(main(args.yes))
    except KeyboardInterrupt:  # the executor has stopped; the prompt's thread may still wait
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # not sys.exit: Python's shutdown would wait on that thread's read
    except Exception as exc:  # a rejected call ends the code with an error: say so plainly
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
