"""Submit and follow Slurm jobs through sbatch / scontrol / sacct, every call with a timeout.

    job_id = submit("/runs/r1/mrl.sbatch")
    info = wait(job_id, on_change=print)      # JobInfo once the job reached a final state
    if not info.ok: print(tail(info.stdout))

A requeued job keeps its id and goes back to PENDING, so ``wait`` follows it across attempts.
scontrol answers for MinJobAge seconds after the end (default 300); after that sacct does, when the
cluster keeps accounting.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional

CALL_TIMEOUT_S = 60.0
# States after which a job does not run again by itself (REQUEUE_HOLD / SPECIAL_EXIT wait for a human).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "REQUEUE_HOLD", "SPECIAL_EXIT"})


class SlurmError(RuntimeError):
    pass


@dataclass(kw_only=True)
class JobInfo:
    job_id: str
    state: str
    exit_code: str = ""
    """``<exit status>:<signal>`` of the batch script."""
    reason: str = ""
    stdout: Optional[str] = None
    restarts: int = 0

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code in ("0:0", "")


def _call(cmd: list[str], *, timeout: float = CALL_TIMEOUT_S, env: dict | None = None,
          cwd: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]} not found: run mrl launch on a machine with the Slurm client tools") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd)} did not answer within {timeout:.0f}s (slurmctld busy or down?)") from None


def submit(script: str, *, env: dict | None = None, cwd: str | None = None) -> str:
    """``sbatch --parsable script``; returns the job id."""
    proc = _call(["sbatch", "--parsable", script], env=env, cwd=cwd)
    if proc.returncode:
        raise SlurmError(f"sbatch {script} failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)")


def _scontrol_info(job_id: str, env: dict | None) -> Optional[JobInfo]:
    proc = _call(["scontrol", "show", "job", "--oneliner", job_id], env=env)
    if proc.returncode:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
    line = proc.stdout.strip().splitlines()[0]  # heterogeneous jobs: one line per component, leader first
    f = dict(_FIELD.findall(line))
    return JobInfo(job_id=job_id, state=f.get("JobState", "UNKNOWN"), exit_code=f.get("ExitCode", ""),
                   reason=f.get("Reason", ""), stdout=f.get("StdOut"), restarts=int(f.get("Restarts", 0)))


def _sacct_info(job_id: str, env: dict | None) -> Optional[JobInfo]:
    proc = _call(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], env=env)
    rows = [r for r in proc.stdout.strip().splitlines() if r]
    if proc.returncode or not rows:
        return None
    state, exit_code = rows[0].split("|")[:2]
    return JobInfo(job_id=job_id, state=state.split()[0], exit_code=exit_code)  # "CANCELLED by 0" -> CANCELLED


def job_info(job_id: str, *, env: dict | None = None) -> Optional[JobInfo]:
    """Current state of ``job_id`` (scontrol, then sacct); None when neither knows the job."""
    return _scontrol_info(job_id, env) or _sacct_info(job_id, env)


def wait(job_id: str, *, poll_s: float = 5.0, timeout_s: float | None = None, env: dict | None = None,
         on_change: Callable[[JobInfo], None] | None = None) -> JobInfo:
    """Poll until the job reaches a final state; ``on_change`` sees every new (state, attempt)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    seen: tuple[str, int] | None = None
    unknown_since: float | None = None
    while True:
        info = job_info(job_id, env=env)
        if info is None:  # just submitted and not yet visible, or forgotten and no accounting
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > 60:
                raise SlurmError(f"job {job_id}: neither scontrol nor sacct knows it")
        else:
            unknown_since = None
            if (info.state, info.restarts) != seen:
                seen = (info.state, info.restarts)
                if on_change:
                    on_change(info)
            if info.final:
                return info
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.state if info else 'unknown'} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def tail(path: str | None, n: int = 40) -> str:
    """Last ``n`` lines of a log file, or a note saying why there are none."""
    if not path:
        return "(no log path known)"
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(cannot read {path}: {e.strerror})"
