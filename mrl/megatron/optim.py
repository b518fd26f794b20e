"""Megatron DDP + DistributedOptimizer around a GPTModel (torch Adam backend on CPU, apex/TE fused on GPU)."""

from __future__ import annotations

import torch

from mrl.megatron import compat  # noqa: F401
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


def build_optimizer(ddp_models: list, *, lr: float, clip_grad: float = 1.0, weight_decay: float = 0.0,
                    distributed_optimizer: bool = True, bf16: bool = False):
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=distributed_optimizer),
        ddp_models,
    )
