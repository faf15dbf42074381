#!/usr/bin/env bash
# Benchmark ipybox beside the reference ipybox 0.7.1: sets up the reference environment
# once, then runs every figure (or those given with --only), e.g. `bash scripts/bench.sh --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_uv.sh
bash benchmarks/setup_reference.sh
uv run python benchmarks/run.py "$@"
