#!/usr/bin/env bash
# Runs every check CI runs: formatting, lint, types, the documentation site's strict build, then
# the test suite.
# Usage: bash scripts/test.sh [--quick] [PYTEST_ARGS...]
#   --quick  for development: the same checks, but the tests marked `slow` are left out
#            (and so is the soak); CI and the README's test command run everything.
# Measured on 2 cores: the quick run about 4 minutes; the full run's tests 12 minutes on two workers
# on a quiet machine (three workers: no faster, the tests' processes use both cores), then the soak.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi
bash scripts/setup.sh
source scripts/_uv.sh

uv run --frozen ruff format --check src tests benchmarks examples
uv run --frozen ruff check src tests benchmarks examples
uv run --frozen mypy
bash scripts/docs.sh
# scripts/no_leftovers.py fails the run, naming them, if the tests left a process running (it
# adopts orphans, so none escapes). Both runs use two workers (pytest-xdist), each test module on
# one of them, so that a module's shared gateway, kernels and servers are started once.
if [ -n "$quick" ]; then
    uv run --frozen python scripts/no_leftovers.py \
        uv run --frozen pytest -m "not slow" -n 2 --dist loadfile "$@"
    exit
fi
uv run --frozen python scripts/no_leftovers.py uv run --frozen pytest -n 2 --dist loadfile "$@"
# The short soak (about 2 minutes) runs with the full suite, not with a chosen subset.
if [ "$#" -eq 0 ]; then
    uv run --frozen python benchmarks/soak.py --duration 120
fi
