"""The factory of transports: the configured one and the disk transport that repairs it.

    transport, disk = make_transport(WeightTransport.distributed, model=..., layout=..., bridge=..., ...)
    channel = FullWeightChannel(transport, disk, layout, engines, rebuild=...)
"""

from __future__ import annotations

import torch

from mrl.config.schema import WeightTransport
from mrl.megatron.parallel import Layout
from mrl.models.bridge import ModelBridge
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.disk import DiskTransport
from mrl.weight_sync.distributed import DistributedTransport
from mrl.weight_sync.executor import BucketExecutor
from mrl.weight_sync.tensor import TensorTransport
from mrl.weight_sync.transport import Transport


def make_transport(kind: WeightTransport, *, model: torch.nn.Module, layout: Layout, bridge: ModelBridge,
                   padded_vocab: int, engines: list[EngineEndpoint], bucket_bytes: int, export_dir: str | None,
                   config_src: str, dtype: str = "float32", timeout_s: float = 300.0,
                   group_prefix: str = "mrl", fp8: bool = False, fp8_ignore: tuple[str, ...] = (),
                   **executor_kw) -> tuple[Transport, Transport]:
    """The configured transport and the disk transport that repairs it (the same object for disk). ``fp8``:
    the engines serve block-FP8 weights (``engine.quantization=fp8``), with ``fp8_ignore``'s modules in
    high precision (``engine.fp8_ignore``); every transport sends them so."""
    disk = DiskTransport(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab, engines=engines,
                         export_dir=export_dir, config_src=config_src, fp8_dtype=getattr(torch, dtype) if fp8 else None,
                         fp8_ignore=fp8_ignore)
    if kind == WeightTransport.disk:
        return disk, disk
    ex = BucketExecutor(model=model, layout=layout, bridge=bridge, padded_vocab=padded_vocab, engines=engines,
                        bucket_bytes=bucket_bytes, dtype=dtype, timeout_s=timeout_s, group_prefix=group_prefix,
                        fp8=fp8, fp8_ignore=fp8_ignore, **executor_kw)
    if kind == WeightTransport.tensor:
        return TensorTransport(ex), disk
    return DistributedTransport(ex), disk
