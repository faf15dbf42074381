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
    # Custom settings come from a file mounted read-only at /app/config/sandbox-config.json (or an
    # explicit --sandbox-config outside the workspace), never from the workspace, which the kernel
    # (or an earlier run without --sandbox) can write.
    case " $* " in
        *" --sandbox-config"*) ;;
        *) [ -s /app/config/sandbox-config.json ] && set -- "$@" --sandbox-config /app/config/sandbox-config.json ;;
    esac
    if [ -s "$workspace/sandbox-config.json" ]; then
        echo "ipybox: ignoring the workspace's sandbox-config.json (settings are never read from the" \
            "workspace); mount it read-only at /app/config/sandbox-config.json instead." >&2
    fi
fi
if [ -z "$sandbox" ]; then
    # Without the sandbox the kernel can write everything the container user can: the workspace's
    # .git, editor and agent settings must come in read-only (the check names each one that does
    # not, with the option to add). -I: nothing is imported from the workspace.
    (cd / && /app/.venv/bin/python -I -m ipybox.app.sandbox._container "$workspace") || exit 1
fi
exec ipybox --workspace "$workspace" "$@"
