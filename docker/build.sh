#!/usr/bin/env bash
# Builds the ipybox Docker image (default tag: ipybox) with your UID/GID as the container user,
# so files ipybox writes in the mounted workspace stay yours.
#
#   docker/build.sh [--tag TAG] [--base IMAGE] [--uid UID] [--gid GID] [--ca-cert FILE]...
#                   [-- DOCKER_BUILD_ARGS...]
#
# --base defaults to debian:bookworm-slim; where public images cannot be pulled, build a base
# from Debian packages with docker/build-base.sh and pass --base ipybox-base:bookworm.
# As root, the container user gets UID/GID 1000 unless --uid/--gid say otherwise (the image
# never runs ipybox as root). --ca-cert adds a CA certificate (PEM) that the image trusts, for
# networks whose TLS-intercepting proxy the package registries are reached through.
set -euo pipefail
cd "$(dirname "$0")/.."

tag="${IPYBOX_IMAGE:-ipybox}"
base="${BASE_IMAGE:-debian:bookworm-slim}"
uid="$(id -u)"
gid="$(id -g)"
if [ "$uid" = 0 ]; then
    uid=1000
    gid=1000
fi
ca_certs=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --tag) tag="$2"; shift 2 ;;
        --base) base="$2"; shift 2 ;;
        --uid) uid="$2"; shift 2 ;;
        --gid) gid="$2"; shift 2 ;;
        --ca-cert) ca_certs+=("$2"); shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: unknown option '$1' (see docker/build.sh --help)" >&2; exit 2 ;;
    esac
done

command -v docker >/dev/null 2>&1 || { echo "build.sh: docker is not installed" >&2; exit 1; }
problem="$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)" || {
    echo "build.sh: no Docker engine answers (docker says: ${problem:-nothing}). Start Docker" \
        "(Docker Desktop, or 'sudo systemctl start docker'), or point DOCKER_HOST at a running engine." >&2
    exit 1
}

# The certificates go through the build context; the folder is emptied again afterwards.
certs_dir=docker/ca-certificates
find "$certs_dir" -name '*.crt' -delete
trap 'find "$certs_dir" -name "*.crt" -delete' EXIT
for cert in ${ca_certs[@]+"${ca_certs[@]}"}; do
    [ -f "$cert" ] || { echo "build.sh: CA certificate '$cert' not found" >&2; exit 2; }
    cp "$cert" "$certs_dir/extra-$(basename "${cert%.*}").crt"
done

echo "build.sh: building $tag from $base for uid $uid gid $gid"
docker build -f docker/Dockerfile \
    --build-arg "BASE_IMAGE=$base" \
    --build-arg "UID=$uid" \
    --build-arg "GID=$gid" \
    --force-rm -t "$tag" "$@" .
