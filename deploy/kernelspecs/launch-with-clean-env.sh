#!/usr/bin/env bash
# Runs a gateway's container launcher (EG's or gateway-provisioners' launch_docker.py) with only
# the environment variables a kernel container may see.
#
#   launch-with-clean-env.sh PYTHON LAUNCHER [ARGS...]
#
# Both launchers copy their whole environment into the kernel container. Enterprise Gateway 3.3 and
# Kernel Gateway 3 already start them with only PATH, the KERNEL_* variables of the request and what
# the operator lets through (EG_INHERITED_ENVS, KG's env_process_whitelist): checked, the gateway's
# token does not reach the container without this wrapper either. The wrapper makes that hold
# whatever the gateway's configuration lets through (its token, cloud credentials): code in the
# kernel is hostile, and with the token it could open every other session's kernel through the
# gateway's API. So only these pass: PATH (the launcher drops it from the container),
# KERNEL_* (what the gateway and the client set for this kernel: id, image, uid, username, ...),
# the launchers' own (EG_/GP_) DOCKER_NETWORK, DOCKER_MODE and REMOVE_CONTAINER, and the Docker
# client's DOCKER_HOST, DOCKER_TLS_VERIFY and DOCKER_CERT_PATH (paths and flags, no secrets).
set -euo pipefail
[ "$#" -ge 2 ] || { echo "usage: launch-with-clean-env.sh PYTHON LAUNCHER [ARGS...]" >&2; exit 2; }
keep=("PATH=$PATH")
for name in $(compgen -e); do
    case "$name" in
        KERNEL_* | EG_DOCKER_NETWORK | EG_DOCKER_MODE | EG_REMOVE_CONTAINER \
            | GP_DOCKER_NETWORK | GP_DOCKER_MODE | GP_REMOVE_CONTAINER \
            | DOCKER_NETWORK | DOCKER_HOST | DOCKER_TLS_VERIFY | DOCKER_CERT_PATH)
            keep+=("$name=${!name}") ;;
    esac
done
# gateway-provisioners 0.5 passes the network as GP_DOCKER_NETWORK, but its launch_docker.py reads
# DOCKER_NETWORK or EG_DOCKER_NETWORK (else it takes Docker's default "bridge", a network with a
# route out): name it the way the launcher reads it.
if [ -n "${GP_DOCKER_NETWORK:-}" ] && [ -z "${DOCKER_NETWORK:-}" ]; then
    keep+=("DOCKER_NETWORK=$GP_DOCKER_NETWORK")
fi
exec env -i "${keep[@]}" "$@"
