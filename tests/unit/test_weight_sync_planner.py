"""Weight-sync planner (pure): coverage, bucket limits and sender choice for layouts up to 64 ranks."""

from collections import Counter

import pytest
from transformers import Qwen3MoeConfig

from mrl.models import get_bridge
from mrl.models.qwen3_moe import Qwen3MoeBridge
from mrl.weight_sync.planner import TrainerLayout, plan_sync

# Qwen3-30B-A3B's published shape (no weights are made): 48 layers, 128 experts top-8
Q30B = Qwen3MoeBridge(Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=40960))

LAYOUTS = [  # tp, pp, ep, etp, world
    (1, 1, 1, 1, 1), (2, 1, 2, 1, 2), (1, 2, 1, 1, 2), (8, 2, 16, 1, 64), (4, 4, 8, 2, 64), (8, 1, 8, 8, 64),
    (2, 4, 4, 1, 32),
]


def _check(bridge, layout, bucket_bytes, dtype="bfloat16"):
    vp = bridge.padded_vocab(128, layout.tp)
    plan = plan_sync(bridge.param_maps(vp), layout, num_layers=bridge.num_layers, num_experts=bridge.num_experts,
                     bucket_bytes=bucket_bytes, dtype=dtype, tied=bridge.tied_embeddings)
    want = bridge.hf_tensor_shapes(vp)
    sent = Counter(t.name for b in plan.buckets for t in b.tensors)
    assert set(sent) == set(want) and set(sent.values()) == {1}, "each HF tensor exactly once"
    assert all(tuple(t.shape) == want[t.name] for b in plan.buckets for t in b.tensors)
    for b in plan.buckets:
        assert b.nbytes <= bucket_bytes or len(b.params) == 1
        assert plan.groups[b.sender] == b.group
    per_stage = layout.world_size // layout.pp
    per_ep = bridge.num_experts // layout.ep
    for b in plan.buckets:
        for p in b.params:
            assert p.sender // per_stage == p.stage, "sender sits on the param's PP stage"
            if p.expert is not None:
                assert (p.sender // layout.etp) % layout.ep == p.expert // per_ep, "sender holds the expert"
                assert p.sender % layout.etp == 0
            else:
                assert p.sender % layout.tp == 0 and p.sender == layout.dense_rank(pp=p.stage)
    return plan


@pytest.mark.parametrize("tp,pp,ep,etp,world", LAYOUTS)
def test_qwen3_30b_plan(tp, pp, ep, etp, world):
    layout = TrainerLayout(tp=tp, pp=pp, ep=ep, etp=etp, world_size=world)
    plan = _check(Q30B, layout, bucket_bytes=512 << 20)
    assert len(plan.groups) == pp * ep  # one group per PP stage x EP rank: parallel senders
    assert 55e9 < plan.nbytes < 65e9  # ~30.5B params in bf16
    # order: buckets of one sender are numbered consecutively and keep layer order
    for r in plan.groups:
        bs = plan.for_sender(r)
        assert [b.index for b in bs] == list(range(len(bs)))


SMALL = [(p, *lay) for p in ("tiny", "stress_a", "stress_b")
         for lay in [(1, 1, 1, 1, 1), (2, 1, 2, 1, 2), (1, 2, 1, 1, 2), (2, 2, 2, 1, 4)]
         if not (p == "tiny" and lay[1] == 2)]  # the 3-layer tiny model has no even 2-stage split


@pytest.mark.parametrize("preset,tp,pp,ep,etp,world", SMALL)
def test_small_checkpoints_plan(ckpt_dir, preset, tp, pp, ep, etp, world):
    bridge = get_bridge(ckpt_dir[preset])
    _check(bridge, TrainerLayout(tp=tp, pp=pp, ep=ep, etp=etp, world_size=world), bucket_bytes=64 << 10,
           dtype="float32")


@pytest.mark.parametrize("first,last,want", [(2, None, (2, 1)), (None, 2, (1, 2)), (1, None, (1, 2))])
def test_uneven_pipeline_split(ckpt_dir, first, last, want):
    """3-layer tiny over PP2: megatron's first/last-stage counts decide which stage sends each layer."""
    from mrl.config.schema import ParallelConfig

    bridge = get_bridge(ckpt_dir["tiny"])
    counts = tuple(ParallelConfig(pp=2, pp_first_layers=first, pp_last_layers=last).stage_layers(3))
    assert counts == want
    plan = _check(bridge, TrainerLayout(tp=1, pp=2, ep=1, etp=1, world_size=2, stage_layers=counts),
                  bucket_bytes=64 << 10, dtype="float32")
    stage_of = {p.mcore_name.split(".")[2]: p.stage for b in plan.buckets for p in b.params
                if p.mcore_name.startswith("decoder.layers.")}
    assert [stage_of[str(i)] for i in range(3)] == [0] * want[0] + [1] * want[1]


def test_q235b_like_94_layers_pp4_uneven():
    from mrl.config.schema import ParallelConfig

    assert ParallelConfig(pp=4, pp_first_layers=22, pp_last_layers=24).stage_layers(94) == [22, 24, 24, 24]
    with pytest.raises(ValueError, match="parallel.pp: =4 does not divide"):
        ParallelConfig(pp=4).stage_layers(94)
    with pytest.raises(ValueError, match="pp_first_layers/pp_last_layers"):
        ParallelConfig(pp=4, pp_first_layers=21).stage_layers(94)
    with pytest.raises(ValueError, match="parallel.pp_last_layers"):
        ParallelConfig(pp=2, pp_last_layers=94).stage_layers(94)


def test_tied_embedding_sent_once_and_no_lm_head(ckpt_dir):
    bridge = get_bridge(ckpt_dir["stress_b"])
    plan = _check(bridge, TrainerLayout(tp=1, pp=2, ep=1, etp=1, world_size=2), bucket_bytes=1 << 20, dtype="float32")
    names = [t.name for b in plan.buckets for t in b.tensors]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1


def test_oversized_tensor_gets_its_own_bucket():
    plan = plan_sync(Q30B.param_maps(151936), TrainerLayout(tp=1, pp=1, ep=1, etp=1, world_size=1),
                     num_layers=48, num_experts=128, bucket_bytes=1 << 20, dtype="bfloat16")
    big = [b for b in plan.buckets if b.nbytes > 1 << 20]
    assert big and all(len(b.params) == 1 for b in big)


@pytest.mark.parametrize("kw,msg", [(dict(bucket_bytes=0), "bucket_mb"), (dict(num_experts=127), "parallel.ep")])
def test_bad_inputs(kw, msg):
    args = dict(num_layers=48, num_experts=128, bucket_bytes=1 << 20)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        plan_sync(Q30B.param_maps(151936), TrainerLayout(tp=1, pp=1, ep=2, etp=1, world_size=2), **args)


def _ddp_like_placements(bridge, layout, dtype="bfloat16", gap_after: str | None = None):
    """Each sender's params back to back in one storage, in reverse order as megatron's DDP buffer holds
    them (every param takes its full megatron size there), for those whose HF tensors need no regrouping
    (``copy_plan.inplace_numel``); ``gap_after``: padding after that param."""
    from mrl.weight_sync.copy_plan import inplace_numel
    from mrl.weight_sync.planner import Placement, plan_params

    vp = bridge.padded_vocab(128, layout.tp)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    params = plan_params(list(maps.values()), layout, num_layers=bridge.num_layers,
                         num_experts=bridge.num_experts, dtype=dtype, tied=bridge.tied_embeddings)
    out, offset = {}, {}
    for p in reversed(params):
        pm = maps[p.mcore_name]
        full = sum(part.num_rows for seg in pm.segments for part in seg) * (pm.num_cols or 1)
        at = offset.get(p.sender, 0)
        n = inplace_numel(pm, p)
        if n is not None:
            out[p.mcore_name] = Placement(storage=1000 + p.sender, offset=at, numel=n)
        offset[p.sender] = at + full + (64 if p.mcore_name == gap_after else 0)
    return params, out


def test_inplace_numel_knows_which_params_need_regrouping(ckpt_dir):
    """QKV (megatron interleaves q/k/v per query group) is regrouped; gate/up, experts, norms, and a
    vocab-padded embedding (its HF rows first, padding after) go as they lie."""
    from mrl.weight_sync.copy_plan import inplace_numel

    bridge = get_bridge(ckpt_dir["stress_a"])
    vp = bridge.padded_vocab(128, 1)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    params = {p.mcore_name: p for p in plan_params_for(bridge, vp)}
    qkv = next(n for n in maps if n.endswith("linear_qkv.weight"))
    fc1 = next(n for n in maps if ".experts." in n and n.endswith("linear_fc1.weight"))
    emb = "embedding.word_embeddings.weight"
    assert inplace_numel(maps[qkv], params[qkv]) is None
    assert inplace_numel(maps[fc1], params[fc1]) == sum(t.shape[0] * t.shape[1] for t in params[fc1].tensors)
    assert [t.name.rsplit(".", 2)[-2] for t in params[fc1].tensors] == ["gate_proj", "up_proj"]
    h = bridge.hf_config.hidden_size
    assert vp > bridge.vocab_size and inplace_numel(maps[emb], params[emb]) == bridge.vocab_size * h


def plan_params_for(bridge, vp):
    from mrl.weight_sync.planner import plan_params

    return plan_params(bridge.param_maps(vp), TrainerLayout(tp=1, pp=1, ep=1, etp=1, world_size=1),
                       num_layers=bridge.num_layers, num_experts=bridge.num_experts, dtype="float32",
                       tied=bridge.tied_embeddings)


@pytest.mark.parametrize("tp,pp,ep,etp,world", [(1, 1, 1, 1, 1), (2, 1, 8, 1, 8), (8, 2, 16, 1, 64), (4, 4, 8, 2, 64)])
def test_inplace_buckets_are_runs_of_the_senders_memory(tp, pp, ep, etp, world):
    """Qwen3-30B in a DDP-like buffer: in-place buckets are params back to back in one sender's memory,
    in memory order, <= the bucket size; all the rest is copied; still every HF tensor exactly once."""
    layout = TrainerLayout(tp=tp, pp=pp, ep=ep, etp=etp, world_size=world)
    params, placements = _ddp_like_placements(Q30B, layout)
    bucket = 512 << 20
    plan = plan_sync(Q30B.param_maps(Q30B.padded_vocab(128, tp)), layout, num_layers=48, num_experts=128,
                     bucket_bytes=bucket, dtype="bfloat16", placements=placements)
    sent = Counter(t.name for b in plan.buckets for t in b.tensors)
    assert set(sent.values()) == {1} and len(sent) == sum(len(p.tensors) for p in params)
    inplace = [b for b in plan.buckets if b.inplace]
    assert inplace, "the experts (expert-TP 1) lie back to back"
    for b in inplace:
        at = [placements[p.mcore_name] for p in b.params]
        assert len({a.storage for a in at}) == 1 and all(x.offset + x.numel == y.offset for x, y in zip(at, at[1:]))
        assert b.nbytes <= bucket or len(b.params) == 1
    for r in plan.groups:  # per sender: in-place buckets first, numbered on
        bs = plan.for_sender(r)
        assert [b.index for b in bs] == list(range(len(bs)))
        assert [b.inplace for b in bs] == sorted((b.inplace for b in bs), reverse=True)
    moved = sum(b.nbytes for b in inplace) / plan.nbytes
    assert moved > 0.9 if etp == 1 else moved > 0  # expert bytes dominate a 30B MoE


def test_inplace_runs_break_at_gaps_and_short_runs_are_copied():
    layout = TrainerLayout(tp=1, pp=1, ep=1, etp=1, world_size=1)
    maps = Q30B.param_maps(Q30B.padded_vocab(128, 1))
    args = dict(num_layers=48, num_experts=128, dtype="bfloat16")
    expert = "decoder.layers.47.mlp.experts.local_experts.60.linear_fc2.weight"  # mid-layer: both halves >= 512 MiB
    _, flat = _ddp_like_placements(Q30B, layout)
    _, gapped = _ddp_like_placements(Q30B, layout, gap_after=expert)
    runs = {}
    for name, pl in (("flat", flat), ("gapped", gapped)):
        plan = plan_sync(maps, layout, bucket_bytes=2 << 30, placements=pl, **args)  # one bucket per layer's run
        runs[name] = [b for b in plan.buckets if b.inplace]
    assert len(runs["flat"]) >= 48  # EP1: a layer's experts, router, norms and o_proj; its QKV ends the run
    assert len(runs["gapped"]) == len(runs["flat"]) + 1  # the gap splits one run in two
    assert [b.params[-1].mcore_name for b in runs["gapped"]].count(expert) == 1
    # a run shorter than min_inplace_bytes is copied instead: no layer's run reaches 2 GiB
    plan = plan_sync(maps, layout, bucket_bytes=2 << 30, placements=flat, min_inplace_bytes=2 << 30, **args)
    assert not any(b.inplace for b in plan.buckets)
