#!/usr/bin/env bash
# Builds a Debian base image from Debian's own packages (debootstrap, then `docker import`),
# for machines that cannot pull public images. The Dockerfile's default base,
# debian:bookworm-slim, is the same distribution, so either base builds the same image.
#
#   docker/build-base.sh [--mirror URL] [--security-mirror URL] [--dry-run] [TAG]
#
# TAG defaults to ipybox-base:bookworm; DEBIAN_SUITE chooses the release (default bookworm).
# The packages come from the Debian mirror this machine's apt already uses (its sources.list,
# sources.list.d/*.list and deb822 *.sources, as apt-config locates them), or from --mirror;
# the security updates likewise from its -security source, or --security-mirror. --dry-run
# prints the mirrors and stops. Needs root (debootstrap) and a running Docker engine. Does
# nothing when TAG exists (set REBUILD=1 to build it again).
set -euo pipefail

SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR=""
SECURITY_MIRROR=""
dry_run=""
TAG="ipybox-base:bookworm"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --mirror) MIRROR="${2:?--mirror needs a URL}"; shift 2 ;;
        --security-mirror) SECURITY_MIRROR="${2:?--security-mirror needs a URL}"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "build-base: unknown option '$1' (see docker/build-base.sh --help)" >&2; exit 2 ;;
        *) TAG="$1"; shift ;;
    esac
done

# "URI SUITE" for every enabled deb source apt is configured with, in one-line and deb822 form.
apt_list=/etc/apt/sources.list
apt_parts=/etc/apt/sources.list.d
if command -v apt-config >/dev/null 2>&1; then
    eval "$(apt-config shell apt_list Dir::Etc::sourcelist/f apt_parts Dir::Etc::sourceparts/d)"
fi
apt_sources() {
    local list="$apt_list" parts="${apt_parts%/}" one_line=() deb822=()
    [ -f "$list" ] && one_line+=("$list")
    for file in "$parts"/*.list; do [ -f "$file" ] && one_line+=("$file"); done
    for file in "$parts"/*.sources; do [ -f "$file" ] && deb822+=("$file"); done
    if [ "${#one_line[@]}" -gt 0 ]; then
        awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ } print $i, $(i + 1) }' \
            "${one_line[@]}"
    fi
    if [ "${#deb822[@]}" -gt 0 ]; then
        awk '
            function flush(   n, m, i, j, u, s) {
                if (types ~ /(^| )deb( |$)/ && enabled != "no") {
                    n = split(uris, u, " "); m = split(suites, s, " ")
                    for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) print u[i], s[j]
                }
                types = uris = suites = enabled = ""
            }
            FNR == 1 && NR > 1 { flush() }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                key = tolower(substr($0, 1, index($0, ":") - 1)); value = substr($0, index($0, ":") + 1)
                gsub(/^[ \t]+|[ \t]+$/, "", value)
                if (key == "types") types = value; else if (key == "uris") uris = value
                else if (key == "suites") suites = value; else if (key == "enabled") enabled = tolower(value)
            }
            END { flush() }' "${deb822[@]}"
    fi
}

# The machine's own Debian release: its sources for that suite are Debian mirrors, which serve
# every release. Other suites (an Ubuntu machine's) only count when they are SUITE itself.
codename=""
if [ -r /etc/os-release ] && [ "$(. /etc/os-release && echo "${ID:-}")" = debian ]; then
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
fi
sources="$(apt_sources | awk '$1 ~ /^(https?|ftp|file):\/\// { sub(/\/+$/, "", $1); print $1, $2 }')"
pick() {
    printf '%s\n' "$sources" | awk -v a="$1" -v b="$2" '$2 != "" && ($2 == a || $2 == b) { print $1; exit }'
}
if [ -z "$MIRROR" ]; then
    MIRROR="$(pick "$SUITE" "${codename:-$SUITE}")"
fi
if [ -z "$MIRROR" ]; then
    echo "build-base: this machine's apt configuration names no Debian mirror for '$SUITE'" \
        "(looked in $apt_list, ${apt_parts%/}/*.list and *.sources). Give one: docker/build-base.sh --mirror URL" >&2
    exit 2
fi
if [ -z "$SECURITY_MIRROR" ]; then
    SECURITY_MIRROR="$(pick "$SUITE-security" "${codename:-$SUITE}-security")"
fi
echo "build-base: mirror $MIRROR"
if [ -n "$SECURITY_MIRROR" ]; then
    echo "build-base: security mirror $SECURITY_MIRROR"
else
    echo "build-base: no security mirror in this machine's apt configuration: the image gets no" \
        "$SUITE-security updates (give one with --security-mirror URL)" >&2
fi
[ -z "$dry_run" ] || exit 0

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
{
    echo "deb $MIRROR $SUITE main"
    echo "deb $MIRROR $SUITE-updates main"
    [ -z "$SECURITY_MIRROR" ] || echo "deb $SECURITY_MIRROR $SUITE-security main"
} >"$rootfs/etc/apt/sources.list"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb

tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
echo "build-base: built $TAG"
