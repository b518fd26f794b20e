"""Collectives that fail with a message naming the operation, the group and the peers waited for.

gloo reports a hang as ``Timed out waiting 300000ms for recv operation to complete`` and a dead peer as
``Connection closed by peer [127.0.0.1]:41234`` (NCCL similarly): neither says which collective, which
group or which rank. Every collective still times out by itself (the group's timeout, set at creation);
``named`` only rewrites the error:

    with named("broadcast of the step-3 batch", src=0):
        dist.broadcast_object_list(box, src=0)
    # CollectiveError: rank 1: broadcast of the step-3 batch over the world group (ranks [0, 1]) timed out
    # after 300.0 s (the group's limit: 300 s), waiting for rank 0: [.../unbound_buffer.cc:78] Timed out ...
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective that timed out or lost a peer."""


def group_timeout(group: dist.ProcessGroup | None = None) -> float | None:
    """The group's collective timeout in seconds (None if the backend does not say)."""
    pg = group or dist.distributed_c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError):
            continue
    return None


def describe(op: str, *, seconds: float, cause: BaseException, src: int | None = None,
             group: dist.ProcessGroup | None = None) -> str:
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    name = "the world group" if group is None or group is dist.group.WORLD else f"group {group.group_name!r}"
    limit = group_timeout(group)
    timed_out = "timed out" in str(cause).lower() or (limit is not None and seconds >= 0.95 * limit)
    what = f"timed out after {seconds:.1f} s" if timed_out else f"failed after {seconds:.1f} s (a peer died?)"
    peers = f"rank {src}" if src is not None and src != me else f"ranks {[r for r in ranks if r != me]}"
    limit_s = f" (the group's limit: {limit:.0f} s)" if limit is not None else ""
    return f"rank {me}: {op} over {name} (ranks {ranks}) {what}{limit_s}, waiting for {peers}: {cause}"


@contextlib.contextmanager
def named(op: str, *, src: int | None = None, group: dist.ProcessGroup | None = None):
    """Re-raise a failed collective inside as ``CollectiveError`` naming ``op``, the group and the peers
    (``src`` for rooted collectives)."""
    t0 = time.monotonic()
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # DistBackendError, DistStoreError and gloo's plain RuntimeErrors
        raise CollectiveError(describe(op, seconds=time.monotonic() - t0, cause=e, src=src, group=group)) from e


def broadcast_object(obj, src: int = 0, what: str = "a loop object"):
    """``obj`` from rank ``src`` on every rank (pickled; small loop objects only). A hang or a dead rank
    fails naming the op and the peer."""
    box = [obj]
    with named(f"broadcast of {what}", src=src):
        dist.broadcast_object_list(box, src=src)
    return box[0]
