#!/usr/bin/env bash
# Installs what ipybox needs on a fresh machine: uv, then the locked Python environment.
# Safe to run again; README commands and .ci/run both call it.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_uv.sh
# Precompiled bytecode: where PYTHONDONTWRITEBYTECODE is set, every process would
# otherwise compile its imports from source again (about 1 s more per gateway start).
uv sync --frozen --quiet --compile-bytecode
