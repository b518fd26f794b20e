#!/usr/bin/env bash
# On a network-less GPU host: assemble the parts made by fetch_parts.sh (stashed in STASH as part.aa,
# part.ab, ...) and install SGLang 0.5.14, megatron-core and Transformer Engine into TARGET, next to the
# host's own torch. Afterwards: source TARGET/env.sh (PYTHONPATH, NCCL_CUMEM_ENABLE=0). Transformer Engine goes
# to TARGET/te, on the path only with `source TARGET/env.sh te`: megatron picks its TE spec whenever TE imports,
# so leaving it off the path runs the local spec on the same host. DeepGEMM goes to TARGET/deepgemm, on no path
# (engines that should use it get it prepended: bench/gpu_loop.py's "mrl_pythonpath" server arg).
# FA3 (SGLang's default attention on Hopper, left out of the bundle for its size) is added when STASH also
# holds the parts of fetch_fa3.sh (fa3.aa, fa3.ab, ...; their sha256 as FA3_SHA256): engine.attention_backend=fa3 then works.
# Usage: scripts/gpu/install_stack.sh STASH TARGET [SHA256]
set -euo pipefail
S=${1:?stash}; T=${2:?target}; want=${3:-}
PY=${PYTHON:-python3}
W=$(mktemp -d)
cat "$S"/part.* > "$W/bundle.tar"
if [ -n "$want" ] && [ "$(sha256sum "$W/bundle.tar" | cut -d' ' -f1)" != "$want" ]; then
  echo "install_stack.sh: the assembled bundle's sha256 differs from $want: a part is missing or damaged" >&2
  exit 1
fi
tar xf "$W/bundle.tar" -C "$W"
mkdir -p "$T"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" "$W"/wheels/*.whl
cp -r "$W"/site_extra/* "$T/"
# sglang.utils imports IPython.display at import time; the host image has no IPython
mkdir -p "$T/IPython"; : > "$T/IPython/__init__.py"; printf 'HTML = display = None\n' > "$T/IPython/display.py"
# transformers 5.8.1 (SGLang's pin) refuses the image's newer tokenizers; mrl's engines skip tokenizer init
printf 'def dep_version_check(pkg, hint=None):\n    pass\n' > "$T/transformers/dependency_versions_check.py"
if ls "$W"/te/*.whl >/dev/null 2>&1; then
  if ! ls "$W"/te/transformer_engine_torch-*.whl >/dev/null 2>&1 && ls "$W"/te/transformer_engine_torch-*.tar.gz >/dev/null 2>&1; then
    echo "[install] building Transformer Engine's torch extension against the host's torch"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$T/te" "$W"/te/transformer_engine_cu13-*.whl
    (cd "$W/te" && tar xzf transformer_engine_torch-*.tar.gz && cd transformer_engine_torch-*/ &&
      PYTHONPATH="$T/te:$T" NVTE_CUDA_ARCHS=90 MAX_JOBS=$(nproc) NVTE_FRAMEWORK=pytorch \
      "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$W/te" .)
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$T/te" "$W"/te/*.whl
fi
if ls "$S"/fa3.* >/dev/null 2>&1; then  # FA3's library, xz-compressed: into sgl_kernel, where mrl looks for it
  cat "$S"/fa3.* > "$W/fa3.xz"
  if [ -n "${FA3_SHA256:-}" ] && [ "$(sha256sum "$W/fa3.xz" | cut -d' ' -f1)" != "$FA3_SHA256" ]; then
    echo "install_stack.sh: the FA3 parts' sha256 differs from FA3_SHA256: a part is missing or damaged" >&2
    exit 1
  fi
  "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"), 1 << 24)' \
    "$W/fa3.xz" "$T/sgl_kernel/flash_ops.abi3.so"  # python's lzma: the image may lack xz
  echo "[install] FA3 attention library added"
fi
if ls "$W"/deepgemm/*.whl >/dev/null 2>&1; then  # off the default path: an engine that wants it prepends it
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$T/deepgemm" "$W"/deepgemm/*.whl
fi
cat > "$T/env.sh" <<EOF
# source env.sh [te]: the stack on the path; with "te", Transformer Engine too
export PYTHONPATH=$T:\${PYTHONPATH:-}
[ "\${1:-}" = te ] && export PYTHONPATH=$T/te:\$PYTHONPATH
# SGLang's NCCL weight-update group fails with "Cuda failure 'invalid argument'" on cuMem-backed buffers
export NCCL_CUMEM_ENABLE=0
EOF
rm -rf "$W"
# bytecode now, as pip does by default: otherwise every process's first import compiles it, and the first
# engine and trainer of a fresh host pay for it at start (the wheels go in with --no-compile above)
"$PY" -m compileall -q -j 0 "$T" > /dev/null 2>&1 || echo "[install] compileall reported errors (bytecode is made at import then)"
PYTHONPATH="$T/te:$T" "$PY" - <<'PY'
import importlib
for m in ("sglang", "sgl_kernel", "megatron.core", "hydra", "omegaconf", "transformers"):
    mod = importlib.import_module(m)
    print(f"[install] {m} {getattr(mod, '__version__', '')}")
try:
    import transformer_engine.pytorch as te  # noqa: F401
    import transformer_engine
    print("[install] transformer_engine", transformer_engine.__version__)
except Exception as e:  # TE is optional: the local spec runs without it
    print("[install] transformer_engine not available:", type(e).__name__, str(e)[:200])
PY
