"""Per-rank entry points started by torchrun (``python -m mrl.jobs.<name>``), and the local launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def torchrun(module: str, args: list[str], nproc: int, *, timeout: float | None = None, capture: bool = True,
             cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m module`` on ``nproc`` local ranks. The launcher and its workers get their own
    session, so a timeout kills the whole tree: no orphaned ranks keep ports or cores."""
    if os.environ.get("PET_NNODES"):  # a Slurm trainer node: torchrun reads the multi-node rendezvous
        # (PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR/PORT) from the environment
        cmd = [sys.executable, "-m", "torch.distributed.run", "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", module, *args]
    if not capture:
        print("[mrl] " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # timeout, Ctrl-C: take the workers down with the launcher
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            raise TimeoutError(f"{module} timed out after {timeout}s:\n{(err or '')[-3000:]}")
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
