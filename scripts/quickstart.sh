#!/usr/bin/env bash
# The README's main job: runs the quickstart example offline. Pass --yes to approve every tool call.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_uv.sh
uv run --frozen python examples/quickstart.py "$@"
