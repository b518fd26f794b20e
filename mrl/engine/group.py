"""The servers of one side pool that the run starts (a scoring pool's teachers, judges, reward models): booted
in the background, the dead ones killed and replaced.

    group = EngineGroup(cfg.scoring.teacher.engine, model_path, log_dir="runs/x/engines", name="teacher")
    group.start()                    # every server starts booting; returns at once
    urls = group.take_ready()        # servers that became healthy since the last call (replacements included)
    group.booting                    # one is still starting: a caller with none healthy waits
    group.replace(url)               # a server judged dead or hung: its process group killed, a new one booting
    group.close()

Built unstarted on the trainer side (``mrl.trainer.engines.RunEngines.side_groups``) and handed to the process
that uses the pool, which starts it: the servers are children of the process that calls them, as rollout
engines are of the trainer. Pools attached to servers by URL have no group. Nothing here replays routes.
"""

from __future__ import annotations

import threading

from mrl.engine.launcher import Engine, engines_from_config
from mrl.engine.restart import EngineRestarter


class EngineGroup:
    def __init__(self, eng, model_path: str, *, log_dir: str, name: str, health_timeout_s: float = 600.0,
                 server_args: dict | None = None):
        """``server_args``: flags the pool's servers always get (a reward model's ``is_embedding``), under the
        ones of ``eng.server_args``."""
        self.name, self.max_restarts, self.health_timeout_s = name, eng.max_restarts, health_timeout_s
        self.engines: list[Engine] = engines_from_config(eng, model_path, log_dir=log_dir,
                                                         names=[f"{name}{i}" for i in range(eng.count)])
        for e in self.engines:
            e.return_routed_experts = False
            e.server_args = {**(server_args or {}), **e.server_args}
        self.errors: list[str] = []  # first starts that failed
        self._started = False

    def start(self) -> "EngineGroup":
        # the lock and the restarter are made here: an unstarted group crosses a process boundary pickled
        self._lock = threading.Lock()
        self._booting: set[Engine] = set()
        self._ready: list[Engine] = []
        self._replacing = 0
        self.joined_replacements = 0
        self.restarter = EngineRestarter(self.engines, self.max_restarts, self.health_timeout_s)
        self._started = True
        for e in list(self.engines):
            e.start()
            with self._lock:
                self._booting.add(e)
            threading.Thread(target=self._wait_healthy, args=(e,), name=f"{e.name}-health", daemon=True).start()
        return self

    def _wait_healthy(self, e: Engine) -> None:
        try:
            e.wait_healthy(self.health_timeout_s)
        except Exception as err:  # counted; the pool goes on with the others
            with self._lock:
                self.errors.append(f"{e.name}: {err}".splitlines()[0])
                self._booting.discard(e)
            return
        with self._lock:
            self._booting.discard(e)
            self._ready.append(e)

    def take_ready(self) -> list[str]:
        """URLs of the servers that became healthy since the last call: first starts, then replacements."""
        with self._lock:
            ready, self._ready = self._ready, []
        replacements = self.restarter.take_ready()
        self.joined_replacements += len(replacements)
        return [e.url for e in ready + replacements]

    @property
    def booting(self) -> bool:
        """A server is starting (first start or replacement) that may still become healthy."""
        with self._lock:
            return bool(self._booting) or self._replacing > 0 or (
                self.restarter.restarted > len(self.restarter.failed) + self.joined_replacements)

    def replace(self, url: str) -> int:
        """Kill the server at ``url`` (dead or hung) and start a replacement while restarts are left; returns how
        many were started (0 or 1). Blocking for the seconds the kill takes: call it off an event loop."""
        with self._lock:
            self._replacing += 1
        try:
            return len(self.restarter.replace([url]))
        finally:
            with self._lock:
                self._replacing -= 1

    @property
    def failed_starts(self) -> int:
        return len(self.errors) + (len(self.restarter.failed) if self._started else 0)

    def describe_failures(self) -> list[str]:
        return self.errors + (list(self.restarter.failed) if self._started else [])

    def close(self) -> None:
        for e in self.engines:  # replacements included: the restarter appends them to this list
            e.stop()
