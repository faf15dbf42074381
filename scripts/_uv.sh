# Sourced by every script: makes `uv` callable, installing it on a fresh machine.
# pip puts a --user install in ~/.local/bin, which is often not on PATH yet.
caller_path="$PATH"
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

# Says so when uv's folder is not on the caller's PATH: the scripts find uv there, but an MCP
# client (Claude Code) that starts "uvx" only looks on its own PATH.
uv_path_note() {
    local folder
    folder=$(dirname "$(command -v uv)")
    case ":$caller_path:" in
        *":$folder:"*) ;;
        *) echo "note: uv and uvx are in $folder, which is not on your PATH. MCP configurations" \
            "that run \"uvx\" need it there: export PATH=\"$folder:\$PATH\" (add the line to your" \
            "shell's start-up file, e.g. ~/.bashrc)." >&2 ;;
    esac
}
