"""The tensor transport: colocated engines get each bucket as CUDA IPC handles (``update_weights_from_tensor``).

GPU only: an SGLang server crashes on CPU tensors passed between processes, so this transport refuses to
start without CUDA and the payload builder refuses CPU tensors.
"""

from __future__ import annotations

import base64
import io
import json
import time
from multiprocessing.reduction import ForkingPickler

import torch

from mrl.models.bridge import split_full
from mrl.sglang.client import EngineClient
from mrl.weight_sync.executor import TORCH_DTYPES, BucketExecutor
from mrl.weight_sync.fp8 import quantize_checkpoint
from mrl.sglang.endpoint import EngineEndpoint
from mrl.sglang.wire import FLAT_TENSOR_FORMAT, FLAT_TENSOR_MARK
from mrl.weight_sync.transport import LoopThread, PushStats, Transport, any_rank, run_on, union_failures


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer`` format: base64 of a ForkingPickler dump of
    ``[(name, tensor)]`` -- CUDA tensors pickle as IPC handles (torch.multiprocessing's reductions)."""
    cpu = [n for n, t in named if not t.is_cuda]
    if cpu:
        raise ValueError(f"update_weights_from_tensor takes CUDA tensors only (CPU tensors crash an SGLang "
                         f"server): {cpu[:3]}")
    return pickle_named_tensors(named)


def pickle_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def flat_format(bucket) -> str:
    """The ``load_format`` of ``bucket`` sent as one flat buffer: its layout, keyed by its index (the engine
    replays the load it recorded for that key)."""
    t = bucket.tensors
    return FLAT_TENSOR_FORMAT + json.dumps(dict(key=f"ipc-{bucket.index}", names=[x.name for x in t],
                                                dtypes=[x.dtype for x in t], shapes=[list(x.shape) for x in t]))


def bucket_tensors(gathered, *, fp8_from: torch.dtype | None = None,
                   fp8_ignore: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """A gathered bucket's HF tensors as the engine loads them. ``fp8_from`` (the engines serve a block-FP8
    checkpoint): each FP8 target cast to this sync dtype, as the distributed transport stages it, and sent
    as its e4m3 weight followed by its ``weight_scale_inv``, the names and layout of a block-FP8
    checkpoint, which the model's ``load_weights`` takes as it takes the file."""
    named: list[tuple[str, torch.Tensor]] = []
    for _, pm, full in gathered:
        parts = split_full(pm, full)
        if fp8_from is not None:
            parts = quantize_checkpoint(parts, fp8_from, ignored=fp8_ignore)
        named += [(name, t.contiguous()) for name, t in parts.items()]
    return named


class TensorTransport(Transport):
    """Colocated engines: senders gather each bucket (as the distributed transport does) and post
    it as CUDA IPC handles. No collective with the engines, so any order of requests is safe.

    Engines started by mrl announce in their answers that they take a bucket as one flat buffer
    (``mrl.sglang.wire.FLAT_TENSOR_FORMAT``): from the next sync on, each bucket goes as the distributed
    transport's send buffer (the same copy plan, FP8 quantization included) and the engine loads it by
    replayed copies instead of SGLang's per-tensor ``load_weights``. Other engines (attached by URL, or
    started without mrl's patches) get the bucket's tensors one by one."""

    name = "tensor"

    def __init__(self, executor: BucketExecutor):
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.transport=tensor needs CUDA (colocated GPUs): SGLang crashes "
                               "on CPU tensors sent between processes; use transport=distributed or disk")
        self.executor = executor
        self._io = LoopThread() if executor.is_sender else None
        self.flat_engines: set[str] = set()
        """Engines whose answers announced flat buckets (``FLAT_TENSOR_MARK``)."""

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        ex = self.executor
        mine = all(e.url in self.flat_engines for e in ex.engines) if ex.is_sender else True
        if not any_rank(ex.layout, not mine):  # every rank takes the same path: both join the same gathers
            return self._push_flat()
        return self._push_tensors()

    def _post(self, payload: str, load_format: str | None = None) -> dict[str, str]:
        """One bucket to every engine (each TP rank its copy of the handles); {url: error}."""
        ex = self.executor

        async def call(c: EngineClient) -> None:
            tp = next(e.tp for e in ex.engines if e.url == c.url)
            message = await c.update_weights_from_tensor([payload] * tp, load_format=self.load_format(load_format))
            if FLAT_TENSOR_MARK in (message or ""):
                self.flat_engines.add(c.url)

        return run_on(ex.engines, call, loop=self._io)

    def _push_tensors(self) -> PushStats:
        ex = self.executor
        t0 = time.perf_counter()
        failed: dict[str, str] = {}
        sent = nbytes = 0
        for bucket in ex.order:
            gathered = ex.gather_bucket(bucket)
            if gathered is None:
                continue
            named = bucket_tensors(gathered, fp8_from=TORCH_DTYPES[ex.dtype] if ex.fp8 else None,
                                   fp8_ignore=ex.fp8_ignore)
            payload = serialize_named_tensors(named)  # tensors stay alive until every engine answered
            for url, err in self._post(payload).items():
                failed.setdefault(url, err)
            sent += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=sent,
                         failed_engines=union_failures(ex.layout, failed))

    def _push_flat(self) -> PushStats:
        """Each bucket as the copy plan fills it (``BucketExecutor.steps``), one flat buffer per
        request, answered once the engine has copied it out: the buffer is then free for a later bucket."""
        ex = self.executor
        t0 = time.perf_counter()
        failed: dict[str, str] = {}
        sent = nbytes = 0
        for step in ex.steps():
            step.fill()  # every rank: the gathers it joins
            if step.flat is None or failed:
                continue
            torch.cuda.current_stream().synchronize()  # the engines read the buffer on their own streams
            for url, err in self._post(serialize_named_tensors([("bucket", step.flat)]),
                                       flat_format(step.bucket)).items():
                failed.setdefault(url, err)
            sent += 1
            nbytes += step.flat.numel()
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=sent,
                         failed_engines=union_failures(ex.layout, failed))

    def close(self) -> None:
        if self._io is not None:
            self._io.close()
