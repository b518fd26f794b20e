#!/usr/bin/env bash
# Build, on a machine that reaches the package registry, what a network-less GPU host (Python 3.12,
# torch 2.11.0+cu130 preinstalled) needs for mrl's GPU path, as parts small enough to send one per transfer:
#   - SGLang 0.5.14 and the wheels the host image lacks (sglang-0.5.14-gpu-wheels.txt), plus sglang-kernel
#     0.4.4 without its FA3 library (1.8 GB): engines then use the triton or flashinfer attention backend;
#   - DeepGEMM (sgl-deep-gemm 0.1.3, SGLang's pin), for engines that ask for it only;
#   - megatron-core and the pure-Python packages mrl imports (hydra-core, omegaconf, antlr4, einops);
#   - Transformer Engine 2.20.2 (core library wheel for CUDA 13, meta wheel) unless NO_TE=1. Its torch
#     extension must be built against the host's torch: pass a wheel built there as TE_TORCH_WHEEL, or the
#     sdist is packed as downloaded (fetch_sdist.py: no build, so no torch needed here) and install_stack.sh
#     builds it on the host (about 100 s on 16 cores).
# Needs: python3 with pip, unzip, tar, split, sha256sum, and the package index (pip's, or PIP_INDEX_URL).
# Output: DIR/parts/part.aa, part.ab, ... (PART_MB each, default 52) and DIR/bundle.sha256.
# Usage: scripts/gpu/fetch_parts.sh DIR           (then send the parts: scripts/gpu/README.md)
set -euo pipefail
D=${1:?usage: fetch_parts.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
PART_MB=${PART_MB:-52}  # a part and the repository's tree together fit a 64 MiB transfer
PY=${PYTHON:-python3}
missing=()
for tool in "$PY" unzip tar split sha256sum; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
"$PY" -m pip --version >/dev/null 2>&1 || missing+=("pip for $PY ($PY -m ensurepip, or apt-get install python3-pip)")
if (( ${#missing[@]} )); then
  printf 'fetch_parts.sh: missing on this machine: %s\n' "${missing[@]}" >&2
  exit 1
fi
plat="--python-version 3.12 --implementation cp --only-binary=:all:"
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
         manylinux1_x86_64 any; do plat="$plat --platform $p"; done
rm -rf "$D/b" "$D/k" "$D/parts"
mkdir -p "$D/b/wheels" "$D/b/site_extra" "$D/b/te" "$D/k" "$D/parts"
dl() { "$PY" -m pip download -q --no-deps $plat -d "$@"; }

echo "[fetch] SGLang 0.5.14 and its wheels"
dl "$D/b/wheels" -r "$here/sglang-0.5.14-gpu-wheels.txt"
dl "$D/k" sglang-kernel==0.4.4
# the FA3 library and the Blackwell kernels are 1.8 GB of the kernel wheel; Hopper engines run without them
unzip -q -o "$D"/k/sglang_kernel-0.4.4-*.whl -d "$D/k/x" -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*'
cp -r "$D"/k/x/sgl_kernel "$D"/k/x/triton_kernels "$D"/k/x/sglang_kernel-0.4.4.dist-info "$D/b/site_extra/"

# SGLang pins DeepGEMM (sgl-deep-gemm) for its FP8 GEMMs; kept off the default path (install_stack.sh puts it in
# TARGET/deepgemm): with it importable every FP8 engine would take DeepGEMM, whose kernels JIT-compile at start
echo "[fetch] DeepGEMM (SGLang's pin)"
mkdir -p "$D/b/deepgemm"
dl "$D/b/deepgemm" sgl-deep-gemm==0.1.3

echo "[fetch] megatron-core and mrl's pure-Python imports"
dl "$D/b/wheels" megatron-core==0.19.2 hydra-core==1.3.2 omegaconf==2.3.0 einops
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$D/k/sdist" antlr4-python3-runtime==4.9.3
"$PY" -m pip wheel -q --no-deps -w "$D/b/wheels" "$D"/k/sdist/antlr4*

if [ "${NO_TE:-0}" != 1 ]; then
  echo "[fetch] Transformer Engine 2.20.2"
  "$PY" -m pip download -q --no-deps -d "$D/b/te" transformer-engine-cu13==2.20.2 transformer-engine==2.20.2
  if [ -n "${TE_TORCH_WHEEL:-}" ]; then
    cp "$TE_TORCH_WHEEL" "$D/b/te/"
  else
    # the sdist as published: pip download would build its metadata, which needs torch on this machine
    "$PY" "$here/fetch_sdist.py" transformer-engine-torch 2.20.2 "$D/b/te" >/dev/null
  fi
fi

tar cf "$D/bundle.tar" -C "$D/b" wheels site_extra te deepgemm  # wheels are compressed already
split -b "${PART_MB}m" "$D/bundle.tar" "$D/parts/part."
sha256sum "$D/bundle.tar" | cut -d' ' -f1 > "$D/bundle.sha256"
rm -rf "$D/k" "$D/b" "$D/bundle.tar"
echo "[fetch] $(ls "$D/parts" | wc -l) parts in $D/parts ($(du -sh "$D/parts" | cut -f1)), sha256 $(cat "$D/bundle.sha256")"
