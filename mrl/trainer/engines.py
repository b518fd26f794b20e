"""A run's engines, owned in one place (trainer rank 0): the servers the job starts, or those it attaches to.

    engines = RunEngines(cfg).start_early()   # mrl.jobs.train, first thing: they boot while the rank builds the model
    endpoints = engines.ready()               # Controller.start_engines: started now if not yet, then healthy
    engines.stop()                            # the run's end: every server started, replacements included
    engines.side_groups()                     # the scoring pools' servers, unstarted: the rollout process starts them

``engine.urls`` attaches to running servers; ``engine.url_dir`` waits for the servers that
``mrl engine`` announces there (cluster engine nodes); otherwise the job starts ``engine.count``
servers (``mrl.engine.launcher.start_job_engines``), early unless they share the trainer's GPUs
(``engine.memory_saver``: the trainer takes its memory first). Replacements of dead ones
(``mrl.engine.restart``) are appended to ``started``. Imports no torch: the job calls it before.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from mrl.config.schema import Config
from mrl.engine.group import EngineGroup
from mrl.engine.launcher import Engine, start_job_engines
from mrl.sglang.endpoint import EngineEndpoint

if TYPE_CHECKING:
    from mrl.cluster.engines import AnnouncedEngines

DISCOVERY_TIMEOUT_S = 900.0


class RunEngines:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.started: list[Engine] = []  # the job's servers; EngineRestarter appends replacements to this list

    @property
    def attached(self) -> bool:
        """The servers are not the job's: given by URL or announced in a directory."""
        eng = self.cfg.engine
        return bool(eng.urls or eng.url_dir)

    def start_early(self) -> "RunEngines":
        """Start the job's servers now, unless they are attached or colocated (``engine.memory_saver``)."""
        if not self.cfg.engine.memory_saver:
            self._start()
        return self

    def _start(self) -> None:
        if not self.attached and not self.started:
            self.started = start_job_engines(self.cfg)

    def ready(self) -> list[EngineEndpoint]:
        """The endpoints the run uses, once they answer: attached ones, or the job's (started here if not yet)."""
        eng = self.cfg.engine
        if self.attached:
            return [EngineEndpoint(u, eng.tp) for u in list(eng.urls) or self._discover()]
        self._start()
        for e in self.started:
            e.wait_healthy()
        return [e.endpoint for e in self.started]

    def _discover(self) -> list[str]:
        """Engines announced by ``mrl engine`` on cluster engine nodes (``<dir>/<name>.url``)."""
        from mrl.cluster.engines import job_addresses, read_urls

        eng = self.cfg.engine
        allowed = job_addresses()
        deadline = time.time() + DISCOVERY_TIMEOUT_S
        while time.time() < deadline:
            found = list(read_urls(eng.url_dir, allowed).values())
            if len(found) >= eng.count:
                return found[:eng.count]
            time.sleep(2)
        raise TimeoutError(f"engine.url_dir={eng.url_dir}: fewer than {eng.count} engines "
                           "announced themselves within 15 min")

    def side_groups(self) -> dict[str, EngineGroup | AnnouncedEngines]:
        """The servers of the scoring pools (teacher, PRM, reference, judge, reward model, unless given by URL),
        by pool name, not started: the rollout process, which calls them, starts them and owns their processes.
        Reward model servers start on SGLang's classification path (``--is-embedding``). A pool on Slurm nodes
        of its own (``nodes``) gets the servers its nodes announce in its ``engine.url_dir`` instead."""
        from mrl.cluster.engines import AnnouncedEngines

        logs, out = os.path.join(self.cfg.run_dir, "engines"), {}
        for name, p in self.cfg.scoring.pools.items():
            if p.engine.url_dir:
                out[name] = AnnouncedEngines(p.engine.url_dir, p.engine.count, name=name,
                                             health_timeout_s=p.health_timeout_s)
            elif not p.engine.urls:
                out[name] = EngineGroup(p.engine, p.model_path(self.cfg.model.hf_path), log_dir=logs, name=name,
                                        health_timeout_s=p.health_timeout_s, server_args=p.SERVER_ARGS)
        return out

    def stop(self) -> None:
        for e in self.started:
            e.stop()
