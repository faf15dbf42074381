#!/usr/bin/env bash
# Creates (once) the reference environment the benchmark measures against:
# ipybox 0.7.1 from PyPI with mcp<2, in its own virtual environment under .bench/ref.
# Safe to run again: an environment that already imports the pinned version is kept.
set -euo pipefail

cd "$(dirname "$0")/.."
source scripts/_uv.sh
REF=.bench/ref
PY="$REF/bin/python"
WANT=0.7.1
# The first_plot figure needs matplotlib on both sides, at the version the project locks.
MPL=$(sed -n '/^name = "matplotlib"$/{n;s/^version = "\(.*\)"/\1/p}' uv.lock)

if [ -x "$PY" ] && "$PY" - "$WANT" "$MPL" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
import psutil  # noqa: F401  (the memory figure needs it on this side too)
sys.exit(0 if version("ipybox") == sys.argv[1] and version("matplotlib") == sys.argv[2] else 1)
PYEOF
    # An environment made before bytecode was precompiled gets it now; up-to-date files
    # are skipped, so this costs about a second.
    "$PY" -m compileall -q -j 0 "$REF/lib" >/dev/null
    echo "reference environment ready: $REF (ipybox $WANT)"
    exit 0
fi

echo "creating the reference environment in $REF (ipybox==$WANT, mcp<2, matplotlib==$MPL)"
uv venv --quiet --allow-existing --python 3.11 "$REF"
# Bytecode precompiled as for our side (scripts/setup.sh), so both start equally fast
# where PYTHONDONTWRITEBYTECODE is set.
uv pip install --quiet --compile-bytecode --python "$PY" "ipybox==$WANT" "mcp<2" psutil "matplotlib==$MPL"
"$PY" -c "from importlib.metadata import version; print('reference ipybox', version('ipybox'), 'mcp', version('mcp'))"
