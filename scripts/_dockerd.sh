# Sourced by the scripts that need a Docker engine (test-docker.sh, test-remote-docker.sh): starts
# one when none is reachable and it can (as root: installs docker.io, starts dockerd), and stops
# what it started when the script exits. The caller defines `say MESSAGE` and `skip REASON` (which
# prints "<script>: SKIPPED: <reason>" and exits 0).

started_dockerd=""
dockerd_log=""

stop_dockerd() {
    if [ -n "$started_dockerd" ]; then
        kill "$started_dockerd" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$started_dockerd" 2>/dev/null || break
            sleep 1
        done
        rm -f "$dockerd_log"
    fi
}

ensure_dockerd() {
    docker info >/dev/null 2>&1 && return
    [ "$(id -u)" -eq 0 ] || skip "no Docker engine is reachable, and starting one needs root"
    if ! command -v dockerd >/dev/null 2>&1; then
        say "installing docker.io"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null 2>&1; } \
            || skip "docker.io could not be installed with apt-get"
    fi
    command -v docker >/dev/null 2>&1 || skip "the docker client is missing after installing docker.io"
    dockerd_log="$(mktemp)"
    say "starting dockerd"
    dockerd >"$dockerd_log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$started_dockerd" 2>/dev/null || break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        reason="$(grep -m1 -iE 'failed|error' "$dockerd_log" || tail -1 "$dockerd_log")"
        skip "dockerd could not be started here: $reason"
    fi
}
