#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml: the guide in docs/, the API reference from the
# docstrings, llms.txt and llms-full.txt) into build/site, offline and strictly: a broken link or
# cross-reference, a public name without a docstring or missing from docs/reference/
# (scripts/docs_hooks.py), or any other warning fails the build. mkdocs-material with mkdocstrings is
# what the MCP SDK, pydantic-ai and most projects near ipybox use; its pages are plain Markdown that
# GitHub renders too, and tests/test_docs_examples.py runs their code blocks.
# Usage: bash scripts/docs.sh [OUTPUT_DIR [CONFIG_FILE]]   build (default build/site, mkdocs.yml)
#        bash scripts/docs.sh --serve [ADDRESS]           preview, rebuilt on each change
#                                                         (default 127.0.0.1:8000)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_uv.sh
export NO_MKDOCS_2_WARNING=1

if [ "${1:-}" = "--serve" ]; then
    exec uv run --frozen mkdocs serve --strict --dev-addr "${2:-127.0.0.1:8000}"
fi
out="${1:-build/site}"
mkdir -p "$out"
uv run --frozen mkdocs build --strict --clean --config-file "${2:-mkdocs.yml}" --site-dir "$(cd "$out" && pwd)"
echo "Documentation built: $(cd "$out" && pwd)/index.html"
