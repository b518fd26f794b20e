"""How the trainer's weights reach the engines."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from mrl.config.base import fail


class WeightTransport(str, enum.Enum):
    distributed = "distributed"  # update_weights_from_distributed: NCCL (GPU) / gloo (CPU) broadcast
    disk = "disk"  # safetensors export + update_weights_from_disk (also the repair path)
    tensor = "tensor"  # colocated GPUs: CUDA IPC handles via update_weights_from_tensor


class PauseMode(str, enum.Enum):
    """How a sync pauses the engines (SGLang's ``/pause_generation`` modes)."""

    abort = "abort"  # requests in flight return their partial output and resume afterwards as new requests
    retract = "retract"  # requests stay open; their KV cache is dropped and recomputed with the new weights
    in_place = "in_place"  # requests stay open and keep their KV cache, computed with the older weights
    staged = "staged"  # no pause: the engines load the push while generating, then swap it in between two forwards


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Trainer -> engine weight sync."""

    transport: WeightTransport = WeightTransport.distributed
    pause_mode: PauseMode = PauseMode.abort
    """What a sync does to the requests in flight. ``abort``: they are aborted and the engines' caches flushed;
    each sample resumes as prompt + partial output, re-prefilled with the new weights. ``retract``: they stay
    in the engine, their KV cache is dropped and recomputed with the new weights when generation continues
    (no abort round trip, no resubmission). ``in_place``: they stay in the engine with their KV cache, computed
    with the older weights; the next forward pass uses the new weights. ``staged``: as ``in_place``, but the engines
    keep generating during the push (received into a second copy of their weights) and pause only for the swap
    between two forward passes; transports disk and tensor, engines started by mrl, not FP8, memory for a second
    copy of the weights per engine GPU (GPU engines are refused until a GPU run confirms the version tags). Every
    token is tagged with the version of the weights whose forward pass produced it in every mode
    (docs/weight_sync.md#pause-modes)."""
    bucket_mb: float = 512
    """Upper bound of one streamed bucket (a single larger tensor gets a bucket of its own)."""
    every_n_steps: int = 1
    """Push new weights to the engines after every N optimizer steps."""
    export_dir: Optional[str] = None
    """Where the disk transport / repair path writes safetensors (engines must read it); null = run_dir/weights."""
    timeout_s: float = 300.0
    """Limit for each weight-update collective and HTTP call."""
    probe_timeout_s: float = 15.0
    """Limit of the liveness probe (``GET /model_info``) that tells a hung engine from a slow one: one that
    fails a sync step, does not answer a control call within a second, or has had rollout requests in flight
    this long without answering any, is probed; no answer within this limit (or a 5xx to each of 3 probes)
    and it is dropped like a killed one -- its requests resume on the others, the job's own engines are
    killed and replaced (``engine.max_restarts``)."""
    verify: Optional[bool] = None
    """After every sync, compare engine and trainer logprobs of a fixed probe (both routing naturally); over
    ``verify_tol`` stops the run naming the engines. null = on for float32 engines, off for bf16/fp16 ones,
    whose natural routing flips experts on near ties and makes a max-difference probe unreliable."""
    verify_tol: float = 1e-3
    """Max abs logprob difference the probe accepts (fp32); bf16 runs need ~0.1."""
    master_address: Optional[str] = None
    """The address engines dial to join a trainer rank's weight-update group (the rank hosts its store).
    null = each sending rank's own address on the interface that routes to the engines, which is right on
    one node and across nodes; set it only when that route is not the one engines can reach it by."""

    @property
    def keeps_requests(self) -> bool:
        """A sync leaves the requests in flight in the engines (retract / in_place / staged): no drain around it, and
        one request's tokens may come from several versions."""
        return self.pause_mode != PauseMode.abort

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            fail("weight_sync.bucket_mb", f"must be > 0, got {self.bucket_mb}")
        if self.every_n_steps < 1:
            fail("weight_sync.every_n_steps", f"must be >= 1, got {self.every_n_steps}")
        if self.timeout_s <= 0:
            fail("weight_sync.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.probe_timeout_s <= 0:
            fail("weight_sync.probe_timeout_s", f"must be > 0, got {self.probe_timeout_s}")
