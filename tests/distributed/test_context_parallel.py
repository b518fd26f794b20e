"""The RL step's context-parallel path on a real CP=2 gloo group: ``train_step.forward_backward`` through
megatron's own schedule (its loss scaling by the CP size included), megatron's CP split of the micro-batch
(``get_batch_on_this_cp_rank``), the all-gather of the logprobs and the loss on whole sequences. Logprobs,
loss metrics and gradients equal CP=1's, computed in each process on the whole batch.

The model is position-wise (token and position embeddings into the vocabulary): no CP attention runs on CPU
(megatron's local attention asserts context_parallel_size == 1, TE's is GPU-only), and a position-wise model is
exactly what CP splits without changing any value, so every difference would be the split's or the gather's.
The worker is this file run under torchrun (``python -m tests.distributed.test_context_parallel``).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import run_torchrun

V, S = 12, 16


@pytest.mark.dist
def test_cp2_step_equals_cp1(tmp_path):
    out = tmp_path / "cp2.json"
    r = run_torchrun("tests.distributed.test_context_parallel", ["--out", str(out)], 2, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert set(rep) == {"unpacked", "packed_thd", "support"}, rep
    for case, ranks in rep.items():
        assert len(ranks) == 2
        for got in ranks:
            assert got["logprob_max_abs_diff"] < 1e-5, (case, got)
            for k, d in got.get("metric_abs_diff", {}).items():
                assert d < 1e-5, (case, k, got)
            if "grad_max_abs_diff" in got:
                assert got["grad_max_abs_diff"] < 1e-5 and got["grad_norm"] > 0, (case, got)
        assert ranks[0]["positions"] != ranks[1]["positions"]  # each rank fed its own half of the tokens
        assert sorted(ranks[0]["positions"] + ranks[1]["positions"]) == list(range(ranks[0]["seq"]))


def _model(config):
    import torch
    from megatron.core.enums import ModelType

    class PositionWise(torch.nn.Module):
        """What the schedule needs of a GPTModel (``config``, ``set_input_tensor``, its forward's arguments);
        logits of a position depend on its token and position only."""

        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.config, self.model_type = config, ModelType.encoder_or_decoder
            self.emb = torch.nn.Parameter(torch.randn(V, V, generator=g))
            self.pos = torch.nn.Parameter(torch.randn(S * 4, V, generator=g))
            self.positions: list[list[int]] = []

        def set_input_tensor(self, _):
            pass

        def forward(self, input_ids, position_ids, attention_mask=None, packed_seq_params=None,
                    runtime_gather_output=False):
            return self.emb[input_ids] + self.pos[position_ids]

    return PositionWise()


def _reference(model, ids_nT, lengths, data, algo, normalizer, support=None):
    """CP=1: the whole sequences, one row per sample, positions 0.. in each."""
    import torch

    from mrl.algo import compute_policy_loss
    from mrl.routing.sampling_mask import support_logprobs

    pos = torch.arange(ids_nT.shape[1]).expand_as(ids_nT)
    logits = model.emb[ids_nT] + model.pos[pos]
    if support is None:
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids_nT[:, 1:, None]).squeeze(-1)
    else:
        lp, _ = support_logprobs(logits[:, :-1], ids_nT[:, 1:], support, 1.0, on_outside="drop")
    t = torch.arange(ids_nT.shape[1] - 1)
    lp = torch.where(t < torch.tensor(lengths)[:, None] - 1, lp, 0.0)
    if data is None:
        return lp.detach(), None, None
    loss, metrics = compute_policy_loss(lp, data["old"], data["behav"], data["adv"], data["mask"], algo,
                                        normalizer=normalizer)
    grads = torch.autograd.grad(loss, [model.emb, model.pos])
    return lp.detach(), metrics, grads


def main() -> None:
    import argparse

    import torch
    import torch.distributed as dist

    from mrl.algo import compute_policy_loss, loss_normalizer
    from mrl.config.schema import Aggregation, AlgoConfig, LossType, ParallelConfig
    from mrl.megatron import packing
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.train_step import MicroBatch, forward_backward
    from mrl.routing.sampling_mask import SupportSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    layout = init_parallel(ParallelConfig(cp=2, world_size=2))
    assert layout.cp.size == 2 and layout.dp.size == 1
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, context_parallel_size=2)
    model = _model(config)
    algo = AlgoConfig(loss=LossType.gspo, aggregation=Aggregation.seq_mean_token_mean)
    g = torch.Generator().manual_seed(1)
    lengths = [12, 16, 6, 9]
    prompts = [3, 5, 2, 4]
    n = len(lengths)
    ids = torch.randint(0, V, (n, S), generator=g)
    mask = torch.zeros(n, S - 1)
    for i, (p, m) in enumerate(zip(prompts, lengths)):
        mask[i, p - 1:m - 1] = 1.0
        ids[i, m:] = 0
    mask[1, 8] = 0.0  # a tool output token
    data = {"mask": mask, "behav": -torch.rand(n, S - 1, generator=g) - 1.0,
            "adv": torch.tensor([1.0, -0.5, 2.0, 0.3])}
    data["old"] = data["behav"] + 0.05 * torch.randn(n, S - 1, generator=g)
    normalizer = loss_normalizer(mask, algo.aggregation).float()

    def loss_fn(lp, mb):
        d = mb.data
        return compute_policy_loss(lp, d["old"], d["behav"], d["adv"], d["mask"], algo, normalizer=normalizer)

    def grads():
        out = []
        for p in (model.emb, model.pos):
            gr = p.grad.clone()
            dist.all_reduce(gr, group=layout.cp.group)
            out.append(gr / layout.cp.size)  # DDP's mean over DP x CP (here DP = 1)
            p.grad = None
        return out

    def compare(outs, lp_ref, metrics_ref, grads_ref, mbs, rows):
        lp = torch.cat([o["logprobs"] for o in outs])
        lp = torch.where(torch.arange(S - 1) < torch.tensor([lengths[i] for i in rows])[:, None] - 1, lp, 0.0)
        got = {"logprob_max_abs_diff": float((lp - lp_ref[rows]).abs().max()), "seq": mbs[0].input_ids.shape[1],
               "positions": mbs[0].cp.split.index.tolist()}
        if metrics_ref is not None:
            # every metric is of the whole batch; the micro-batches' sum for the loss, their mean for ratios
            got["metric_abs_diff"] = {"pg_loss": abs(sum(float(o["pg_loss"]) for o in outs)
                                                     - float(metrics_ref["pg_loss"]))}
            mine = grads()
            got["grad_max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(mine, grads_ref))
            got["grad_norm"] = float(sum(float(x.norm()) for x in mine))
        return got

    report = {}
    # unpacked: one sample per row, two micro-batches of two rows
    lp_ref, metrics_ref, grads_ref = _reference(model, ids, lengths, data, algo, normalizer)
    mbs = [MicroBatch(ids[j:j + 2].clone(), data={k: v[j:j + 2] for k, v in data.items()}, samples=[j, j + 1])
           for j in (0, 2)]
    outs = forward_backward(model, layout, mbs, vocab_size=V, loss_fn=loss_fn)
    report["unpacked"] = compare(outs, lp_ref, metrics_ref, grads_ref, mbs, [0, 1, 2, 3])

    # packed THD: every slot aligned to 2 * cp, one micro-batch of two rows (megatron's PackedSeqParams is plain
    # Python; the split without TE's kernel is the same rule, tests/unit/test_context_parallel.py)
    packing.HAVE_TE = True
    plans = packing.pack_micro_batches(lengths, dp_size=1, dp_rank=0, row_len=S, rows_per_micro_batch=2,
                                       fmt="thd", align=4)
    mbs = []
    for idx, pk in plans:
        width = pk.width
        mbs.append(MicroBatch(pk.pack_tokens(ids[idx, :width], 0), packing=pk, samples=idx,
                              data={k: v[idx] if v.dim() == 1 else v[idx, :width - 1] for k, v in data.items()}))
    outs = forward_backward(model, layout, mbs, vocab_size=V, loss_fn=loss_fn)
    rows = [i for idx, _ in plans for i in idx]
    width = max(lengths)
    outs = [{**o, "logprobs": torch.nn.functional.pad(o["logprobs"], (0, width - 1 - o["logprobs"].shape[1]))}
            for o in outs]
    report["packed_thd"] = compare(outs, lp_ref[:, :width - 1].contiguous(), metrics_ref,
                                   grads_ref, mbs, rows)

    # Keep Sampling Mask: supports split with the tokens (forward only)
    support = torch.randint(0, V, (n, S - 1, 3), generator=g)
    support[..., 0] = ids[:, 1:]  # the sampled token inside its support
    support[:, :2] = -1  # prompt positions: no support
    lp_sup, _, _ = _reference(model, ids, lengths, None, algo, normalizer, support=support)
    mbs = [MicroBatch(ids[j:j + 2].clone(), support=support[j:j + 2], samples=[j, j + 1],
                      data={"mask": mask[j:j + 2]}) for j in (0, 2)]
    outs = forward_backward(model, layout, mbs, vocab_size=V, forward_only=True,
                            support=SupportSpec(temperature=1.0, on_outside="drop"))
    report["support"] = compare(outs, lp_sup, None, None, mbs, [0, 1, 2, 3])

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({k: [r[k] for r in everyone] for k in report}, f)
    destroy()


if __name__ == "__main__":
    sys.exit(main())
