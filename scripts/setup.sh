#!/usr/bin/env bash
# Installs what ipybox needs on a fresh machine: uv, then the locked Python environment.
# Safe to run again; README commands and .ci/run both call it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
    export PATH="$HOME/.local/bin:$PATH"
fi
# Precompiled bytecode: where PYTHONDONTWRITEBYTECODE is set, every process would
# otherwise compile its imports from source again (about 1 s more per gateway start).
uv sync --frozen --quiet --compile-bytecode
