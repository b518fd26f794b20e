"""Import check of the cluster image: the installed versions are pyproject.toml's pins and every piece of the
stack imports. Runs at image build time (docker/Dockerfile); CI runs ``--pins-only`` against the CPU
virtualenv (tests/slurm/test_docker.py), so the pins the image is checked against are the tested ones.

    python docker/verify_image.py                # in the GPU image: pins, TE/megatron-core versions, full stack imports
    python docker/verify_image.py --cpu          # in the CPU image: the same without Transformer Engine and apex
    python docker/verify_image.py --pins-only    # anywhere: only pyproject.toml's == pins
    python docker/verify_image.py --requirements # pyproject.toml's dependencies, one a line (the images' pip input)
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
GPU_ONLY = ("transformer_engine", "transformer_engine.pytorch", "apex")
"""Built only into the GPU image (docker/Dockerfile): the CPU image (docker/Dockerfile.cpu) runs the local spec."""
# distribution -> environment variable holding the version the Dockerfile installed (its ARG)
ARG_PINS = {"transformer_engine": "TE_VERSION", "megatron-core": "MEGATRON_CORE_VERSION"}


def pyproject_dependencies(path: str = PYPROJECT) -> list[str]:
    """The ``[project] dependencies`` of pyproject.toml, as written."""
    with open(path, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def pyproject_pins(path: str = PYPROJECT) -> dict[str, str]:
    """``{distribution: version}`` of every ``name==version`` dependency of pyproject.toml."""
    pins = {}
    for dep in pyproject_dependencies(path):
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
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--pins-only", action="store_true", help="only the == pins of pyproject.toml")
    mode.add_argument("--cpu", action="store_true", help="the CPU image: no Transformer Engine, no apex")
    mode.add_argument("--requirements", action="store_true", help="print pyproject.toml's dependencies")
    args = ap.parse_args()
    if args.requirements:  # the images install the stack from this before copying the source (a cached layer)
        print("\n".join(pyproject_dependencies()))
        return 0
    pins = pyproject_pins()
    if not args.pins_only:
        pins.update({dist: os.environ[var] for dist, var in ARG_PINS.items() if os.environ.get(var)})
    errors = check_versions(pins)
    for name, want in sorted(pins.items()):
        print(f"{name:22s} {want}")
    if not args.pins_only:
        for mod in STACK:
            if args.cpu and mod in GPU_ONLY:
                continue
            try:
                m = importlib.import_module(mod)
                print(f"import {mod:28s} ok {getattr(m, '__version__', '')}")
            except Exception as e:  # report every failing import, not just the first
                errors.append(f"import {mod}: {type(e).__name__}: {e}")
        from mrl._compat.te import HAVE_TE

        if not HAVE_TE and not args.cpu:
            errors.append("mrl._compat.te.HAVE_TE is False: megatron would fall back to the local (non-TE) spec")
    if errors:
        print("image check FAILED:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    print("pins ok" if args.pins_only else "image ok (cpu)" if args.cpu else "image ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
