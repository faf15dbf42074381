#!/usr/bin/env bash
# Runs every check CI runs: formatting, lint, types, the documentation site's strict build, then
# the test suite.
# Usage: bash scripts/test.sh [--quick] [PYTEST_ARGS...]
#   --quick  for development: the same checks, but the tests marked `slow` are left out
#            (and so is the soak); CI and the README's test command run everything.
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
# adopts orphans, so none escapes). The quick run uses two workers (pytest-xdist), each test module
# on one of them; the full run keeps one at a time until every test has been shown to hold on two
# workers under load (a race in the stdin channel's flood test showed there).
if [ -n "$quick" ]; then
    uv run --frozen python scripts/no_leftovers.py \
        uv run --frozen pytest -m "not slow" -n 2 --dist loadfile "$@"
    exit
fi
# --warn: the full run names and kills what is left but does not fail on it yet. Its last run on a
# fresh clone left one unsandboxed ipykernel whose gateway was gone (not yet traced to its test; one
# suspect: ipykernel's parent poller, which may wait for init while this subreaper adopts orphans).
uv run --frozen python scripts/no_leftovers.py --warn uv run --frozen pytest "$@"
# The short soak (about 2 minutes) runs with the full suite, not with a chosen subset.
if [ "$#" -eq 0 ]; then
    uv run --frozen python benchmarks/soak.py --duration 120
fi
