"""Non-finite updates never ship: a step whose loss or gradient is NaN/Inf on any rank is skipped on every
rank (weights, Adam state and LR schedule unchanged) and counted; ``train.max_nonfinite_steps`` in a row stop
the run; weights that are non-finite anyway are refused before a weight sync or a checkpoint.

Real megatron on 2 gloo ranks (``parallel=ep2``: DP2 with the experts split), driven through ``Policy``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.reliability


def test_nonfinite_step_is_skipped_on_every_rank_and_weights_refused(ckpt_dir, tmp_path, reliability):
    out = tmp_path / "res.json"
    r = run_torchrun("tests.unit.test_nonfinite", [ckpt_dir["tiny"], str(tmp_path), str(out)], 2, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    res = [json.loads((tmp_path / f"res.json.rank{k}").read_text()) for k in (0, 1)]
    for rank in res:
        ok1, bad, ok3 = rank["steps"]
        assert ok1["update_ok"] == 1.0 and ok1["nonfinite_update"] == 0.0
        assert bad["update_ok"] == 0.0 and bad["nonfinite_update"] == 1.0  # rank 0's own samples were finite
        assert rank["unchanged_by_bad_step"] and rank["lr_steps"] == [1, 1, 2]
        assert ok3["update_ok"] == 1.0 and rank["finite_after"] and rank["changed_by_good_step"]
        assert math.isnan(rank["sft_nll_inf"]) and rank["unchanged_by_bad_sft"]
        assert rank["poisoned"].startswith("NonFiniteWeights: weight sync v9 refused: the trainer holds non-finite")
        assert "rank 1: decoder.final_layernorm.weight" in rank["poisoned"]
        assert rank["clean_check"] == "passed"
        assert rank["huge_finite"] == "passed"
    reliability.record(category="bad_input", name="non-finite loss on one DP rank", survived=True,
                       injected="advantage +inf on one sample of rank 1's slice (parallel=ep2, real megatron)",
                       expected="step skipped on both ranks, weights/Adam/LR unchanged, counted (nonfinite_update)",
                       message=f"update_ok {res[0]['steps'][1]['update_ok']}, nonfinite_update "
                               f"{res[0]['steps'][1]['nonfinite_update']} on both ranks")
    reliability.record(category="bad_input", name="non-finite weight before a sync", survived=True,
                       injected="NaN written into a parameter of rank 1",
                       expected="sync/checkpoint refused on every rank, naming rank and parameter",
                       message=res[0]["poisoned"])


def test_max_nonfinite_steps_in_a_row_stop_the_run(reliability):
    from mrl.config.load import compose
    from mrl.trainer.loop import NonFiniteSteps, NonFiniteUpdates

    assert compose(["train.max_nonfinite_steps=2"]).train.max_nonfinite_steps == 2
    steps = NonFiniteSteps(2)
    assert steps.update(1, {"nonfinite_update": 1.0}) == {"nonfinite_steps": 1.0}
    assert steps.update(2, {"nonfinite_update": 0.0}) == {"nonfinite_steps": 1.0}  # a good step resets the run
    steps.update(3, {"nonfinite_update": 1.0})
    with pytest.raises(NonFiniteUpdates, match=r"train.max_nonfinite_steps=2: steps 3-4 all had a non-finite") as e:
        steps.update(4, {"nonfinite_update": 1.0})
    assert "since step 2" in str(e.value)
    never = NonFiniteSteps(0)
    assert [never.update(s, {"nonfinite_update": 1.0}) for s in (1, 2, 3)][-1] == {"nonfinite_steps": 3.0}
    reliability.record(category="bad_input", name="non-finite steps in a row", survived=True,
                       injected="train.max_nonfinite_steps=2, two skipped steps in a row",
                       expected="the run stops naming the field and the steps", message=str(e.value))


def _worker(hf: str, run_dir: str, out: str) -> None:
    import torch

    from mrl.config.load import compose
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.policy import Policy
    from mrl.weight_sync.checks import check_finite_weights
    from tests.jobs.resume_check import synthetic_batch

    cfg = compose([f"model.hf_path={hf}", "parallel=ep2", "algo.lr=1e-3", "train.micro_batch_size=4",
                   f"run_dir={run_dir}"])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, hf)
    c = policy.codec

    def weights() -> list[torch.Tensor]:
        return [p.detach().clone() for p in policy.module.parameters()]

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    res: dict = {"steps": [], "lr_steps": []}
    for step in range(3):
        batch = synthetic_batch(step, 8, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
        if step == 1:
            batch.advantages[7] = float("inf")  # dp rank 1's slice is samples 4-7
        before = weights()
        res["steps"].append(policy.rl_step(batch, 40.0))
        res["lr_steps"].append(policy.scheduler.num_steps)
        if step == 1:
            res["unchanged_by_bad_step"] = same(before, weights())
        if step == 2:
            res["changed_by_good_step"] = not same(before, weights())
    res["finite_after"] = all(bool(p.isfinite().all()) for p in policy.module.parameters())

    before = weights()
    toks = [[5, 6, 7, 8, 9]] * 2
    emb = dict(policy.module.named_parameters())["embedding.word_embeddings.weight"]
    saved = emb.detach()[6].clone()
    emb.data[6] = float("inf")  # a non-finite SFT loss (token 6 is in the answer): skipped as well
    res["sft_nll_inf"] = policy.sft_step(toks, [2, 2], 1e-3)
    emb.data[6] = saved
    res["unchanged_by_bad_sft"] = same(before, weights())

    try:
        if layout.world_rank == 1:
            dict(policy.module.named_parameters())["decoder.final_layernorm.weight"].data[0] = float("nan")
        check_finite_weights(policy.module, "weight sync v9")
        res["poisoned"] = "not refused"
    except Exception as e:
        res["poisoned"] = f"{type(e).__name__}: {e}"
    if layout.world_rank == 1:
        dict(policy.module.named_parameters())["decoder.final_layernorm.weight"].data[0] = 1.0
    check_finite_weights(policy.module, "checkpoint")
    res["clean_check"] = "passed"
    norm_w = dict(policy.module.named_parameters())["decoder.final_layernorm.weight"]
    if layout.world_rank == 0:  # finite, but its norm overflows: the element-wise recheck lets it through
        norm_w.data[:2] = 3e38
    try:
        check_finite_weights(policy.module, "checkpoint")
        res["huge_finite"] = "passed"
    except Exception as e:
        res["huge_finite"] = f"{type(e).__name__}: {e}"
    norm_w.data[:2] = 1.0
    with open(f"{out}.rank{layout.world_rank}", "w") as f:
        json.dump(res, f)
    destroy()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(*sys.argv[1:4])
