#!/usr/bin/env bash
# The soak: one CodeExecutor under an agent mix, memory and descriptors watched.
# Default 2 minutes (what CI runs); the published figures come from
#   bash scripts/soak.sh --duration 3600 --json benchmarks/soak-1h.json --plot benchmarks/soak-1h.png
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_uv.sh
uv run --frozen python benchmarks/soak.py "$@"
