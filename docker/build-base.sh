#!/usr/bin/env bash
# Builds a Debian base image from Debian's own packages (debootstrap, then `docker import`),
# for machines that cannot pull public images. The Dockerfile's default base,
# debian:bookworm-slim, is the same distribution, so either base builds the same image.
#
#   docker/build-base.sh [TAG]          # default TAG: ipybox-base:bookworm
#
# Needs root (debootstrap) and a running Docker engine. Does nothing when TAG exists
# (set REBUILD=1 to build it again). DEBIAN_SUITE and DEBIAN_MIRROR choose the release
# and the package mirror.
set -euo pipefail

TAG="${1:-ipybox-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if [ -z "${REBUILD:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "build-base: $TAG already exists (REBUILD=1 builds it again)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "build-base: debootstrap needs root; run this script as root (or with sudo)" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
fi

rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT

echo "build-base: debootstrap $SUITE from $MIRROR (a few minutes)"
debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
    tail -20 "$rootfs.log" >&2
    echo "build-base: debootstrap failed (full log: $rootfs.log)" >&2
    exit 1
}
rm -f "$rootfs.log"

# The updates and security suites too, as in Debian's own images; no package lists or
# downloaded packages are kept (the Dockerfile runs apt-get update itself).
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} $SUITE-security main
SOURCES
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb

tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
echo "build-base: built $TAG"
