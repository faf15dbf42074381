#!/usr/bin/env bash
# Tests the ipybox Docker image end to end: builds it with docker/build.sh (Docker's layer cache
# makes a second run quick), then runs tests/system/test_docker_image.py against it: an MCP session
# through `docker run -i`, files written from code owned by the host user in the mounted
# workspace, plots, MCP servers inside the container, and --sandbox.
#
#   bash scripts/test-docker.sh [PYTEST_ARGS...]
#
# Without a running Docker engine it starts one when it can (as root: installs docker.io and
# starts dockerd, stopped again at the end). Where no engine can be had it prints
# "test-docker: SKIPPED: <reason>" and exits 0. Public images that cannot be pulled are
# replaced by a Debian base built from Debian packages (docker/build-base.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

image="${IPYBOX_TEST_IMAGE:-ipybox-test}"
base="${BASE_IMAGE:-debian:bookworm-slim}"

say() { echo "test-docker: $*"; }
skip() {
    echo "test-docker: SKIPPED: $*"
    exit 0
}

source scripts/_dockerd.sh
trap stop_dockerd EXIT
ensure_dockerd

# The base image: the conventional one if it is here or can be pulled, else one built from
# Debian packages.
if ! docker image inspect "$base" >/dev/null 2>&1 && ! timeout 120 docker pull -q "$base" >/dev/null 2>&1; then
    echo "test-docker: $base cannot be pulled here; building a Debian base from Debian packages"
    if [ "$(id -u)" -ne 0 ] && ! docker image inspect ipybox-base:bookworm >/dev/null 2>&1; then
        skip "$base cannot be pulled, and building a base with debootstrap needs root"
    fi
    bash docker/build-base.sh ipybox-base:bookworm
    base=ipybox-base:bookworm
fi

# The host's extra CA certificates (a TLS-intercepting proxy's) are trusted in the image too.
ca_args=()
for cert in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$cert" ] && ca_args+=(--ca-cert "$cert")
done

# The container user: the caller's ids, or 1000 for root (the image never runs as root).
uid="$(id -u)"
gid="$(id -g)"
if [ "$uid" = 0 ]; then
    uid=1000
    gid=1000
fi

build_log="$(mktemp)"
echo "test-docker: building $image from $base (uid $uid, gid $gid)"
if ! bash docker/build.sh --tag "$image" --base "$base" --uid "$uid" --gid "$gid" ${ca_args[@]+"${ca_args[@]}"} >"$build_log" 2>&1; then
    tail -40 "$build_log"
    rm -f "$build_log"
    echo "test-docker: FAILED: the image did not build"
    exit 1
fi
rm -f "$build_log"

source scripts/_uv.sh
uv sync --frozen --quiet
IPYBOX_DOCKER_IMAGE="$image" IPYBOX_DOCKER_UID="$uid" IPYBOX_DOCKER_GID="$gid" \
    uv run --frozen pytest tests/system/test_docker_image.py -p no:cacheprovider "$@"
