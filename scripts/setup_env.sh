#!/usr/bin/env bash
# Create or update the project's one virtualenv (.venv): trainer and engine side by side.
# Python 3.12 (megatron-core >= 0.17 requires it): pyenv's 3.12 when present, else python3.12 on PATH.
# Idempotent: skips the install when pyproject.toml has not changed since the last successful one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MRL_VENV:-$ROOT/.venv}"
STAMP="$VENV/.mrl-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  PY=""
  if command -v pyenv >/dev/null 2>&1; then
    v="$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | sort -V | tail -1 || true)"
    [ -n "$v" ] && PY="$(pyenv root)/versions/$v/bin/python3.12"
  fi
  [ -z "$PY" ] && PY="$(command -v python3.12 || true)"
  if [ -z "$PY" ]; then
    echo "setup_env.sh: Python 3.12 not found (install it, e.g. 'pyenv install 3.12')" >&2
    exit 1
  fi
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
echo "[setup] installing mrl and its stack into $VENV (first time: ~12 GB, several minutes)"
"$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# sglang 0.5.14 pins torch 2.11.0 / transformers 5.8.1 (pyproject.toml); megatron-core 0.19.2 runs on that torch.
"$VENV/bin/pip" install -q -e "$ROOT[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import mrl, megatron.core, sglang, transformers, hydra; print('[setup] ok: torch', __import__('torch').__version__, 'megatron-core', megatron.core.__version__, 'sglang', sglang.__version__)"
# SGLang CPU mode: compile the CUDA driver stub from mrl/engine/server/cpu/cudastub.c into the venv
"$VENV/bin/python" -m mrl.engine.cpu_mode >/dev/null
echo "$want" > "$STAMP"
