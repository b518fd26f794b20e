"""Batch delivery on 2 gloo ranks (``mrl.megatron.batch_scatter``): each rank receives exactly the samples its
DP rank trains on, and an RL step (routing metrics, replayed routes, Keep Sampling Mask, loss masks, the
optimizer step) on the delivered share equals the step on the whole batch bit for bit: dp=2 packed (the plan
comes from every sample's length), TP2 (one DP rank: both ranks get every sample) and EP2 (expert peers
are DP ranks of the dense model); and with two mini-batches and two epochs (pi_old from a forward before the
first step, the KL reference, masked IS whose rejections leave each mini-batch's normalizer summed over DP,
pipeline stages of which only the last computes the loss, pi_old's pass in micro-batches of its own). A source
that never sends fails the receiver naming the transfer.

The worker is this file run under torchrun (``python -m tests.distributed.test_batch_scatter``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.conftest import read_json, run_torchrun
from tests.jobs.outcome import record_outcome

MINI = ["algo.mini_batches=2", "algo.ppo_epochs=2"]  # 4 optimizer steps, pi_old from a pass before the first
CASES = {  # name: (parallel preset, overrides, DP size)
    "dp2_packed": ("tp1", ["parallel.world_size=2", "train.packing=true"], 2),
    "tp2": ("tp2_sp", ["train.packing=false"], 1),
    "ep2_packed": ("ep2", ["train.packing=true"], 2),
    "dp2_packed_minibatches_kl": ("tp1", ["parallel.world_size=2", "train.packing=true", *MINI,
                                          "algo.kl_coef=0.05"], 2),
    "ep2_minibatches_masked_is": ("ep2", ["train.packing=false", *MINI, "algo.correction=mis",
                                          "algo.correction_level=sequence_geomean", "algo.mis_high=1.2"], 2),
    "pp2_minibatches": ("pp2", ["parallel.pp_first_layers=2", "train.packing=true", *MINI], 1),
    # pi_old's pass in micro-batches of its own (one sample each), re-cut to the training's on the last stage
    "pp2_minibatches_own_old_pass": ("pp2", ["parallel.pp_first_layers=2", "train.packing=false", *MINI,
                                             "algo.old_logprob_micro_batch_size=1"], 1),
}
N = 8


@pytest.fixture(scope="module")
def results(ckpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("scatter")
    r = run_torchrun("tests.distributed.test_batch_scatter", ["steps", ckpt_dir["tiny"], str(out), *CASES], 2,
                     timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return [read_json(out / f"rank{k}.json") for k in range(2)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_gets_its_share_and_the_same_step(results, case):
    dp = CASES[case][2]
    for rank, res in enumerate(results):
        got = res[case]
        dp_rank = rank if dp == 2 else 0
        assert (got["first"], got["n"]) == (dp_rank * N // dp, N // dp), got  # exactly its DP rank's samples
        assert got["same_samples"], got
        assert got["routes_dtype"] == "uint8"
        assert got["received_bytes"] < got["whole_pickle_bytes"] or dp == 1
        whole, share = got["whole"], got["share"]
        assert whole["grad_norm"] > 0 and whole["support_unknown_tokens"] == 1.0
        assert share == whole  # every metric, bit for bit
        assert got["same_parameters"]
        if "minibatches" in case:  # four optimizer steps; pi_old from before the first: the ratio moves after it
            assert whole["minibatch/0/ratio_mean"] == 1.0 and whole["minibatch/3/approx_kl"] > 0, whole
        if "masked_is" in case:  # sequences rejected before the loss, on both DP ranks' shares
            assert whole["is_masked_tokens"] > 0


def test_a_source_that_never_sends_fails_the_receiver_naming_the_transfer(tmp_path):
    r = run_torchrun("tests.distributed.test_batch_scatter", ["hang", str(tmp_path)], 2, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = read_json(tmp_path / "rank1.json")
    assert res["type"] == "CollectiveError", res
    assert "rank 1: receive of the step-1 batch (DP rank 1's share)" in res["message"]
    assert "waiting for rank 0" in res["message"]
    assert res["seconds"] < 30


def _supports(batch, vocab, seed):
    import numpy as np

    g = np.random.default_rng(seed)
    sup = [[sorted({int(tok), *g.choice(vocab, 4, replace=False).tolist()}) for tok in t[p:]]
           for t, p in zip(batch.tokens, batch.prompt_lens)]
    return sup, [(-g.random(len(s))).tolist() for s in sup]


def _case(hf: str, preset: str, overrides: list[str]) -> dict:
    import pickle

    import numpy as np
    import torch
    import torch.distributed as dist

    from mrl.config.load import compose
    from mrl.megatron.batch_scatter import BatchScatter, layout as buffer_layout, make_header
    from mrl.megatron.batch import dp_share
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy
    from tests.jobs.resume_check import synthetic_batch

    cfg = compose([f"model.hf_path={hf}", f"parallel={preset}", *overrides, "algo.lr=1e-3",
                   "train.micro_batch_size=2", "train.pack_max_len=24", "train.sampling_mask=true",
                   "train.bad_support=mask", "rollout.top_k=5"])
    lay = init_parallel(cfg.parallel, seed=cfg.seed)

    def step(policy, batch):
        return policy.routing_metrics(batch) | policy.rl_step(batch, 41.0)

    policy = Policy(cfg, lay, hf)
    policy.capture_reference()  # with algo.kl_coef > 0: the starting weights (no-op without)
    c = policy.codec
    batch = synthetic_batch(0, N, policy.bridge.vocab_size, len(c.moe_layers), c.top_k, c.num_experts)
    batch.support, batch.support_log_mass = _supports(batch, policy.bridge.vocab_size, 0)
    batch.support[3][1] = []  # one support the engine could not rebuild: out of the loss, counted
    batch.loss_mask = [[int(j % 4 != 1) for j in range(len(t) - p)] for t, p in zip(batch.tokens, batch.prompt_lens)]
    whole = step(policy, batch)
    params = torch.cat([p.detach().flatten() for p in policy.module.parameters()]).clone()

    scatter = BatchScatter(dp_rank=lay.dp.rank, dp_size=lay.dp.size, group=dist.group.WORLD)
    item = (batch, 41.0, {"reward": 0.5}) if lay.world_rank == 0 else None
    got, normalizer, info = scatter.deliver(item, what="the step-1 batch")
    assert (normalizer, info) == (41.0, {"reward": 0.5})
    mine = dp_share(N, lay.dp.size, lay.dp.rank)
    same = got.first == mine.start and len(got) == len(mine) and all(
        getattr(got, f) == getattr(batch, f)[mine.start:mine.stop]
        for f in ("tokens", "prompt_lens", "behav_logp", "advantages", "support", "support_log_mass", "loss_mask"))
    same = same and all(np.array_equal(a, b) for a, b in zip(got.routes, batch.routes[mine.start:mine.stop]))
    header = make_header(batch, 41.0, {"reward": 0.5}, lay.dp.size)
    received = 0 if lay.world_rank == 0 else buffer_layout(header, mine)[1] + len(pickle.dumps(header))

    fresh = Policy(cfg, lay, hf)
    fresh.capture_reference()
    share = step(fresh, got)
    after = torch.cat([p.detach().flatten() for p in fresh.module.parameters()])
    return {"first": got.first, "n": len(got), "same_samples": bool(same), "routes_dtype": str(got.routes[0].dtype),
            "received_bytes": received, "whole_pickle_bytes": len(pickle.dumps((batch, 41.0, {"reward": 0.5}))),
            "whole": whole, "share": share, "same_parameters": bool(torch.equal(params, after))}


def _steps(hf: str, out: str, *cases: str) -> None:
    from mrl.megatron.parallel import destroy

    res = {name: _case(hf, CASES[name][0], CASES[name][1]) for name in cases}
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
    destroy()


def _hang(out: str) -> None:
    """Rank 0 sends the header, then never the share: rank 1 must fail within the group's 3 s limit."""
    from datetime import timedelta

    import torch.distributed as dist

    from mrl.megatron.batch_scatter import BatchScatter
    from tests.unit.test_batch_scatter import make_batch

    dist.init_process_group("gloo", timeout=timedelta(seconds=3))
    me = dist.get_rank()
    scatter = BatchScatter(dp_rank=me, dp_size=2, group=dist.group.WORLD)
    if me == 0:
        scatter._send = lambda *a: time.sleep(8)
    record_outcome(out, me, lambda: scatter.deliver((make_batch(), 1.0, {}) if me == 0 else None,
                                                    what="the step-1 batch"))


if __name__ == "__main__":
    if sys.argv[1] == "hang":
        _hang(sys.argv[2])
    else:
        _steps(*sys.argv[2:])
