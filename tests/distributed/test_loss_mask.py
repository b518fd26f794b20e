"""Per-token loss masks (multi-turn tool output): tokens with loss mask 0 are context only. Changing their
engine logprobs (which a tool's output does not have) must not change the step; without the mask it does.

Real megatron on one gloo rank, driven through ``Policy.rl_step``; each step starts from freshly loaded
weights, so the returned grad norms compare the gradients of one step.
"""

from __future__ import annotations

import json
import sys

from tests.conftest import run_torchrun


def test_masked_tokens_do_not_reach_the_gradient(ckpt_dir, tmp_path):
    out = tmp_path / "res.json"
    r = run_torchrun("tests.distributed.test_loss_mask", [ckpt_dir["tiny"], str(out)], 1, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    masked, masked_other_behav, unmasked_other_behav, all_ones = (res[k] for k in (
        "masked", "masked_other_behav", "unmasked_other_behav", "all_ones"))
    assert masked["grad_norm"] > 0
    assert masked_other_behav["grad_norm"] == masked["grad_norm"]  # the masked tokens' inputs are never used
    assert masked_other_behav["pg_loss"] == masked["pg_loss"]
    assert unmasked_other_behav["grad_norm"] != masked["grad_norm"]  # the same change reaches an unmasked step
    assert all_ones["grad_norm"] == unmasked_other_behav["grad_norm"]  # a mask of ones is no mask
    assert "loss mask of 3 tokens for 8 response tokens" in res["bad_length"]


def _worker(hf: str, out: str) -> None:
    import dataclasses

    from mrl.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.policy import Policy, RLBatch

    pcfg = ParallelConfig(world_size=1)
    cfg = Config(model=ModelConfig(hf_path=hf, make_tiny_if_missing=False), parallel=pcfg,
                 train=TrainConfig(micro_batch_size=2, replay=False, packing=False))
    layout = init_parallel(pcfg, seed=cfg.seed)
    prompt = [5, 6, 7, 8]
    tokens = [prompt + [20 + j for j in range(8)], prompt + [40 + j for j in range(8)]]
    behav = [[-1.0 - 0.1 * j for j in range(8)] for _ in tokens]
    mask = [[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]  # sample 0: three tokens of tool output
    other = [list(b) for b in behav]
    other[0][3:6] = [-9.0, -0.01, -5.0]
    base = RLBatch(tokens=tokens, prompt_lens=[4, 4], behav_logp=behav, advantages=[1.0, -1.0], routes=None,
                   loss_mask=mask)
    cases = {"masked": base, "masked_other_behav": dataclasses.replace(base, behav_logp=other),
             "unmasked_other_behav": dataclasses.replace(base, behav_logp=other, loss_mask=None),
             "all_ones": dataclasses.replace(base, behav_logp=other, loss_mask=[[1] * 8, [1] * 8])}
    res = {}
    for name, batch in cases.items():
        policy = Policy(cfg, layout, hf)  # fresh weights for every case
        m = policy.rl_step(batch, normalizer=13.0)
        res[name] = {"grad_norm": m["grad_norm"], "pg_loss": m["pg_loss"]}
    try:
        policy.rl_step(dataclasses.replace(base, loss_mask=[[1, 1, 1], [1] * 8]), normalizer=11.0)
        res["bad_length"] = "accepted"
    except ValueError as e:
        res["bad_length"] = str(e)
    with open(out, "w") as f:
        json.dump(res, f)
    destroy()


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
