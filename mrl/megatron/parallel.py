"""Distributed init and the trainer's process groups, built once and passed down explicitly.

megatron-core keeps its groups in ``parallel_state``; mrl reads them once into a ``Layout`` and hands
that object to the loader, exporter and (later) the trainer, instead of querying globals everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mrl.config.schema import ParallelConfig
from mrl.megatron import compat  # noqa: F401  (must precede megatron imports)
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel


@dataclass(frozen=True)
class GroupInfo:
    group: dist.ProcessGroup | None
    rank: int
    size: int


@dataclass(frozen=True)
class Layout:
    """This rank's place in the trainer layout."""

    config: ParallelConfig
    world_rank: int
    world_size: int
    tp: GroupInfo
    pp: GroupInfo
    dp: GroupInfo
    ep: GroupInfo
    etp: GroupInfo
    edp: GroupInfo
    cp: GroupInfo = GroupInfo(None, 0, 1)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1


def init_distributed(timeout_s: float = 300.0) -> None:
    """Start torch.distributed from torchrun's environment (or as a single process without it)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if compat.HAS_CUDA:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # the weight-update groups with SGLang engines fail ("Cuda failure 'invalid argument'") on some
        # hosts when NCCL backs its buffers with cuMem; NCCL reads this once, at its first communicator
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    # a timeout on every collective: a dead peer surfaces as an error instead of a hang
    dist.init_process_group(backend=compat.BACKEND, timeout=timedelta(seconds=timeout_s))


def init_parallel(cfg: ParallelConfig, *, seed: int = 1234) -> Layout:
    """Validate the layout against the world size and build megatron's groups."""
    init_distributed(cfg.collective_timeout_s)
    cfg.check_world_size(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # CPU generator under compat
    return Layout(
        config=cfg,
        world_rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp=GroupInfo(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
                     ps.get_tensor_model_parallel_world_size()),
        pp=GroupInfo(ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size()),
        dp=GroupInfo(ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        ep=GroupInfo(ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank(),
                     ps.get_expert_model_parallel_world_size()),
        etp=GroupInfo(ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(),
                      ps.get_expert_tensor_parallel_world_size()),
        edp=GroupInfo(ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_rank(),
                      ps.get_expert_data_parallel_world_size()),
        cp=GroupInfo(ps.get_context_parallel_group(), ps.get_context_parallel_rank(),
                     ps.get_context_parallel_world_size()),
    )


def destroy() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
