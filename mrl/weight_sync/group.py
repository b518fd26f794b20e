"""Trainer side of SGLang's weight-update process group.

SGLang 0.5.10 joins ``init_weights_update_group`` through a ``tcp://master:port`` rendezvous whose
store is wrapped in ``PrefixStore(group_name)`` and builds the group outside the default world; the
trainer must do exactly the same as rank 0 (it hosts the TCP store). This mirrors that rendezvous
with torch's own c10d helpers (the trainer never imports SGLang).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world


def create_sender_group(*, master_address: str, master_port: int, world_size: int, group_name: str,
                        backend: str, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Rank 0 of a new group with the engines' ranks; blocks until every engine rank has joined."""
    timeout = timedelta(seconds=timeout_s)
    # Host the store ourselves: torch's tcp:// rendezvous would defer to the torchrun agent's store
    # (TORCHELASTIC_USE_AGENT_STORE) inside trainer ranks, where nobody serves this port.
    store = TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, 0, [], dist.Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_sender_group(pg: dist.ProcessGroup) -> None:
    dist.destroy_process_group(pg)


def abort_sender_group(pg: dist.ProcessGroup) -> None:
    """Tear the group down after a failed broadcast. Closing the sender's connections is what frees the
    engines: one still waiting in the group (for this bucket, or the next one it was told to expect)
    gets a connection error at once and answers its update request with a failure, instead of blocking
    in its receive until SGLang's default 30-minute group timeout (0.5.10 takes no timeout for it)."""
    if pg.name() and dist.get_backend(pg) == "nccl":  # a hung NCCL communicator's destroy could wait on its peers
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(pg)
        return
    destroy_sender_group(pg)
