#!/usr/bin/env bash
# Installs what ipybox needs on a fresh machine: uv, then the locked Python environment.
# Safe to run again; README commands and .ci/run both call it.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_uv.sh
# Precompiled bytecode: where PYTHONDONTWRITEBYTECODE is set, every process would
# otherwise compile its imports from source again (about 1 s more per gateway start).
uv sync --frozen --quiet --compile-bytecode

# The sandbox (sandbox=True): srt at the version pinned in scripts/srt, and on Linux the
# programs it runs. Where they cannot be installed, say so: the sandbox tests then skip
# with the reason (and fail on CI, where CI is set).
warn() { echo "warning: $*; sandbox=True will not start here (the sandbox tests skip)." >&2; }
pinned=$(sed -n 's/.*"@anthropic-ai\/sandbox-runtime": "\(.*\)".*/\1/p' scripts/srt/package.json)
installed=$(sed -n 's/^  "version": "\(.*\)",$/\1/p' \
    scripts/srt/node_modules/@anthropic-ai/sandbox-runtime/package.json 2>/dev/null || true)
if [ "$installed" != "$pinned" ]; then
    if command -v npm >/dev/null; then
        (cd scripts/srt && npm ci --silent --no-audit --no-fund) || warn "npm ci in scripts/srt failed"
    else
        warn "npm is not installed, so srt (@anthropic-ai/sandbox-runtime $pinned) cannot be"
    fi
fi
if [ "$(uname -s)" = Linux ]; then
    missing=""
    for tool in bwrap:bubblewrap socat:socat rg:ripgrep; do
        command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
    done
    if [ -n "$missing" ]; then
        if [ "$(id -u)" = 0 ]; then
            sudo=""
        elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            sudo="none"
        fi
        if [ "$sudo" = none ]; then
            warn "missing$missing; install with: sudo apt-get install$missing"
        elif ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing; } >/dev/null; then
            warn "apt-get install$missing failed"
        fi
    fi
fi
uv_path_note
