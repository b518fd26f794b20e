#!/usr/bin/env bash
# FA3, SGLang's default attention backend on Hopper, for a network-less GPU host: sglang-kernel 0.4.4's
# flash_ops library (1.8 GB, left out of fetch_parts.sh's bundle) xz-compressed into parts of PART_MB (default
# 52). Send them into the same STASH as the bundle's parts; install_stack.sh puts the library in place
# (FA3_SHA256=$(cat DIR/fa3.sha256) checks it) and engines started with engine.attention_backend=fa3 can use it.
# Compressing takes minutes on a small machine.
# Usage: scripts/gpu/fetch_fa3.sh DIR        -> DIR/fa3/fa3.aa, fa3.ab, ... and DIR/fa3.sha256
set -euo pipefail
D=${1:?usage: fetch_fa3.sh DIR}
PART_MB=${PART_MB:-52}  # a part and the repository's tree together fit a 64 MiB transfer
PY=${PYTHON:-python3}
mkdir -p "$D/fa3-k" "$D/fa3"
rm -f "$D"/fa3/fa3.*
"$PY" -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux2014_x86_64 -d "$D/fa3-k" sglang-kernel==0.4.4
unzip -p "$D"/fa3-k/sglang_kernel-0.4.4-*.whl sgl_kernel/flash_ops.abi3.so | xz -T0 -6 > "$D/fa3.xz"
split -b "${PART_MB}m" "$D/fa3.xz" "$D/fa3/fa3."
sha256sum "$D/fa3.xz" | cut -d' ' -f1 > "$D/fa3.sha256"
rm -rf "$D/fa3-k" "$D/fa3.xz"
echo "[fetch] $(ls "$D/fa3" | wc -l) FA3 parts in $D/fa3 ($(du -sh "$D/fa3" | cut -f1)), sha256 $(cat "$D/fa3.sha256")"
