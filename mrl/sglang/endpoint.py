"""One engine as every process that talks to it sees it: where it listens, and how many of its ranks join a
weight-update group.

    Engine(...).endpoint                 # the launcher's engines (and the restarter's replacements) have one
    EngineEndpoint(url, tp=2)            # an engine attached by URL (engine.urls, mrl engine nodes)
    EngineClient(endpoint)               # the rollout process and the weight sync talk to it over HTTP

The weight sync keeps a list of them on every trainer rank (narrowed by the verdict each sync broadcasts);
only rank 0 holds the processes themselves (``Engine``). The address helpers say where an engine binds
and which local address reaches one (the weight-update group's rendezvous).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    tp: int = 1
    """Engine ranks that join each weight-update group (all GPUs of the server)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def route_address(peer: str) -> str:
    """This node's address on the interface the kernel routes to ``peer`` (a host name or address) by."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


def interface_address(peer: str | None = None) -> str:
    """This node's address on the interface that reaches ``peer`` (default: the address its hostname
    resolves to, loopback excluded): where a cluster engine binds so that only the job's network reaches
    it, instead of 0.0.0.0. ``$MRL_ENGINE_HOST`` overrides."""
    if os.environ.get("MRL_ENGINE_HOST"):
        return os.environ["MRL_ENGINE_HOST"]
    if peer:
        return route_address(peer)
    for *_, addr in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
        if not addr[0].startswith("127."):
            return addr[0]
    raise RuntimeError(f"{socket.gethostname()} resolves only to loopback: "
                       "set MRL_ENGINE_HOST to this node's address")
