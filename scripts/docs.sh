#!/usr/bin/env bash
# Builds the API reference (docs/, from the docstrings) into docs/_build/html, offline.
# Strict: a broken cross-reference, a public name without a docstring or missing from
# docs/reference.rst, or any other warning fails the build (see docs/conf.py).
# Usage: bash scripts/docs.sh [OUTPUT_DIR [SOURCE_DIR]]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_uv.sh

out="${1:-docs/_build/html}"
uv run --frozen sphinx-build --quiet --builder html --fail-on-warning --keep-going --nitpicky \
    --fresh-env "${2:-docs}" "$out"
echo "API reference built: $(cd "$out" && pwd)/index.html"
