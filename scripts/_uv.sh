# Sourced by every script: makes `uv` callable, installing it on a fresh machine.
# pip puts a --user install in ~/.local/bin, which is often not on PATH yet.
export PATH="$HOME/.local/bin:$PATH"
if ! command -v uv >/dev/null 2>&1; then
    # Debian 12 / Ubuntu 24.04 system Pythons refuse plain pip installs (PEP 668); uv is one
    # self-contained binary in ~/.local/bin, so --break-system-packages is safe for it.
    python3 -m pip install --quiet --user uv 2>/dev/null \
        || python3 -m pip install --quiet uv 2>/dev/null \
        || python3 -m pip install --quiet --user --break-system-packages uv 2>/dev/null \
        || {
            echo "Could not install uv with pip. Install it (https://docs.astral.sh/uv/getting-started/installation/," \
                "e.g. 'pipx install uv'), then run this command again." >&2
            exit 1
        }
fi
