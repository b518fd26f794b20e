"""The CPU image (`make image`) run with podman: the tag under test, whether it exists, bringing it up to date
with this tree, one ``podman run``.

``MRL_IMAGE`` names another image (a GPU image run on CPU works the same way). Every call goes through
docker/podman.sh (runc, no default ulimits: docker/containers.conf).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PODMAN = os.path.join(REPO, "docker", "podman.sh")


def image_tag() -> str:
    if os.environ.get("MRL_IMAGE"):
        return os.environ["MRL_IMAGE"]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return f"localhost/mrl:{tomllib.load(f)['project']['version']}-cpu"


def missing_reason(tag: str) -> str | None:
    """Why the image cannot be run here (no podman, image not built), or None."""
    if shutil.which("podman") is None:
        return f"podman is not installed, so image {tag} does not exist here (build it: make image)"
    p = subprocess.run([PODMAN, "image", "exists", tag], capture_output=True, timeout=60)
    return None if p.returncode == 0 else f"image {tag} is not built here (make image)"


@functools.cache
def rebuilt(tag: str) -> str:
    """``tag`` rebuilt from this tree (docker/build_image.sh): the layers whose input did not change come from
    podman's cache, so a change to mrl's source rebuilds only its small layers (a minute) and the tests never
    run an image older than the code. Raises with the build's output when it fails."""
    p = subprocess.run(["bash", os.path.join(REPO, "docker", "build_image.sh"), tag], capture_output=True,
                       text=True, timeout=3000, cwd=REPO)
    if p.returncode:
        raise RuntimeError(f"docker/build_image.sh {tag} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return tag


def run(tag: str, cmd: list[str], *, volumes: dict[str, str] | None = None, env: dict[str, str] | None = None,
        timeout: float = 600, network: str = "none") -> subprocess.CompletedProcess:
    """``podman run --rm`` of ``cmd`` in ``tag``: host folders mounted (``{host: container}``), a shared memory
    big enough for torch's and SGLang's worker processes, no network beyond the container's loopback."""
    args = [PODMAN, "run", "--rm", f"--network={network}", "--shm-size=4g"]
    for src, dst in (volumes or {}).items():
        args += ["--volume", f"{src}:{dst}"]
    for k, v in (env or {}).items():
        args += ["--env", f"{k}={v}"]
    return subprocess.run([*args, tag, *cmd], capture_output=True, text=True, timeout=timeout)
