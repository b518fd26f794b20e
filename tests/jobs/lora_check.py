"""LoRA check in one layout: a ``Policy`` with adapters started from a given (random, B != 0) PEFT adapter.

    torchrun --nproc-per-node 2 -m tests.jobs.lora_check --hf DIR --adapter A --merged M --out OUT parallel=tp2_sp

``A`` and ``M``: ``write_random_adapter`` (tests/distributed/test_lora.py, tests/gpu/lora.sh).

Reports (``OUT/report.json``, rank 0): logits and next-token logprobs against transformers on the merged
checkpoint ``M`` (W + alpha/r B A); that only adapter parameters are trainable and held by the DDP buffers
and the optimizer; one RL step (``Policy.rl_step``, replayed routes), after which the exported adapter is
written to ``OUT/adapter`` and the base weights are exported and compared bit for bit with the checkpoint.
``--ckpt CK``: a second step, then a fresh ``Policy`` loads the checkpoint saved after the first step and
repeats the second step; its adapter must be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from mrl.config.load import compose
from mrl.jobs.check_model import hf_reference
from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from mrl.megatron.weights import export_hf
from mrl.models.checkpoint import HFCheckpoint
from mrl.models.peft import save_peft
from tests.jobs.resume_check import synthetic_batch


def write_random_adapter(hf: str, root: str, *, rank: int, alpha: float, targets: list[str],
                         seed: int = 7) -> tuple[str, str]:
    """A random adapter of the checkpoint ``hf`` (A as PEFT's init, B != 0) in ``root/adapter``, and ``hf`` with
    it merged in ``root/merged``; returns both paths."""
    from mrl.config.schema import LoraConfig
    from mrl.models import get_bridge
    from mrl.models.checkpoint import save_hf
    from mrl.models.peft import merge_peft, peft_config, peft_shapes

    bridge, lora = get_bridge(hf), LoraConfig(rank=rank, alpha=alpha, targets=list(targets))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, shape in sorted(peft_shapes(bridge, lora).items()):
        if ".lora_A." in k:
            tensors[k] = torch.empty(shape).uniform_(-shape[1] ** -0.5, shape[1] ** -0.5, generator=g)
        else:
            tensors[k] = torch.randn(shape, generator=g) * 0.05
    adapter, merged = os.path.join(root, "adapter"), os.path.join(root, "merged")
    save_peft(adapter, tensors, peft_config(lora))
    ck = HFCheckpoint(hf)
    save_hf(merge_peft({k: ck.read(k) for k in ck.shapes}, tensors, peft_config(lora)), merged, config_src=hf,
            engine_config=bridge.engine_config())
    return adapter, merged


def _optimizer_params(optimizer) -> set[int]:
    ids: set[int] = set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        index = getattr(opt, "model_param_group_index_map", None)
        params = index.keys() if index is not None else [p for g in opt.param_groups for p in g["params"]]
        ids |= {id(p) for p in params}
    return ids


def _step(policy: Policy, step: int) -> dict:
    c = policy.codec
    batch = synthetic_batch(step, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
    n_tok = sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))
    m = policy.rl_step(batch, float(n_tok))
    return {k: m[k] for k in ("pg_loss", "grad_norm", "update_ok") if k in m}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--adapter", required=True, help="PEFT directory the adapters start from")
    ap.add_argument("--merged", required=True, help="HF checkpoint with the adapter merged (transformers reference)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--targets", default="attention,dense_mlp,experts")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides (parallel.tp=2 ...)")
    a = ap.parse_args(argv)

    cfg = compose([f"model.hf_path={a.hf}", f"model.lora.rank={a.rank}", f"model.lora.alpha={a.alpha}",
                   f"model.lora.targets=[{a.targets}]", f"model.lora.init_from={a.adapter}", "algo.lr=1e-3",
                   "train.micro_batch_size=4", "train.steps=10",
                   # no engine here; expert adapters are served by GPU engines only (refused for CPU ones)
                   "engine=gpu", "engine.dtype=bfloat16", *a.overrides])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, a.hf)
    rep: dict = {"layout": a.overrides}

    # only the adapters train
    module = policy.module
    adapter_ids = {id(p) for p in module.parameters() if getattr(p, "lora_adapter", False)}
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    in_buffers = {id(p) for b in policy.model.buffers + policy.model.expert_parallel_buffers for p in b.params}
    rep["adapter_params"] = len(adapter_ids)
    rep["only_adapters_trainable"] = bool(adapter_ids) and trainable == adapter_ids
    rep["only_adapters_in_ddp"] = in_buffers == adapter_ids
    # the distributed optimizer keeps the params of its DP shard; it is built over the DDP buffers (all adapters)
    in_optimizer = _optimizer_params(policy.optimizer)
    rep["only_adapters_in_optimizer"] = bool(in_optimizer) and in_optimizer <= adapter_ids

    # logits with the adapter == transformers on W + alpha/r B A
    ids = torch.randint(0, policy.bridge.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    module.eval()
    logits = forward_logits(module, layout, ids.to(compat.DEVICE))
    module.train()
    if layout.is_last_stage and layout.tp.rank == 0 and layout.dp.rank == 0:
        ref = hf_reference(a.merged, ids, torch.float32)
        base = hf_reference(a.hf, ids, torch.float32)
        v = policy.bridge.vocab_size
        mc = logits[..., :v].float().cpu()
        lp, lp_ref = token_logprobs(mc, ids, v), token_logprobs(ref, ids, v)
        rep["checker"] = {"logits_max_abs_diff": (mc - ref).abs().max().item(),
                          "logprobs_max_abs_diff": (lp - lp_ref).abs().max().item(),
                          "adapter_changes_logits": (ref - base).abs().max().item()}
    box: list = [None] * layout.world_size
    torch.distributed.all_gather_object(box, rep.pop("checker", None))
    rep |= next(x for x in box if x is not None)

    rep["step1"] = _step(policy, 0)
    exported = policy.export_lora(dst=0)
    if a.ckpt:
        policy.save(a.ckpt)
    full = export_hf(module, layout, policy.bridge, policy.padded_vocab)
    if layout.world_rank == 0:
        tensors, config = exported
        save_peft(os.path.join(a.out, "adapter"), tensors, config)
        ck = HFCheckpoint(a.hf)
        rep["base_bit_exact"] = set(full) == set(ck.shapes) and all(torch.equal(full[k], ck.read(k)) for k in full)
    if a.ckpt:
        rep["step2"] = _step(policy, 1)
        after = policy.export_lora(dst=0)
        resumed = Policy(cfg, layout, a.hf)
        resumed.load(a.ckpt)
        rep["step2_resumed"] = _step(resumed, 1)
        again = resumed.export_lora(dst=0)
        if layout.world_rank == 0:
            rep["resume_bit_identical"] = (set(after[0]) == set(again[0])
                                           and all(torch.equal(after[0][k], again[0][k]) for k in after[0]))
    if layout.world_rank == 0:
        with open(os.path.join(a.out, "report.json"), "w") as f:
            json.dump(rep, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
