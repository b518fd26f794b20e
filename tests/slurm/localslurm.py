"""A real one-node Slurm cluster on localhost, private to one test session.

    cluster = LocalSlurm(tmp_dir).start()   # munged, slurmctld, slurmd; waits until the node is idle
    subprocess.run(["sbatch", ...], env=cluster.env)
    cluster.stop()                          # cancels jobs, stops exactly the daemons it started

Everything lives in ``tmp_dir``: slurm.conf (found through ``SLURM_CONF``), a private munged socket,
state, spool, pid and log files; the ports are chosen free at start. Daemons run in the foreground as
children of this process (each in its own session), so stopping them never touches a process this
class did not start. The Debian packages come from ``scripts/install_slurm.sh`` (needs root + apt).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install() -> None:
    """Install slurm-wlm and munge if missing; raise with the installer's message otherwise."""
    if all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "install_slurm.sh")], capture_output=True,
                          text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"could not install Slurm for tests/slurm (scripts/install_slurm.sh exit "
                           f"{proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


class LocalSlurm:
    def __init__(self, root: str, *, cpus: int | None = None, cred_expire_s: int = 5) -> None:
        self.root = os.path.abspath(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.cred_expire_s = cred_expire_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def write_conf(self) -> None:
        for d in ("state", "spool", "log", "munge"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o700)
        r = self.root
        lines = [
            "ClusterName=mrltest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            "SlurmUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerParameters=sched_interval=1",
            "MinJobAge=600",
            "KillWait=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, "log", f"{name}.stdout"), "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env, start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        self.write_conf()
        r = self.root
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/log/munged.log",
                               f"--seed-file={r}/munge/munged.seed"])
        self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", self.conf])
        self._wait(lambda: self._ok(["scontrol", "ping"]), 30, "slurmctld")
        self._start_slurmd()
        self._wait(self._node_idle, timeout, "node idle")
        return self

    def _start_slurmd(self) -> None:
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf])

    def _ok(self, cmd: list[str]) -> bool:
        try:
            return subprocess.run(cmd, env=self.env, capture_output=True, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        return out == "idle"

    def _wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: no {what} after {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.3)

    def logs(self, n: int = 20) -> str:
        out = []
        logdir = os.path.join(self.root, "log")
        stdouts = sorted(f for f in os.listdir(logdir) if f.endswith(".stdout")) if os.path.isdir(logdir) else []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", *stdouts):
            path = os.path.join(self.root, "log", name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel every job, wait for them to leave, then stop the daemons in reverse order."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._ok(["scancel", "--full", "--user", str(os.getuid())])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                                     text=True, timeout=10).stdout.strip()
                if not out:
                    break
                time.sleep(0.5)
        for name in reversed(list(self.procs)):  # slurmds, slurmctld, munged: the reverse of their start
            p = self.procs.pop(name)
            if p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
