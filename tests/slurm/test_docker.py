"""The cluster image's pins agree with pyproject.toml and with the CPU virtualenv CI tests (the image itself
is built on GPU machines only: docker/README.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "docker"))
from verify_image import pyproject_pins  # noqa: E402

sys.path.pop(0)


def read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", read("docker/Dockerfile"), re.M))


def test_virtualenv_has_the_pinned_versions():
    p = subprocess.run([sys.executable, os.path.join(REPO, "docker", "verify_image.py"), "--pins-only"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "pins ok" in p.stdout, p.stdout + p.stderr


def test_dockerfile_readme_and_pyproject_agree():
    pins, args, readme = pyproject_pins(), dockerfile_args(), read("docker/README.md")
    assert args["SGLANG_IMAGE"].startswith(f"lmsysorg/sglang:v{pins['sglang']}")
    assert args["MEGATRON_CORE_VERSION"] == pins["megatron-core"]
    for name in ("SGLANG_IMAGE", "MEGATRON_CORE_VERSION", "TE_VERSION", "APEX_COMMIT"):
        assert args[name].split(":")[-1] in readme, f"docker/README.md does not document {name}={args[name]}"
    for dist in ("sglang", "torch", "transformers", "megatron-core"):
        assert pins[dist] in readme, f"docker/README.md does not mention {dist} {pins[dist]}"
    # the node entry and the config tree travel into the image
    copies = {"COPY mrl/ mrl/", "COPY conf/ conf/", "COPY scripts/ scripts/"}
    assert copies <= set(read("docker/Dockerfile").splitlines())
