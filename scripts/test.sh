#!/usr/bin/env bash
# Runs every check CI runs: formatting, lint, types, the API reference's strict build, then
# the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_uv.sh

uv run --frozen ruff format --check src tests benchmarks examples
uv run --frozen ruff check src tests benchmarks examples
uv run --frozen mypy
bash scripts/docs.sh
uv run --frozen pytest "$@"
# The short soak (about 2 minutes) runs with the full suite, not with a chosen subset.
if [ "$#" -eq 0 ]; then
    uv run --frozen python benchmarks/soak.py --duration 120
fi
