"""What megatron allocates for a rank's model states, beside what ``mrl.megatron.memory`` estimates, for
several checkpoints and layouts in one torchrun launch (or in-process, one rank).

    torchrun --nproc-per-node 2 -m tests.jobs.memory_states --out rows.jsonl \\
        --cases "tiny:tp=2" "tiny:ep=2:bf16" "deepseek_v3:tp=2" --ckpts tiny=DIR deepseek_v3=DIR

Each case builds the model (CPU, megatron's local spec), wraps it in mrl's DDP, builds mrl's distributed
optimizer (fp32 Adam states: the precision-aware bf16 states need Transformer Engine on a GPU) and
initialises its states without a step. One row per rank and case: the measured and estimated numbers.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mrl.config.schema import DType, ParallelConfig


def _optimizers(opt) -> list:
    return list(getattr(opt, "chained_optimizers", [opt]))


def measure(model, ddp, opt, layout) -> dict:
    """The rank's parameter elements (dense, routed experts), DDP buffers and optimizer states, as built."""
    from mrl.megatron.weights import local_params

    params = [lp for lp in local_params(model, layout) if isinstance(lp.param, torch.nn.Parameter)]
    out = dict(dense_params=sum(lp.param.numel() for lp in params if not lp.is_expert),
               expert_params=sum(lp.param.numel() for lp in params if lp.is_expert),
               dense_buffer=sum(b.numel for b in ddp.buffers),
               expert_buffer=sum(b.numel for b in ddp.expert_parallel_buffers),
               weights_bytes=sum(b.param_data.nbytes for b in [*ddp.buffers, *ddp.expert_parallel_buffers]),
               grads_bytes=sum(b.grad_data.nbytes for b in [*ddp.buffers, *ddp.expert_parallel_buffers]),
               grad_dtypes=sorted({str(b.grad_data.dtype) for b in [*ddp.buffers, *ddp.expert_parallel_buffers]}),
               dense_optimizer=0, expert_optimizer=0, optimizer_bytes=0)
    for o in _optimizers(opt):
        o.init_state_fn(o.optimizer, o.config)  # the states a first step would create, without the step
        moments = [s["exp_avg"] for s in o.optimizer.state.values()]
        masters = [t for g in o.shard_fp32_from_float16_groups for t in g]  # fp32 copies of bf16 params
        expert = any(not getattr(p, "allreduce", True) for b in o.buffers for p in b.params)
        out["expert_optimizer" if expert else "dense_optimizer"] += sum(t.numel() for t in moments)
        out["optimizer_bytes"] += sum(t.nbytes for s in o.optimizer.state.values() for t in s.values()
                                      if torch.is_tensor(t)) + sum(t.nbytes for t in masters)
    return out


def check_case(ckpt: str, layout_text: str, dtype: str) -> dict:
    """Build, wrap and measure one case on this rank; the estimate for its layout beside it."""
    from mrl.jobs.common import load_model
    from mrl.megatron.memory import stage_model_states
    from mrl.megatron.optim import build_optimizer, wrap_ddp
    from tests.jobs.parity import parse_layout

    a = parse_layout(layout_text, ckpt)
    a.dtype = dtype
    m = load_model(a)
    ddp = wrap_ddp(m.model, m.cfg)
    opt = build_optimizer([ddp], lr=1e-3, bf16=dtype == "bf16")
    got = measure(m.model, ddp, opt, m.layout)
    pcfg = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, pp_first_layers=a.pp_first)
    # megatron's local spec: what runs on CPU (MLA's down projections are TP-split there)
    est = stage_model_states(m.bridge, pcfg, stage=m.layout.pp.rank, world_size=m.layout.world_size,
                             dtype=DType(dtype), optimizer_states_dtype=DType.fp32, padded_vocab=m.padded_vocab,
                             local_spec=True)
    return dict(rank=m.layout.world_rank, pp_rank=m.layout.pp.rank, dp=m.layout.dp.size, edp=m.layout.edp.size,
                got=got, est=est)


def check_lora_case(ckpt: str, layout_text: str, dtype: str, lora) -> dict:
    """One LoRA case on this rank (``lora``: a ``LoraConfig``): the frozen base, the adapters in DDP's buffers
    and the optimizer's states as built, beside ``lora_state_bytes``."""
    from mrl.jobs.common import load_model
    from mrl.megatron.lora import apply_lora
    from mrl.megatron.memory import lora_state_bytes
    from mrl.megatron.optim import build_optimizer, wrap_ddp
    from tests.jobs.parity import parse_layout

    a = parse_layout(layout_text, ckpt)
    a.dtype = dtype
    m = load_model(a)
    apply_lora(m.model, m.layout, m.bridge, lora, seed=0)
    ddp = wrap_ddp(m.model, m.cfg)
    opt = build_optimizer([ddp], lr=1e-3, bf16=dtype == "bf16")
    params = list(m.model.parameters())
    buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]
    got = dict(base_params=sum(p.numel() for p in params if not getattr(p, "lora_adapter", False)),
               adapter_params=sum(p.numel() for p in params if getattr(p, "lora_adapter", False)),
               adapter_buffer=sum(b.numel for b in buffers),
               trainable=sum(p.numel() for p in params if p.requires_grad),
               base_bytes=sum(p.nbytes for p in params if not getattr(p, "lora_adapter", False)),
               adapters_bytes=sum(b.param_data.nbytes for b in buffers),
               grads_bytes=sum(b.grad_data.nbytes for b in buffers), adapter_optimizer=0, optimizer_bytes=0)
    for o in _optimizers(opt):
        o.init_state_fn(o.optimizer, o.config)
        got["adapter_optimizer"] += sum(s["exp_avg"].numel() for s in o.optimizer.state.values())
        got["optimizer_bytes"] += sum(t.nbytes for s in o.optimizer.state.values() for t in s.values()
                                      if torch.is_tensor(t)) + sum(t.nbytes for g in o.shard_fp32_from_float16_groups
                                                                   for t in g)
    pcfg = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, pp_first_layers=a.pp_first)
    est = lora_state_bytes(m.bridge, pcfg, lora, dtype=DType(dtype), optimizer_states_dtype=DType.fp32,
                           padded_vocab=m.padded_vocab, world_size=m.layout.world_size, local_spec=True)
    return dict(rank=m.layout.world_rank, got=got, est=est)


def main() -> None:
    from mrl.megatron.parallel import destroy
    from tests.conftest import write_every_ranks_rows

    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpts", nargs="+", required=True, help="preset=DIR each")
    ap.add_argument("--cases", nargs="+", required=True, help="preset:layout[:dtype] each")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ckpts = dict(c.split("=", 1) for c in a.ckpts)
    rows = []
    for case in a.cases:
        preset, layout_text, *dt = case.split(":")
        rows.append(dict(check_case(ckpts[preset], layout_text, dt[0] if dt else "fp32"), case=case))
    write_every_ranks_rows(rows, a.out)
    destroy()


if __name__ == "__main__":
    sys.exit(main())
