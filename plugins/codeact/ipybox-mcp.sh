#!/usr/bin/env bash
# Starts the ipybox MCP server (stdio) for the codeact plugins of this repository's marketplace.
#
#   plugins/codeact/ipybox-mcp.sh default|sandbox|docker
#
# default  ipybox without a sandbox (code runs as you)
# sandbox  ipybox --sandbox, with the sandbox settings of IPYBOX_SANDBOX_CONFIG (a file outside the
#          workspace), else of sandbox-config.json beside this script when it exists, else the
#          defaults. Never a file in the workspace: the kernel (or an earlier run without the
#          sandbox) can write there, and could loosen its own sandbox for the next start.
# docker   the ipybox image (IPYBOX_IMAGE, default "ipybox"; build it with docker/build.sh)
#
# The workspace is IPYBOX_WORKSPACE, else the Claude Code project (CLAUDE_PROJECT_DIR), else the
# current folder. ipybox runs with its locked dependencies (uv run) from the plugin's ipybox/
# folder: what building ipybox needs and nothing else (Claude Code copies the plugin folder when
# it installs the plugin). In a clone those files are links into the repository, and ipybox runs
# from the clone itself, with its .venv. IPYBOX_COMMAND replaces that command (for example
# "/path/to/ipybox/.venv/bin/ipybox").
# Everything this script says goes to stderr: stdout belongs to the MCP protocol.
set -euo pipefail

mode="${1:-default}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/ipybox"
if [ -L "$root/pyproject.toml" ]; then
    root="$(cd "$here/../.." && pwd)"
fi
workspace="${IPYBOX_WORKSPACE:-${CLAUDE_PROJECT_DIR:-$PWD}}"

fail() {
    echo "ipybox-mcp: $*" >&2
    exit 1
}

[ -d "$workspace" ] || fail "the workspace '$workspace' is not a folder: set IPYBOX_WORKSPACE to an existing folder"

ipybox_command() {
    if [ -n "${IPYBOX_COMMAND:-}" ]; then
        read -r -a cmd <<<"$IPYBOX_COMMAND"
        return
    fi
    export PATH="$HOME/.local/bin:$HOME/.cargo/bin:$PATH"
    command -v uv >/dev/null 2>&1 || fail "uv is not installed: install it (https://docs.astral.sh/uv/), or set IPYBOX_COMMAND to a command that runs ipybox"
    cmd=(uv run --quiet --frozen --no-dev --project "$root" ipybox)
}

case "$mode" in
    default)
        ipybox_command
        exec "${cmd[@]}" --workspace "$workspace"
        ;;
    sandbox)
        ipybox_command
        # srt at the version ipybox is tested with, installed into this checkout once (as
        # scripts/setup.sh does in a clone); npm's output goes to stderr.
        srt_dir="$root/scripts/srt"
        if [ -z "${IPYBOX_COMMAND:-}" ] && [ -z "${IPYBOX_SRT:-}" ] && ! command -v srt >/dev/null 2>&1 \
            && [ -f "$srt_dir/package.json" ] && [ ! -e "$srt_dir/node_modules/.bin/srt" ]; then
            command -v npm >/dev/null 2>&1 || fail "the sandbox needs srt, which is installed with npm: install Node.js and npm, or use the codeact-default plugin"
            (cd "$srt_dir" && npm ci --silent --no-audit --no-fund) >&2 || fail "npm ci in $srt_dir failed (see above)"
        fi
        args=(--workspace "$workspace" --sandbox)
        config="${IPYBOX_SANDBOX_CONFIG:-}"
        if [ -z "$config" ] && [ -f "$here/sandbox-config.json" ]; then
            config="$here/sandbox-config.json"
        fi
        if [ -n "$config" ]; then
            # ipybox refuses a settings file inside the workspace, with the reason.
            args+=(--sandbox-config "$config")
        elif [ -s "$workspace/sandbox-config.json" ]; then
            # -s: a running sandboxed kernel keeps an empty placeholder there (the file is write-protected).
            echo "ipybox-mcp: ignoring $workspace/sandbox-config.json: settings are never read from the" \
                "workspace, which the kernel can write. Move the file outside it and set" \
                "IPYBOX_SANDBOX_CONFIG to its path, or put it beside $here/ipybox-mcp.sh." >&2
        fi
        exec "${cmd[@]}" "${args[@]}"
        ;;
    docker)
        image="${IPYBOX_IMAGE:-ipybox}"
        command -v docker >/dev/null 2>&1 || fail "docker is not installed; use the codeact-default or codeact-sandbox plugin instead"
        # Without an engine, `docker image inspect` fails as if the image were missing.
        problem="$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)" \
            || fail "no Docker engine answers (docker says: ${problem:-nothing}). Start Docker (Docker Desktop, or 'sudo systemctl start docker'), or point DOCKER_HOST at a running engine, then restart this MCP server"
        docker image inspect "$image" >/dev/null 2>&1 \
            || fail "the Docker image '$image' does not exist: build it once with docker/build.sh in a clone of ipybox"
        # The workspace's configuration that programs on this machine run (git hooks and
        # core.fsmonitor, editor tasks, agents' MCP servers) comes in read-only: the kernel in the
        # container runs as the workspace's owner. The names are ipybox's protected ones
        # (PROTECTED_WORKSPACE_DIRS and _FILES); the image refuses to start while one is writable.
        protected=(.git .vscode .idea .claude .cursor .gemini .roo .amazonq .windsurf .codex .continue .husky .env sandbox-config.json .mcp.json .gitconfig .gitmodules .bashrc .bash_profile .zshrc .zprofile .profile .ripgreprc HEAD .pre-commit-config.yaml lefthook.yml)
        mounts=()
        for name in "${protected[@]}"; do
            if [ -e "$workspace/$name" ] || [ -L "$workspace/$name" ]; then
                mounts+=(--mount "type=bind,src=$workspace/$name,dst=/app/workspace/$name,readonly")
            fi
        done
        exec docker run -i --rm \
            -v "$workspace:/app/workspace" \
            ${mounts[@]+"${mounts[@]}"} \
            -v "${IPYBOX_STATE_VOLUME:-ipybox-state}:/app/state" \
            "$image"
        ;;
    *)
        fail "unknown mode '$mode': use default, sandbox or docker"
        ;;
esac
