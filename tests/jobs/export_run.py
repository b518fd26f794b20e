"""A short real training run for the export tests, leaving its run directory as ``mrl train`` does.

    torchrun --nproc-per-node 2 -m tests.jobs.export_run --hf DIR --parallel tp2_ep2 --run-dir RUN [--lora]

``Policy`` RL steps (resume_check's synthetic batches) in the layout, then: ``RUN/config.yaml`` (the resolved
config), ``RUN/checkpoints/step_N`` (complete: loop state written last), ``RUN/hf/final`` (``save_hf_due``, the
loop's end-of-run export from the live model), the trainer's logits on fixed ids (``RUN/logits.pt``) and, with
``--greedy K``, its greedy continuations of ``PROMPTS`` (``RUN/greedy.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from mrl.config.load import compose
from mrl.megatron.export import save_hf_due
from mrl.megatron.forward import forward_logits
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy
from mrl.trainer.state import LoopState, write_loop_state
from tests.jobs.resume_check import synthetic_batch

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 9, 11, 250, 3], [1, 64, 128]]


def fixed_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--parallel", default="tp1", help="a conf/parallel preset")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lora", action="store_true", help="train rank-4 adapters on the attention projections")
    ap.add_argument("--greedy", type=int, default=0, help="greedy continuations of PROMPTS, this many tokens")
    a = ap.parse_args(argv)

    run = os.path.abspath(a.run_dir)
    overrides = [f"model.hf_path={a.hf}", f"parallel={a.parallel}", "algo.lr=1e-2", "model.dtype=fp32",
                 "train.micro_batch_size=4", f"train.steps={a.steps}", f"run_dir={run}"]
    if a.lora:
        overrides += ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[attention]"]
    cfg = compose(overrides)
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, a.hf)
    codec, vocab = policy.codec, policy.bridge.vocab_size
    for step in range(a.steps):
        batch = synthetic_batch(step, 8, vocab, len(codec.moe_layers), codec.top_k, codec.num_experts)
        policy.rl_step(batch, float(sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))))
    path = os.path.join(run, "checkpoints", f"step_{a.steps}")
    policy.save(path)
    if layout.world_rank == 0:
        write_loop_state(path, LoopState(step=a.steps, version=a.steps))
        with open(os.path.join(run, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    dist.barrier()
    save_hf_due(cfg, policy, a.steps)  # the loop's call after its last step

    model = policy.module.eval()
    logits = forward_logits(model, layout, fixed_ids(vocab))
    greedy = []
    for p in PROMPTS if a.greedy else []:
        ids = list(p)
        for _ in range(a.greedy):
            ids.append(int(forward_logits(model, layout, torch.tensor([ids]))[0, -1, :vocab].argmax()))
        greedy.append(ids[len(p):])
    if layout.world_rank == 0:  # PP1 here: rank 0 holds the gathered logits
        torch.save(logits[..., :vocab].float().cpu(), os.path.join(run, "logits.pt"))
        if greedy:
            with open(os.path.join(run, "greedy.json"), "w") as f:
                json.dump({"prompts": PROMPTS, "greedy": greedy}, f)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
