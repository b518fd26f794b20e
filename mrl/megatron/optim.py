"""Megatron DDP + DistributedOptimizer around a GPTModel (torch Adam backend on CPU, apex/TE fused on GPU)."""

from __future__ import annotations

import torch

from mrl._compat.te import HAVE_TE
from mrl.megatron import compat
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig


def wrap_ddp(model: torch.nn.Module, cfg: TransformerConfig, *, distributed_optimizer: bool = True):
    ddp = DistributedDataParallel(
        config=cfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        ),
        module=model,
    )
    # the schedules call these: grad all-reduce over DP, SP/q-k norm grads over TP, embedding ties
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return ddp


def optimizer_config(*, lr: float, clip_grad: float = 1.0, weight_decay: float = 0.0,
                     distributed_optimizer: bool = True, bf16: bool = False,
                     states_dtype: torch.dtype = torch.float32) -> OptimizerConfig:
    """Adam as megatron configures it. ``states_dtype=bfloat16``: megatron's precision-aware optimizer
    (TE's FusedAdam) keeps both moments in bf16 and, for bf16 params, only the 16 low bits of the
    fp32 master weights: 6 bytes per parameter of its shard instead of 12 (``mrl.megatron.memory``), what
    lets a 30B-class MoE slice train on one GPU."""
    precision_aware = states_dtype != torch.float32
    if precision_aware and not (HAVE_TE and compat.HAS_CUDA):
        raise ValueError("train.optimizer_states_dtype=bf16 needs Transformer Engine's FusedAdam on a GPU "
                         "(megatron's precision-aware optimizer); use fp32 here")
    return OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16,
                           params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=distributed_optimizer,
                           use_precision_aware_optimizer=precision_aware, exp_avg_dtype=states_dtype,
                           exp_avg_sq_dtype=states_dtype)


def build_optimizer(ddp_models: list, **kw):
    """``get_megatron_optimizer`` over ``ddp_models`` with ``optimizer_config(**kw)``."""
    return get_megatron_optimizer(optimizer_config(**kw), ddp_models)
