"""Replacing engines that died (rank 0; only engines this job started).

    r = EngineRestarter(ctl.engines, max_restarts=3)
    r.replace(dead_urls)        # after a sync dropped them: a new server per dead one, started now
    ready = r.take_ready()      # at a later sync: those that are healthy join (weights pushed, then rollouts)

A replacement is the same server (model, cores, flags, the run's keys) on a new port. It boots in the
background while the loop goes on with the survivors, and joins at the first weight sync after it is
healthy: the sync rebuilds the weight-update groups with it and pushes the current weights, and only
then does the rollout side send it requests. A replacement that fails to start is counted and reported,
never retried past ``max_restarts`` in all.

The dead engine's whole process group is SIGKILLed first, replaced or not: one judged hung (stopped,
wedged) is still there, holding its cores and memory, and would never handle a SIGTERM.
"""

from __future__ import annotations

import dataclasses
import threading

from mrl.engine.launcher import Engine


class EngineRestarter:
    def __init__(self, engines: list[Engine], max_restarts: int, health_timeout_s: float = 600.0):
        # the caller's list itself (the controller's): replacements are appended to it, so the job's engine
        # processes stay in one list, every one started so far
        self.engines = engines
        self.max_restarts, self.health_timeout_s = max_restarts, health_timeout_s
        self.restarted = 0
        self.failed: list[str] = []  # "name: error" of replacements that never became healthy
        self._ready: list[Engine] = []
        self._lock = threading.Lock()

    def replace(self, dead_urls: list[str]) -> list[Engine]:
        """Kill each dead engine of ours and start a replacement for it, while restarts are left."""
        started = []
        for old in kill_engines(self.engines, dead_urls):
            if self.restarted >= self.max_restarts:
                continue
            self.restarted += 1
            new = dataclasses.replace(old, port=None, name=f"{old.name.split('-r')[0]}-r{self.restarted}")
            new.start()
            self.engines.append(new)
            threading.Thread(target=self._wait, args=(new,), name=f"{new.name}-health", daemon=True).start()
            started.append(new)
        return started

    def _wait(self, e: Engine) -> None:
        try:
            e.wait_healthy(self.health_timeout_s)
        except Exception as err:  # reported by the loop's metrics; the run goes on with the others
            with self._lock:
                self.failed.append(f"{e.name}: {err}".splitlines()[0])
            return
        with self._lock:
            self._ready.append(e)

    def take_ready(self) -> list[Engine]:
        with self._lock:
            ready, self._ready = self._ready, []
        return ready


def kill_engines(engines: list[Engine], urls: list[str]) -> list[Engine]:
    """SIGKILL the process groups of those of ``engines`` at ``urls`` (judged dead or hung) and wait until
    nothing of them is left; returns them. URLs of engines the job did not start are skipped."""
    dead = [e for e in engines if e.url in urls]
    for e in dead:
        e.kill()
    return dead
