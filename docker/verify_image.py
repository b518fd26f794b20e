"""Import check of the cluster image: the installed versions are pyproject.toml's pins and every piece of the
stack imports. Runs at image build time (docker/Dockerfile); CI runs ``--pins-only`` against the CPU
virtualenv (tests/slurm/test_docker.py), so the pins the image is checked against are the tested ones.

    python docker/verify_image.py              # in the image: pins, TE/megatron-core versions, full stack imports
    python docker/verify_image.py --pins-only  # anywhere: only pyproject.toml's == pins
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import re
import sys
import tomllib

PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pyproject.toml")
STACK = ("torch", "transformers", "sglang", "megatron.core", "transformer_engine", "transformer_engine.pytorch",
         "apex", "hydra", "mrl", "mrl.cluster", "mrl.megatron.model", "mrl.models")
# distribution -> environment variable holding the version the Dockerfile installed (its ARG)
ARG_PINS = {"transformer_engine": "TE_VERSION", "megatron-core": "MEGATRON_CORE_VERSION"}


def pyproject_pins(path: str = PYPROJECT) -> dict[str, str]:
    """``{distribution: version}`` of every ``name==version`` dependency of pyproject.toml."""
    with open(path, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pins = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*", dep)
        if m:
            pins[m[1]] = m[2]
    return pins


def check_versions(pins: dict[str, str]) -> list[str]:
    errors = []
    for name, want in pins.items():
        try:
            got = md.version(name)
        except md.PackageNotFoundError:
            errors.append(f"{name}: not installed (pinned {want})")
            continue
        if got.split("+")[0] != want:  # local labels such as 2.11.0+cu130 match 2.11.0
            errors.append(f"{name}: {got} installed, pinned {want}")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pins-only", action="store_true")
    args = ap.parse_args()
    pins = pyproject_pins()
    if not args.pins_only:
        pins.update({dist: os.environ[var] for dist, var in ARG_PINS.items() if os.environ.get(var)})
    errors = check_versions(pins)
    for name, want in sorted(pins.items()):
        print(f"{name:22s} {want}")
    if not args.pins_only:
        for mod in STACK:
            try:
                m = importlib.import_module(mod)
                print(f"import {mod:28s} ok {getattr(m, '__version__', '')}")
            except Exception as e:  # report every failing import, not just the first
                errors.append(f"import {mod}: {type(e).__name__}: {e}")
        from mrl._compat.te import HAVE_TE

        if not HAVE_TE:
            errors.append("mrl._compat.te.HAVE_TE is False: megatron would fall back to the local (non-TE) spec")
    if errors:
        print("image check FAILED:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    print("image ok" if not args.pins_only else "pins ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
