"""One engine as every process that talks to it sees it: where it listens, and how many of its ranks join a
weight-update group.

    Engine(...).endpoint                 # the launcher's engines (and the restarter's replacements) have one
    EngineEndpoint(url, tp=2)            # an engine attached by URL (rollout.engine_urls, mrl engine nodes)
    EngineClient(endpoint)               # the rollout process and the weight sync talk to it over HTTP

The weight sync keeps a list of them on every trainer rank (narrowed by the verdict each sync broadcasts);
only rank 0 holds the processes themselves (``Engine``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    tp: int = 1
    """Engine ranks that join each weight-update group (all GPUs of the server)."""
