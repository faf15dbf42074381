# Sourced by every script: makes `uv` callable, installing it on a fresh machine.
# pip puts a --user install in ~/.local/bin, which is often not on PATH yet.
export PATH="$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv
fi
