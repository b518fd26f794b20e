"""The images' pins agree with pyproject.toml and with the CPU virtualenv CI tests, and the CPU image
(docker/Dockerfile.cpu, built here by `make image`) ends with the same mrl layers as the GPU image
(docker/Dockerfile, built where SGLang's release image can be pulled: docker/README.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "docker"))
from verify_image import pyproject_dependencies, pyproject_pins  # noqa: E402

sys.path.pop(0)


def read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def dockerfile_args(name: str = "docker/Dockerfile") -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", read(name), re.M))


def mrl_layers(name: str) -> list[str]:
    lines = read(name).splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("# ---- mrl layers"))
    end = lines.index("# ---- end of the mrl layers ----")
    return lines[start + 1:end]


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


def test_cpu_and_gpu_images_share_the_mrl_layers():
    gpu, cpu = mrl_layers("docker/Dockerfile"), mrl_layers("docker/Dockerfile.cpu")
    assert gpu == cpu and any(x.startswith("RUN ") for x in gpu)
    assert dockerfile_args("docker/Dockerfile.cpu")["MEGATRON_CORE_VERSION"] == pyproject_pins()["megatron-core"]
    # both hold their base at its versions through the same constraints file the shared layers read
    for name in ("docker/Dockerfile", "docker/Dockerfile.cpu"):
        assert "pip list --format=freeze > /opt/base-constraints.txt" in read(name)
    assert "verify_image.py --cpu" in read("docker/Dockerfile.cpu")
    assert "bash docker/build_image.sh" in read("Makefile")


def test_requirements_are_pyprojects_dependencies():
    p = subprocess.run([sys.executable, os.path.join(REPO, "docker", "verify_image.py"), "--requirements"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.splitlines() == pyproject_dependencies()
    assert "torch==2.11.0" in p.stdout.splitlines()
