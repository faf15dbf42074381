#!/bin/sh
# Runs the ipybox MCP server on stdio, on the workspace mounted at /app/workspace.
# Arguments are passed on to `ipybox` (for example --sandbox, --log-level DEBUG).
set -eu
workspace=/app/workspace
if [ ! -w "$workspace" ]; then
    echo "ipybox: $workspace is not writable by uid $(id -u) gid $(id -g). Mount a folder that" \
        "this user owns (docker/build.sh builds the image with your own UID/GID)." >&2
    exit 1
fi

sandbox=""
for arg in "$@"; do
    case "$arg" in
        --sandbox | --sandbox-config | --sandbox-config=*) sandbox=1 ;;
    esac
done
if [ -n "$sandbox" ]; then
    # bubblewrap, which the sandbox runtime uses, needs namespaces that Docker's defaults refuse:
    # say so at once instead of failing on the first cell.
    if ! problem="$(bwrap --ro-bind / / --dev /dev --proc /proc --unshare-all --die-with-parent true 2>&1)"; then
        echo "ipybox: --sandbox cannot work in this container: bubblewrap says: $problem" >&2
        echo "ipybox: start the container with --security-opt seccomp=unconfined" \
            "--security-opt systempaths=unconfined (before the image name), or leave out --sandbox." >&2
        exit 1
    fi
    # A sandbox-config.json in the workspace is used when no --sandbox-config is given.
    case " $* " in
        *" --sandbox-config"*) ;;
        *) [ -s "$workspace/sandbox-config.json" ] && set -- "$@" --sandbox-config "$workspace/sandbox-config.json" ;;
    esac
fi
exec ipybox --workspace "$workspace" "$@"
