"""Engine announcements: an engine node writes ``<dir>/<name>.url`` (one line, ``http://host:port``) once
its server is healthy and removes it on stop; the trainer attaches to the engines it finds there.

The trainer sends weights (and engine keys) to whatever these files name, so it accepts one only from a
directory and file of its own user, naming a host of the job (``job_addresses``).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from urllib.parse import urlparse

SUFFIX = ".url"


def announce(url_dir: str, name: str, url: str) -> str:
    """Write the announcement atomically (a reader never sees a half-written URL); returns its path."""
    os.makedirs(url_dir, exist_ok=True)
    path = os.path.join(url_dir, name + SUFFIX)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(url + "\n")
    os.replace(tmp, path)
    return path


def withdraw(url_dir: str, name: str) -> None:
    try:
        os.remove(os.path.join(url_dir, name + SUFFIX))
    except FileNotFoundError:
        pass


class UntrustedEngineURL(PermissionError):
    """An engine announcement the trainer must not follow."""


def read_urls(url_dir: str, allowed: set[str] | None = None) -> dict[str, str]:
    """``{name: url}`` of every engine announced in ``url_dir`` (empty when the directory is missing).
    ``allowed``: addresses of the job's hosts (``job_addresses()``); a URL naming another host, or a file or
    directory another user could have written, raises ``UntrustedEngineURL``."""
    if not os.path.isdir(url_dir):
        return {}
    if allowed is not None:
        _check_private(url_dir, "engine.url_dir")
    out = {}
    for fname in sorted(os.listdir(url_dir)):
        if fname.endswith(SUFFIX):
            path = os.path.join(url_dir, fname)
            with open(path) as f:
                url = f.read().strip()
            if url and allowed is not None:
                _check_private(path, "engine announcement")
                _check_host(path, url, allowed)
            if url:
                out[fname[: -len(SUFFIX)]] = url
    return out


def job_addresses() -> set[str]:
    """Addresses of the job's hosts: this node's interfaces and, under Slurm, every node of the allocation
    (``$SLURM_JOB_NODELIST`` and its heterogeneous groups, expanded by ``scontrol``), resolved."""
    import psutil

    addrs = {a.address.split("%")[0] for nic in psutil.net_if_addrs().values() for a in nic
             if a.family in (socket.AF_INET, socket.AF_INET6)}
    names = {socket.gethostname()}
    for key, nodelist in os.environ.items():
        if key.startswith("SLURM_JOB_NODELIST") and nodelist:
            names.update(_hostnames(nodelist))
    for name in names:
        addrs |= _resolve(name)
    return addrs


def _hostnames(nodelist: str) -> list[str]:
    if "[" not in nodelist:
        return nodelist.split(",")
    try:
        return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise UntrustedEngineURL(f"cannot expand the job's node list {nodelist!r} with scontrol ({e}): the engine "
                                 "announcements cannot be checked against the job's hosts") from e


def _resolve(host: str) -> set[str]:
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return set()


def _check_host(path: str, url: str, allowed: set[str]) -> None:
    u = urlparse(url)
    try:
        ok = u.scheme in ("http", "https") and u.hostname is not None and u.port is not None
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise UntrustedEngineURL(f"{path}: {url!r} is not an engine URL (http://host:port)")
    if not _resolve(u.hostname) & allowed:
        raise UntrustedEngineURL(f"{path}: engine {url} is not on a host of this job (this node and "
                                 "$SLURM_JOB_NODELIST); refusing to send it weights and keys")


def _check_private(path: str, what: str) -> None:
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedEngineURL(f"{what} {path}: owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; "
                                 f"only a file of uid {os.getuid()} that no one else can write is followed")


class AnnouncedEngines:
    """A scoring pool's servers on nodes of its own (``scoring.<pool>.nodes``), as the pool
    (``mrl.scoring.pool.ScoringPool``, an ``EngineSet``) sees them: each one announced in ``url_dir`` by
    ``mrl engine --pool`` joins once, healthy (announced only then); the pool waits for the first while fewer
    than ``count`` have come and ``health_timeout_s`` has not passed. As with rollout engines on engine
    nodes, none is restarted from here: a dead one is only dropped, and the pool goes on with the others."""

    def __init__(self, url_dir: str, count: int, *, name: str, health_timeout_s: float):
        self.url_dir, self.count, self.name, self.health_timeout_s = url_dir, count, name, health_timeout_s
        self._seen: set[str] = set()

    def start(self) -> "AnnouncedEngines":
        import time

        # in the process that calls the pool (the group crosses to it pickled)
        self._allowed, self._deadline = job_addresses(), time.monotonic() + self.health_timeout_s
        return self

    def take_ready(self) -> list[str]:
        new = {n: u for n, u in read_urls(self.url_dir, self._allowed).items() if n not in self._seen}
        self._seen |= set(new)
        return list(new.values())

    @property
    def booting(self) -> bool:
        import time

        return len(self._seen) < self.count and time.monotonic() < self._deadline

    def replace(self, url: str) -> int:
        return 0

    @property
    def failed_starts(self) -> int:
        return 0

    def describe_failures(self) -> list[str]:
        missing = self.count - len(self._seen)
        return [f"{missing} of {self.count} {self.name} engines never announced in {self.url_dir}"] if missing else []

    def close(self) -> None:
        """The servers are their nodes' (``mrl engine``): the job's end stops them."""
