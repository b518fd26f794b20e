"""The disk transport: safetensors export + ``update_weights_from_disk`` (and the repair path of the others)."""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from mrl.megatron.parallel import Layout
from mrl.megatron.weights import export_hf
from mrl.models.bridge import ModelBridge
from mrl.models.checkpoint import save_hf
from mrl.sglang.endpoint import EngineEndpoint
from mrl.quant.export import quantization_config
from mrl.weight_sync.fp8 import quantize_checkpoint
from mrl.weight_sync.transport import PushStats, Transport, run_on


class DiskTransport(Transport):
    """safetensors export on rank 0 (``export_dir/v<version>``) + ``update_weights_from_disk``.

    ``export_dir`` must be readable by the engines (a shared file system on clusters). Only the
    ``keep`` newest exports are kept."""

    name = "disk"

    def __init__(self, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int,
                 engines: list[EngineEndpoint], export_dir: str | None, config_src: str, keep: int = 2,
                 fp8_dtype: torch.dtype | None = None, fp8_ignore: tuple[str, ...] = ()):
        """``fp8_dtype``: the engines serve a block-FP8 checkpoint (``engine.quantization=fp8``), so each export
        is one, its targets (but ``fp8_ignore``'s modules) cast to this dtype (the sync dtype) and quantized
        (``quantize_checkpoint``)."""
        self.model, self.layout, self.bridge, self.vp = model, layout, bridge, padded_vocab
        self.engines, self.config_src, self.keep = engines, config_src, keep
        self.fp8_dtype, self.fp8_ignore = fp8_dtype, tuple(fp8_ignore)
        self.export_dir = export_dir or tempfile.mkdtemp(prefix="mrl_weights_")
        self.last_path: str | None = None

    def export(self, version: str) -> str | None:
        """Collective: the full HF checkpoint of the current weights on rank 0 (its path there)."""
        tensors = export_hf(self.model, self.layout, self.bridge, self.vp)
        if self.layout.world_rank != 0:
            return None
        path = os.path.join(self.export_dir, f"v{version}")
        extra = None
        if self.fp8_dtype is not None:
            extra = {"quantization_config": quantization_config(sorted(tensors), self.fp8_ignore)}
            tensors = quantize_checkpoint(tensors, self.fp8_dtype, ignored=self.fp8_ignore)
        save_hf(tensors, path, config_src=self.config_src, engine_config=extra)
        self.last_path = path
        olds = sorted((d for d in os.listdir(self.export_dir) if d.startswith("v") and d != f"v{version}"),
                      key=lambda d: os.path.getmtime(os.path.join(self.export_dir, d)))
        for d in olds[:max(0, len(olds) - self.keep + 1)]:
            import shutil

            shutil.rmtree(os.path.join(self.export_dir, d), ignore_errors=True)
        return path

    def push(self, version: str, engines: list[EngineEndpoint] | None = None) -> PushStats:
        t0 = time.perf_counter()
        path = self.export(version)
        failed: dict[str, str] = {}
        nbytes = 0
        if self.layout.world_rank == 0:
            nbytes = os.path.getsize(os.path.join(path, "model.safetensors"))
            # no flush after the load: a sync that aborts flushed at its pause, and one that keeps requests in
            # the engine (retract / in_place) must not flush at all (SGLang's scheduler asserts it succeeded)
            failed = run_on(engines or self.engines,
                             lambda c: c.update_weights_from_disk(path, weight_version=version, flush_cache=False,
                                                                  load_format=self.load_format(None)))
        box = [failed]
        dist.broadcast_object_list(box, src=0)
        return PushStats(seconds=time.perf_counter() - t0, bytes_sent=nbytes, buckets_sent=1,
                         failed_engines=box[0])
