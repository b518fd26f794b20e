#!/usr/bin/env bash
# podman with docker/containers.conf (runc, no default ulimits) unless CONTAINERS_CONF names another file.
# Every podman call of the image scripts and tests goes through here.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/containers.conf}
exec podman "$@"
