#!/usr/bin/env bash
# `make image`: the CPU image, from a clean checkout, with podman and package registries only.
#
#   docker/build_image.sh [TAG]        # default mrl:<version>-cpu (localhost/mrl:0.1.0-cpu)
#
# 1. the base (docker/build_base.sh: debootstrap bookworm + CPython 3.12), unless it exists already
#    (MRL_IMAGE_REBUILD_BASE=1 rebuilds it);
# 2. docker/Dockerfile.cpu on it: pyproject.toml's stack, mrl, the CUDA driver stub of SGLang's CPU mode, and
#    docker/verify_image.py --cpu as the last step (a pin or import that disagrees fails the build);
# 3. build/image/<tag>.json: the phases' seconds, the image's size, its Python packages (bench/image_build.py
#    turns it into a report).
# Needs root, podman, buildah, runc and debootstrap (apt-get install podman buildah runc debootstrap).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
TAG=${1:-localhost/mrl:$VERSION-cpu}
BASE=${MRL_IMAGE_BASE:-localhost/mrl-base:bookworm-py3.12}
WORK=${MRL_IMAGE_WORK:-$ROOT/build/image}
export PODMAN=${PODMAN:-$ROOT/docker/podman.sh}
log() { echo "[image $(date +%H:%M:%S)] $*"; }
missing=()
for bin in podman buildah runc debootstrap; do command -v "$bin" >/dev/null || missing+=("$bin"); done
if (( ${#missing[@]} )); then
  echo "build_image.sh: missing ${missing[*]} (as root: apt-get install -y podman buildah runc debootstrap)" >&2
  exit 1
fi
mkdir -p "$WORK"

t0=$(date +%s)
if [[ ${MRL_IMAGE_REBUILD_BASE:-0} == 1 ]] || ! "$PODMAN" image exists "$BASE"; then
  bash "$ROOT/docker/build_base.sh" "$BASE"
  base_s=$(( $(date +%s) - t0 ))
else
  log "base $BASE exists (MRL_IMAGE_REBUILD_BASE=1 rebuilds it)"
  base_s=null
fi

# Behind a TLS-inspecting proxy pip needs the proxy's CA: the host's bundle (PIP_CERT or SSL_CERT_FILE) is
# mounted for the build steps only and never stored in the image.
ca=()
host_ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
if [[ -n $host_ca && -f $host_ca ]]; then
  ca=(--volume "$host_ca:/run/mrl-build-ca.crt:ro" --build-arg PIP_CERT=/run/mrl-build-ca.crt)
fi
log "podman build -f docker/Dockerfile.cpu -> $TAG"
t1=$(date +%s)
"$PODMAN" build --network host --layers -f docker/Dockerfile.cpu --build-arg BASE_IMAGE="$BASE" "${ca[@]}" \
  -t "$TAG" . 2>&1 | tee "$WORK/build.log"
build_s=$(( $(date +%s) - t1 ))
# layers of earlier builds that no tag uses any more (a changed pyproject.toml leaves 12 GB behind); the
# cached layers of this build stay
"$PODMAN" image prune -f --filter label=mrl.image=cpu >/dev/null

size=$("$PODMAN" image inspect --format '{{.Size}}' "$TAG")
safe=$(echo "$TAG" | tr '/:' '__')
"$PODMAN" run --rm --network none "$TAG" python -m pip list --format=json > "$WORK/$safe.packages.json"
cat > "$WORK/$safe.json" <<EOF
{"tag": "$TAG", "base": "$BASE", "base_seconds": $base_s, "build_seconds": $build_s,
 "total_seconds": $(( $(date +%s) - t0 )), "size_bytes": $size,
 "image_id": "$("$PODMAN" image inspect --format '{{.Id}}' "$TAG")",
 "commit": "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)",
 "python": "$("$PODMAN" run --rm --network none "$TAG" python -c 'import platform; print(platform.python_version())')",
 "podman": "$(podman --version | awk '{print $3}')", "packages_file": "$safe.packages.json"}
EOF
log "built $TAG: $(( size / 1000000 )) MB in $(( $(date +%s) - t0 ))s (base: ${base_s}s, null = reused; Dockerfile.cpu: ${build_s}s); record $WORK/$safe.json"
