"""Looks at the built documentation site as a person would, in headless Chromium.

Serves SITE_DIR on a free local port, opens the home page and a guide page, saves a screenshot
of each in OUT_DIR and fails, naming the page, when the navigation, the search box or the code
highlighting is missing, or when raw Markdown shows in the rendered text.

Usage: python scripts/check_docs_site.py CHROMIUM SITE_DIR OUT_DIR
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The home page, and a guide page that has a Python block.
PAGES = {"home": "", "guide": "guide/approval/"}
# What a reader would see if Markdown were not rendered: a fence, a heading's hashes, bold stars,
# a link's brackets.
RAW_MARKDOWN = re.compile(r"```|^#{1,6} |\*\*\w|\]\((?:[\w./-]+)\)", re.MULTILINE)


class _Page(HTMLParser):
    """The text a reader sees outside code, and the classes the page's elements carry."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.classes: set[str] = set()
        self.inputs: list[dict[str, str | None]] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.classes.update((dict(attrs).get("class") or "").split())
        if tag == "input":
            self.inputs.append(dict(attrs))
        if tag in ("pre", "code", "script", "style", "template"):
            self._hidden += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "code", "script", "style", "template"):
            self._hidden = max(0, self._hidden - 1)

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.text.append(data)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per request."""


def _chromium(chromium: str, *args: str) -> str:
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"]
    result = subprocess.run(
        [*command, "--virtual-time-budget=5000", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"test-docs-site: FAILED: chromium {' '.join(args)}: {result.stderr[-2000:]}")
    return result.stdout


def _problems(name: str, page: _Page) -> list[str]:
    problems = []
    if not {"md-nav", "md-nav__link"} <= page.classes:
        problems.append(f"{name}: no navigation (md-nav)")
    if not any("md-search__input" in (attrs.get("class") or "") for attrs in page.inputs):
        problems.append(f"{name}: no search box (md-search__input)")
    text = "".join(page.text)
    for match in RAW_MARKDOWN.finditer(text):
        context = text[max(0, match.start() - 40) : match.end() + 40].replace("\n", " ")
        problems.append(f"{name}: raw Markdown in the rendered text: ...{context}...")
    return problems


def main(chromium: str, site: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problems = []
    try:
        for name, path in PAGES.items():
            url = f"http://127.0.0.1:{server.server_port}/{path}"
            page = _Page()
            page.feed(_chromium(chromium, "--dump-dom", url))
            problems += _problems(name, page)
            # A highlighted block: Pygments' wrapper and its token classes (`kn`: a keyword such as import).
            if name == "guide" and not {"highlight", "kn"} <= page.classes:
                problems.append(f"{name}: code blocks without highlighting")
            shot = out / f"{name}.png"
            _chromium(chromium, f"--screenshot={shot}", url)
            if not shot.is_file() or shot.stat().st_size < 10_000:
                problems.append(f"{name}: no screenshot, or a blank one ({shot})")
            print(f"test-docs-site: {url} -> {shot}")
    finally:
        server.shutdown()
    for problem in problems:
        print(f"test-docs-site: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
