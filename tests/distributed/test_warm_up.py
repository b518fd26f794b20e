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
    out = tmp_path / "res.json"
    r = run_torchrun("tests.distributed.test_warm_up", [ckpt_dir["glm4_moe"], str(tmp_path), str(out)], 2, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        cold, warm = json.loads((tmp_path / f"res.json.rank{rank}").read_text())
        assert warm["pass"]["grad_abs_sum"] > 0, warm["pass"]
        assert cold["steps"] == warm["steps"]  # every metric of both steps, exactly
        assert cold["weights"] == warm["weights"] and cold["buffers"] == warm["buffers"]


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _run(cfg, layout, hf: str, warm: bool) -> dict:
    """A fresh policy from ``hf``, the warm-up pass if ``warm``, then two RL steps."""
    import mrl.megatron.warm_up as wu
    from mrl.megatron.policy import Policy
    from tests.jobs.resume_check import synthetic_batch

    policy = Policy(cfg, layout, hf)
    c = policy.codec
    seen: dict = {}
    if warm:
        real = wu.forward_backward

        def spy(*args, **kwargs):  # what the pass's own backward left, before it cleans up
            outs = real(*args, **kwargs)
            m = policy.model
            seen["grad_abs_sum"] = sum(float(b.grad_data.abs().sum()) for b in m.buffers + m.expert_parallel_buffers)
            return outs

        wu.forward_backward = spy
        try:
            wu.warm_up(policy)
        finally:
            wu.forward_backward = real
    steps = []
    for step in range(2):
        batch = synthetic_batch(step, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
        steps.append(policy.rl_step(batch, 40.0))
    return {"pass": seen, "steps": steps, "weights": _digest(p for p in policy.module.parameters()),
            "buffers": _digest(b for _, b in policy.module.named_buffers())}


def _worker(hf: str, run_dir: str, out: str) -> None:
    from mrl.config.load import compose
    from mrl.megatron.parallel import destroy, init_parallel

    cfg = compose([f"model.hf_path={hf}", "parallel=ep2", "algo.lr=1e-3", "train.micro_batch_size=2",
                   "train.pack_max_len=32", "rollout.max_new_tokens=8", f"run_dir={run_dir}"])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    res = [_run(cfg, layout, hf, warm) for warm in (False, True)]  # two policies, same weights from hf
    with open(f"{out}.rank{layout.world_rank}", "w") as f:
        json.dump(res, f)
    destroy()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
