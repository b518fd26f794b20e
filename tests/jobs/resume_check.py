"""Resume check: RL steps after a checkpoint + restart are bit-identical to an uninterrupted run.

    torchrun --nproc-per-node 2 -m tests.jobs.resume_check --hf DIR --parallel ep2 --steps 4 --out a.json
    torchrun ... --steps 4 --stop-after 2 --ckpt CK --out b1.json      # saves after step 2
    torchrun ... --steps 4 --resume CK --out b2.json                   # loads, runs steps 3-4

Each step trains ``Policy.rl_step`` (replayed routes, GRPO loss, DistributedOptimizer, LR schedule)
on a batch that is a pure function of the step index, so any difference after the restart comes
from what the checkpoint failed to restore (weights, Adam moments and step counts, scheduler, RNG).
Per step: loss, grad norm and exact float64 checksums of this rank's parameters.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mrl.config.load import compose
from mrl.megatron.parallel import destroy, init_parallel
from mrl.megatron.policy import Policy, RLBatch


def synthetic_batch(step: int, n: int, vocab: int, moe_layers: int, top_k: int, experts: int) -> RLBatch:
    g = np.random.default_rng(1000 + step)
    tokens, plens, behav, adv, routes = [], [], [], [], []
    for _ in range(n):
        p, r = int(g.integers(3, 6)), int(g.integers(2, 7))
        tokens.append(g.integers(3, vocab, p + r).tolist())
        plens.append(p)
        behav.append((-g.random(r) * 3).tolist())
        adv.append(float(g.normal()))
        routes.append(np.stack([g.permutation(experts)[:top_k] for _ in range((p + r - 1) * moe_layers)])
                      .reshape(p + r - 1, moe_layers, top_k).astype(np.uint8))
    return RLBatch(tokens=tokens, prompt_lens=plens, behav_logp=behav, advantages=adv, routes=routes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--parallel", default="ep2", help="a conf/parallel preset")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--ckpt", default=None, help="save here after --stop-after")
    ap.add_argument("--resume", default=None, help="load this checkpoint first")
    ap.add_argument("--dtype", default="fp32", help="model.dtype (bf16 on GPUs)")
    ap.add_argument("--optimizer-checkpoint", default="dp_reshardable", help="train.optimizer_checkpoint")
    ap.add_argument("--async-save", action="store_true",
                    help="save asynchronously (train.async_save), then train one more step while the writer "
                         "runs: the checkpoint must hold the weights of the step it was scheduled at")
    ap.add_argument("--out", required=True)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        print(json.dumps(compare(argv[1]), indent=1))
        return 0
    a = ap.parse_args(argv)

    cfg = compose([f"model.hf_path={a.hf}", f"parallel={a.parallel}", "algo.lr=1e-3", f"model.dtype={a.dtype}",
                   "train.micro_batch_size=4", "train.lr_warmup_steps=2", "train.steps=10",
                   f"train.optimizer_checkpoint={a.optimizer_checkpoint}"])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, a.hf)
    start = 0
    if a.resume:
        policy.load(a.resume)
        with open(f"{a.resume}/step") as f:
            start = int(f.read())
    codec = policy.codec
    rows = []
    for step in range(start, a.steps):
        batch = synthetic_batch(step, 8, policy.bridge.vocab_size, len(codec.moe_layers), codec.top_k,
                                codec.num_experts)
        n_tok = sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))
        m = policy.rl_step(batch, float(n_tok))
        params = [p.detach().double() for p in policy.module.parameters()]
        rows.append({"step": step + 1, "pg_loss": m.get("pg_loss"), "grad_norm": m["grad_norm"], "lr": m["lr"],
                     "sum": float(sum(p.sum() for p in params)), "sumsq": float(sum((p * p).sum() for p in params))})
        if a.stop_after is not None and step + 1 == a.stop_after:
            if a.async_save:
                save_async_then_train_on(policy, a.ckpt, step + 1, codec)
            else:
                policy.save(a.ckpt)
            if layout.world_rank == 0:
                open(f"{a.ckpt}/step", "w").write(str(step + 1))
            break
    with open(f"{a.out}.rank{layout.world_rank}", "w") as f:
        json.dump(rows, f)
    destroy()
    return 0


def save_async_then_train_on(policy: Policy, path: str, step: int, codec) -> None:
    """Schedule an asynchronous save of ``step``, change every weight with one more RL step while its writer
    runs, then complete it; fails unless it completed, and after the extra step."""
    from mrl.trainer.async_save import AsyncCheckpoints
    from mrl.trainer.state import LoopState

    completed = []
    saves = AsyncCheckpoints(lambda p, state: completed.append((p, state.step)))
    saves.schedule(policy.save(path, async_save=True), path, LoopState(step=step, version=0))
    batch = synthetic_batch(10_000, 8, policy.bridge.vocab_size, len(codec.moe_layers), codec.top_k,
                            codec.num_experts)
    policy.rl_step(batch, float(sum(len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens))))
    assert not completed, "completed before it was finalized"
    done = saves.finalize(blocking=True)
    assert [p for p, _ in done] == [path] and completed == [(path, step)], (done, completed)


def compare(out_dir: str) -> dict:
    """``tests/gpu/resume.sh``'s verdict over runs ``a`` and ``control`` (uninterrupted) and ``b1`` + ``b2``
    (stopped after step 2, resumed in a new process): per rank, whether the resumed rows equal ``a``'s
    exactly, whether the control does (the kernels' own determinism), and the largest relative
    difference of each against ``a`` (losses, grad norms, parameter checksums)."""
    import glob

    ranks = len(glob.glob(f"{out_dir}/a.rank*"))

    def rows(name):
        return [json.load(open(f"{out_dir}/{name}.rank{r}")) for r in range(ranks)]

    def rel(x: list[dict], y: list[dict]) -> float:
        worst = 0.0
        for rx, ry in zip(x, y):
            for k in ("pg_loss", "grad_norm", "sum", "sumsq"):
                u, v = rx.get(k), ry.get(k)
                if u is not None and v is not None:
                    worst = max(worst, abs(u - v) / max(abs(u), abs(v), 1e-30))
        return worst

    a, control, b = rows("a"), rows("control"), [x + y for x, y in zip(rows("b1"), rows("b2"))]
    steps_ok = all([r["step"] for r in rank] == [r["step"] for r in a[0]] for rank in b)
    return {"steps_resumed": steps_ok,
            "resumed_bit_identical": steps_ok and b == a, "control_bit_identical": control == a,
            "resumed_max_rel_diff": max(rel(x, y) for x, y in zip(b, a)),
            "control_max_rel_diff": max(rel(x, y) for x, y in zip(control, a)),
            "weights_changed": a[0][0]["sum"] != a[0][-1]["sum"]}


if __name__ == "__main__":
    sys.exit(main())
