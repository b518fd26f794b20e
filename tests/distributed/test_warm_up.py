"""``train.warmup_pass`` leaves no trace in training: two RL steps after the warm-up pass give the same
metrics and bit-identical weights and module buffers as two RL steps without it, while the pass itself did
run a backward (non-zero gradients). Real megatron on 2 gloo ranks, ``parallel=ep2`` (the experts'
all-to-all and the DP gradient reduction take part), the GLM-4.5 tiny preset (shared expert, a dense
layer, a router with megatron's expert bias buffer)."""

from __future__ import annotations

import hashlib
import json
import sys

from tests.conftest import run_torchrun


def test_warm_up_pass_leaves_no_trace(ckpt_dir, tmp_path):
    res = {}
    for warm in (0, 1):
        out = tmp_path / f"warm{warm}.json"
        r = run_torchrun("tests.distributed.test_warm_up", [ckpt_dir["glm4_moe"], str(tmp_path), str(out), str(warm)],
                         2, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        res[warm] = [json.loads((tmp_path / f"warm{warm}.json.rank{k}").read_text()) for k in (0, 1)]
    for rank in (0, 1):
        cold, warm = res[0][rank], res[1][rank]
        assert warm["pass"]["grad_abs_sum"] > 0, warm["pass"]
        assert cold["steps"] == warm["steps"]  # every metric of both steps, exactly
        assert cold["weights"] == warm["weights"] and cold["buffers"] == warm["buffers"]


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(hf: str, run_dir: str, out: str, warm: str) -> None:
    import mrl.megatron.warm_up as wu
    from mrl.config.load import compose
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.policy import Policy
    from tests.jobs.resume_check import synthetic_batch

    cfg = compose([f"model.hf_path={hf}", "parallel=ep2", "algo.lr=1e-3", "train.micro_batch_size=2",
                   "train.pack_max_len=32", "rollout.max_new_tokens=8", f"run_dir={run_dir}"])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, hf)
    c = policy.codec
    seen: dict = {}
    if warm == "1":
        real = wu.forward_backward

        def spy(*args, **kwargs):  # what the pass's own forward and backward left, before it cleans up
            outs = real(*args, **kwargs)
            m = policy.model
            seen["grad_abs_sum"] = sum(float(b.grad_data.abs().sum()) for b in m.buffers + m.expert_parallel_buffers)
            return outs

        wu.forward_backward = spy
        wu.warm_up(policy)
    steps = []
    for step in range(2):
        batch = synthetic_batch(step, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
        steps.append(policy.rl_step(batch, 40.0))
    res = {"pass": seen, "steps": steps, "weights": _digest(p for p in policy.module.parameters()),
           "buffers": _digest(b for _, b in policy.module.named_buffers())}
    with open(f"{out}.rank{layout.world_rank}", "w") as f:
        json.dump(res, f)
    destroy()


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
