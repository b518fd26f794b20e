#!/usr/bin/env bash
# The CPU image's base, built from package registries only: a Debian bookworm root filesystem (debootstrap)
# with a self-contained CPython 3.12 in /usr/local (the layout of the official python:3.12-slim-bookworm
# image), imported as a local image. No container registry is contacted.
#
#   docker/build_base.sh [TAG]          # default localhost/mrl-base:bookworm-py3.12; needs root
#
# Why not a distribution's Python: Debian has none at 3.12 (bookworm 3.11, trixie 3.13), and the stack is
# pinned and tested on 3.12 (SGLang's release images run 3.12 too). The interpreter is copied from a
# self-contained 3.12 prefix on this machine, the one scripts/setup_env.sh builds the virtualenv with
# (pyenv's 3.12, or MRL_IMAGE_PYTHON=/path/to/bin/python3.12 from `uv python install 3.12`, a
# `./configure --enable-shared` build, ...). It was compiled against the bookworm libraries this root
# filesystem installs, which is why the base is bookworm.
#
# Environment: MRL_IMAGE_MIRROR (Debian mirror, default http://deb.debian.org/debian), MRL_IMAGE_PYTHON,
# MRL_IMAGE_WORK (scratch folder, default build/image), PODMAN (default docker/podman.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG=${1:-localhost/mrl-base:bookworm-py3.12}
MIRROR=${MRL_IMAGE_MIRROR:-http://deb.debian.org/debian}
WORK=${MRL_IMAGE_WORK:-$ROOT/build/image}
PODMAN=${PODMAN:-$ROOT/docker/podman.sh}
log() { echo "[image-base $(date +%H:%M:%S)] $*"; }
die() { echo "build_base.sh: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "debootstrap and the chroot steps need root"
command -v debootstrap >/dev/null || die "debootstrap missing (apt-get install debootstrap podman buildah runc)"

# The interpreter: the same search as scripts/setup_env.sh
PY=${MRL_IMAGE_PYTHON:-}
if [[ -z $PY ]] && command -v pyenv >/dev/null 2>&1; then
  v="$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | sort -V | tail -1 || true)"
  [[ -n $v ]] && PY="$(pyenv root)/versions/$v/bin/python3.12"
fi
[[ -z $PY ]] && PY="$(command -v python3.12 || true)"
[[ -n $PY && -x $PY ]] || die "no Python 3.12 found (pyenv install 3.12, or set MRL_IMAGE_PYTHON=/path/to/bin/python3.12)"
PREFIX="$("$PY" -c 'import sys; print(sys.base_prefix)')"
PYVER="$("$PY" -c 'import platform; print(platform.python_version())')"
[[ $PYVER == 3.12.* ]] || die "$PY is Python $PYVER, not 3.12"
[[ $PREFIX != /usr && -f $PREFIX/lib/libpython3.12.so.1.0 ]] || \
  die "$PY ($PREFIX) is not a self-contained --enable-shared prefix (a distribution's /usr Python cannot be copied)"

RFS=$WORK/rootfs
rm -rf "$RFS"
mkdir -p "$WORK"
# What CPython's extension modules link against (ssl, sqlite3, ctypes, lzma, bz2, readline, uuid, ...), plus
# gcc for SGLang's CPU mode (mrl compiles a CUDA driver stub at setup) and the CA certificates pip needs.
PKGS=ca-certificates,libssl3,libffi8,libsqlite3-0,liblzma5,libbz2-1.0,zlib1g,libreadline8,libncursesw6,libuuid1
PKGS=$PKGS,libexpat1,libgdbm6,libnsl2,libtirpc3,libcrypt1,gcc,libc6-dev,procps,netbase
log "debootstrap bookworm ($MIRROR) -> $RFS"
debootstrap --variant=minbase --include="$PKGS" bookworm "$RFS" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 || {
  tail -30 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log: $WORK/debootstrap.log)"; }

log "Python $PYVER from $PREFIX -> /usr/local"
# the standard library and headers, without the prefix's own site-packages (its pip comes from ensurepip
# below) and without the test suite and Tk
tar -C "$PREFIX" -cf - --exclude='lib/python3.12/site-packages/*' --exclude='lib/python3.12/test' \
    --exclude='lib/python3.12/idlelib' --exclude='lib/python3.12/tkinter' --exclude='lib/python3.12/turtledemo' \
    --exclude='__pycache__' --exclude='bin/pip*' --exclude='bin/idle*' bin include lib | tar -C "$RFS/usr/local" -xf -
# scripts of the prefix name its interpreter by the old path
for f in "$RFS"/usr/local/bin/*; do
  [[ -f $f && ! -L $f ]] && head -c2 "$f" | grep -q '#!' && sed -i "1s|^#!.*python.*|#!/usr/local/bin/python3.12|" "$f"
done
ln -sf python3.12 "$RFS/usr/local/bin/python3"
ln -sf python3.12 "$RFS/usr/local/bin/python"
cat > "$RFS/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
EOF
chroot "$RFS" /sbin/ldconfig
chroot "$RFS" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin /usr/local/bin/python3.12 -m ensurepip --default-pip \
  > "$WORK/ensurepip.log" 2>&1 || { cat "$WORK/ensurepip.log" >&2; die "ensurepip failed in the root filesystem"; }
ln -sf pip3 "$RFS/usr/local/bin/pip"
chroot "$RFS" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin python -c \
  'import ssl, sqlite3, ctypes, lzma, bz2, zlib, readline, uuid, hashlib; print("stdlib ok")' \
  || die "the copied interpreter does not run in the bookworm root (built against newer libraries than bookworm's glibc 2.36 / OpenSSL 3.0?)"
rm -rf "$RFS"/var/cache/apt/archives/*.deb "$RFS"/var/lib/apt/lists/* "$RFS"/tmp/* "$RFS"/root/.cache

log "podman import -> $TAG"
tar --numeric-owner -C "$RFS" -cf "$WORK/rootfs.tar" .
"$PODMAN" import -q \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
  --message "debian bookworm (debootstrap) + CPython $PYVER in /usr/local" \
  "$WORK/rootfs.tar" "$TAG" >/dev/null
rm -rf "$RFS" "$WORK/rootfs.tar"
log "done: $TAG ($("$PODMAN" image inspect --format '{{.Size}}' "$TAG") bytes)"
