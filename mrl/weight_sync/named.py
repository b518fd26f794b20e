"""HF-named tensors from any source into engines, bucket by bucket: engines started without weights
(``Engine(load_format="dummy")``) get them from a generator, with no checkpoint on disk and no model in the
pusher's memory, only one bucket at a time.

    stats = push_named(endpoints, SyntheticWeights(hf_dir, device="cuda").tensors(), version="0",
                       transport="tensor", bucket_mb=1024)

The buckets go the way the trainer's full-weight sync sends them (``tensor``: CUDA IPC handles through
``update_weights_from_tensor``, the tensor transport's payload, for engines on this host's GPUs; ``disk``:
a safetensors file per bucket, read by ``update_weights_from_disk``, which works on CPU engines too), one
bucket to every engine at once; the last one is followed by the version stamp, so an engine reports the
version only once it holds every tensor. An engine that refuses a bucket stops the push with a
``NamedPushError`` naming it and the bucket: such an engine holds part of the weights and must not serve.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from mrl.models.checkpoint import save_hf
from mrl.sglang.client import ClientTimeouts
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.tensor import serialize_named_tensors
from mrl.weight_sync.transport import run_on

TRANSPORTS = ("tensor", "disk")


class NamedPushError(RuntimeError):
    pass


@dataclass
class NamedPushStats:
    seconds: float
    bytes_sent: int
    buckets: int
    tensors: int


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` in runs of at most ``bucket_bytes`` (a larger tensor alone), in order."""
    out: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out and size + n > bucket_bytes:
            yield out
            out, size = [], 0
        out.append((name, t))
        size += n
    if out:
        yield out


def push_named(engines: list[EngineEndpoint], named: Iterable[tuple[str, torch.Tensor]], *, version: str,
               transport: str = "tensor", bucket_mb: float = 1024, export_dir: str | None = None,
               timeouts: ClientTimeouts | None = None) -> NamedPushStats:
    """Every tensor of ``named`` into every engine of ``engines``, then the weight version ``version``.
    ``disk``: each bucket is written under ``export_dir`` (a temporary directory by default; the engines
    must read it) and removed once loaded."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
    if transport == "tensor" and not torch.cuda.is_available():
        raise NamedPushError("transport=tensor needs CUDA (IPC handles of GPU tensors); use transport=disk")
    t0 = time.perf_counter()
    nbytes = count = tensors = 0
    root = export_dir or tempfile.mkdtemp(prefix="mrl_named_")
    os.makedirs(root, exist_ok=True)
    for bucket in buckets(named, int(bucket_mb * (1 << 20))):
        if transport == "tensor":
            bucket = [(n, t.contiguous()) for n, t in bucket]
            torch.cuda.current_stream().synchronize()  # the engines read the tensors on their own streams
            payload = serialize_named_tensors(bucket)

            async def call(c, payload=payload):
                tp = next(e.tp for e in engines if e.url == c.url)
                await c.update_weights_from_tensor([payload] * tp)
            failed = run_on(engines, call, timeouts=timeouts)  # answered once copied: the memory is free again
        else:
            path = os.path.join(root, f"bucket{count:05d}")
            save_hf({n: t.detach().cpu() for n, t in bucket}, path)

            async def call(c, path=path):
                await c.update_weights_from_disk(path, load_format="auto")
            failed = run_on(engines, call, timeouts=timeouts)
            shutil.rmtree(path, ignore_errors=True)
        if failed:
            raise NamedPushError(f"bucket {count} ({bucket[0][0]} .. {bucket[-1][0]}): " + "; ".join(
                f"engine {u}: {err}" for u, err in failed.items()))
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        tensors += len(bucket)
        count += 1

    async def stamp(c):
        await c.update_weight_version(version)
    failed = run_on(engines, stamp, timeouts=timeouts)
    if failed:
        raise NamedPushError(f"weight version {version}: " + "; ".join(f"engine {u}: {e}" for u, e in failed.items()))
    if export_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return NamedPushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets=count, tensors=tensors)
