"""The CPU image's build and a training run inside it, as a report (bench/reports/image/<date>_image_build_cpu.json).

    make image                                  # writes build/image/<tag>.json (phase times, size, packages)
    python bench/image_build.py [--steps 100]    # reads it, runs `mrl train` in the image, writes the report

The report holds the build's seconds (base and Dockerfile.cpu), the image's size, its Python and key
package versions, the packages whose version differs from this virtualenv's (the pins are pyproject.toml's,
the rest resolves at build time), and the run's wall time and reward per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import distributions

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from _bench_common import dump  # noqa: E402

from tests.container.podman import image_tag, run  # noqa: E402

KEY_PACKAGES = ("torch", "sglang", "sglang-kernel", "megatron-core", "transformers", "hydra-core", "mrl")


def host_tools() -> dict[str, str | None]:
    """Versions of the container tools that built and ran the image."""
    out = {}
    for tool, cmd in {"podman": ["podman", "--version"], "buildah": ["buildah", "--version"],
                      "runc": ["runc", "--version"], "debootstrap": ["debootstrap", "--version"]}.items():
        try:
            out[tool] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            out[tool] = None
    return out


def venv_packages() -> dict[str, str]:
    return {d.metadata["Name"].lower(): d.version for d in distributions()}


def train_in_image(tag: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["mrl", "train", "run_dir=/runs/train", "model.hf_path=/runs/models/tiny", f"train.steps={steps}",
               "train.eval_every=0"]
        t0 = time.monotonic()
        p = run(tag, cmd, volumes={tmp: "/runs"}, env={"OMP_NUM_THREADS": "1"}, timeout=3000)
        wall = time.monotonic() - t0
        if p.returncode:
            raise SystemExit(f"mrl train in {tag} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
        rows = [json.loads(x) for x in open(os.path.join(tmp, "train", "metrics.jsonl"))]
        outputs = sorted(os.listdir(os.path.join(tmp, "train")))
    steps_rows = [r for r in rows if "step_seconds" in r]
    rewards = [round(r["reward"], 4) for r in rows if "reward" in r]
    return {"command": " ".join(cmd), "wall_seconds": round(wall, 1), "outputs_on_volume": outputs,
            "reward_per_step": rewards, "reward_first5_mean": sum(rewards[:5]) / 5,
            "reward_last5_mean": sum(rewards[-5:]) / 5,
            "step_seconds_median": sorted(r["step_seconds"] for r in steps_rows)[len(steps_rows) // 2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default=image_tag())
    ap.add_argument("--record", default=None, help="build record (default build/image/<tag>.json)")
    ap.add_argument("--steps", type=int, default=100, help="RL steps of the run inside the image (0: no run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default=None, help="free text kept in the report (what was installed, and how)")
    args = ap.parse_args()
    safe = args.tag.replace("/", "_").replace(":", "_")
    record_path = args.record or os.path.join(REPO, "build", "image", f"{safe}.json")
    with open(record_path) as f:
        build = json.load(f)
    with open(os.path.join(os.path.dirname(record_path), build["packages_file"])) as f:
        image_pkgs = {p["name"].lower(): p["version"] for p in json.load(f)}
    venv = venv_packages()
    differ = {n: {"image": v, "venv": venv.get(n)} for n, v in sorted(image_pkgs.items())
              if venv.get(n) != v and n not in ("mrl", "pip", "setuptools")}
    result = {"bench": "image_build_cpu", "build": {k: v for k, v in build.items() if k != "packages_file"},
              "size_gib": round(build["size_bytes"] / (1 << 30), 2),
              "versions_in_image": {n: image_pkgs.get(n) for n in KEY_PACKAGES},
              "packages_in_image": len(image_pkgs), "packages_differing_from_venv": differ,
              "host_tools": host_tools(), "note": args.note}
    if args.steps:
        result["train_in_image"] = train_in_image(args.tag, args.steps)
    dump(result, args.out, name="image_build_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
