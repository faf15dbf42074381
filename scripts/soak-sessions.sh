#!/usr/bin/env bash
# The sessions soak: one `ipybox --transport streamable-http --pool N` server, many concurrent MCP
# sessions running cells and tool calls; latency, memory and leftovers watched. Default 50 sessions
# for 10 minutes; the published figures come from
#   bash scripts/soak-sessions.sh --json benchmarks/soak-sessions-10m.json \
#       --plot benchmarks/soak-sessions-10m.png | tee benchmarks/soak-sessions-10m.txt
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_uv.sh
uv run --frozen python benchmarks/soak_sessions.py "$@"
