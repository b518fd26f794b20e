"""A real Slurm cluster of several nodes on one box: one ``slurmd`` per network namespace.

    cluster = NetnsSlurm(tmp_dir, nodes=2).start()   # bridge, namespaces, munged, slurmctld, one slurmd each
    subprocess.run(["sbatch", ...], env=cluster.env)   # jobs see nodes mrlnode1, mrlnode2, ...
    cluster.stop()                                     # daemons, then namespaces, bridge and hosts files

Each node is a network namespace with its own address on a bridge (``10.214.<tag>.0/24``; the host,
where slurmctld runs, is ``.1``) and its own host name (``unshare --uts``), so its slurmd registers as
``mrlnode<k>``, and everything Slurm starts there (batch script, steps, ``mrl engine``, ``mrl train``)
lives on that node's network: node-to-node traffic crosses the bridge, as between hosts of a cluster.
``/etc/netns/<ns>/hosts`` names every node, as a cluster's DNS does. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from tests.slurm.localslurm import LocalSlurm


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")


class NetnsSlurm(LocalSlurm):
    def __init__(self, root: str, *, nodes: int = 2, **kw) -> None:
        super().__init__(root, **kw)
        self.tag = os.getpid() % 250
        self.bridge = f"mrlbr{self.tag}"
        self.host_ip = f"10.214.{self.tag}.1"
        self.nodes = [f"mrlnode{k}" for k in range(1, nodes + 1)]
        self.addr = {n: f"10.214.{self.tag}.{k + 1}" for k, n in enumerate(self.nodes, start=1)}
        self.ns = {n: f"mrl-{self.tag}-{n}" for n in self.nodes}

    # -- the network --------------------------------------------------------------------------------
    def make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addr.items())
        for k, node in enumerate(self.nodes, start=1):
            ns, outer, inner = self.ns[node], f"mrlb{self.tag}h{k}", f"mrlb{self.tag}n{k}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("addr", "add", f"{self.addr[node]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("route", "add", "default", "via", self.host_ip, ns=ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)

    def remove_network(self) -> None:
        for k, node in enumerate(self.nodes, start=1):
            subprocess.run(["ip", "netns", "del", self.ns[node]], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"mrlb{self.tag}h{k}"], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{self.ns[node]}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    # -- Slurm ----------------------------------------------------------------------------------------
    def write_conf(self) -> None:
        super().write_conf()
        r = self.root
        with open(self.conf) as f:
            lines = f.read().splitlines()
        host = socket.gethostname().split(".")[0]
        nodes = ",".join(self.nodes)
        swap = {
            "SlurmctldHost=": f"SlurmctldHost={host}({self.host_ip})",
            "SlurmdSpoolDir=": f"SlurmdSpoolDir={r}/spool/%n",
            "SlurmdPidFile=": f"SlurmdPidFile={r}/slurmd.%n.pid",
            "SlurmdLogFile=": f"SlurmdLogFile={r}/log/slurmd.%n.log",
            "PartitionName=": f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
                              "OverSubscribe=NO",
        }
        out = []
        for ln in lines:
            key = next((k for k in swap if ln.startswith(k)), None)
            if ln.startswith("NodeName="):
                # every node claims the box's cores: they are one machine (config_overrides: no INVAL)
                out += [f"NodeName={n} NodeAddr={a} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
                        for n, a in self.addr.items()]
            else:
                out.append(swap[key] if key else ln)
        out.append("SlurmdParameters=config_overrides")
        with open(self.conf, "w") as f:
            f.write("\n".join(out) + "\n")

    def _start_slurmd(self) -> None:
        for node in self.nodes:
            os.makedirs(os.path.join(self.root, "spool", node), exist_ok=True)
            # nsenter, not `ip netns exec`: that one remounts /sys, and slurmd needs the host's cgroup mounts;
            # the node's own host name and hosts file live in a UTS and a mount namespace of its own
            ns = self.ns[node]
            self._spawn(f"slurmd-{node}", [
                "nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c",
                f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {node} && exec slurmd -D -f {self.conf}"])

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                             timeout=10).stdout.split()
        return len(out) == len(self.nodes) and set(out) == {"idle"}

    def start(self, timeout: float = 60.0, *, network: bool = True) -> "NetnsSlurm":
        """``network=False``: the caller made it already (``make_network``)."""
        if network:
            self.make_network()
        try:
            return super().start(timeout)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.remove_network()

    def logs(self, n: int = 20) -> str:
        out = [super().logs(n)]
        for node in self.nodes:
            path = os.path.join(self.root, "log", f"slurmd.{node}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- slurmd.{node}.log\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)
