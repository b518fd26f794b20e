"""A bucket's load recorded once and replayed as copies (``mrl.engine.server.replayed_load``), on loaders
shaped like SGLang's: fused q/k/v and stacked experts filled by views + copies, a TP shard taken by
narrowing, and loaders the plan must refuse (a derived weight, a dtype conversion, a computed source)."""

from __future__ import annotations

import pytest
import torch

from mrl.engine.server import replayed_load
from mrl.engine.server.replayed_load import bucket_nbytes, bucket_views, record_load

H, E, FF, TP_RANK = 8, 4, 6, 1


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * H, H), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * FF, H), requires_grad=False)
        self.shard = torch.nn.Parameter(torch.zeros(H // 2, H), requires_grad=False)  # rows of TP rank 1 of 2
        self.norm = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        self.vocab = torch.nn.Parameter(torch.ones(H + 2, H), requires_grad=False)  # 2 rows of padding

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, "qkv".index(name) * H, H).copy_(w)
            elif name.startswith("expert"):
                e, part = int(name.split(".")[1]), name.split(".")[2]
                self.w13.data[e].narrow(0, 0 if part == "gate" else FF, FF).copy_(w)
            elif name == "o":
                self.shard.data.copy_(w.narrow(0, TP_RANK * H // 2, H // 2))
            elif name == "norm":
                self.norm.data[:] = w
            elif name == "scale":  # SGLang's default_weight_loader on one-element weights
                self.scale.data.fill_(w.item())
            elif name == "embed":  # a padded vocabulary shard: pad rows zeroed, an empty shard copied
                self.vocab.data[H:].zero_()
                self.vocab.data[:H].copy_(w)
                self.vocab.data[H:H].copy_(torch.zeros_like(self.vocab.data.narrow(0, H, 0)))


def _bucket(seed: int):
    g = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(H, H, generator=g)) for n in ("q", "k", "v", "o")]
    named += [(f"expert.{e}.{p}", torch.randn(FF, H, generator=g)) for e in range(E) for p in ("gate", "up")]
    named += [("norm", torch.randn(H, generator=g)), ("scale", torch.randn((), generator=g)),
              ("embed", torch.randn(H, H, generator=g))]
    names, dtypes, shapes = [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named]
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
    assert flat.numel() == bucket_nbytes(dtypes, shapes)
    return flat, names, dtypes, shapes


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_replay_loads_what_load_weights_loads():
    recorded, reference = Toy(), Toy()
    flat, names, dtypes, shapes = _bucket(0)
    plan, why = record_load(lambda: recorded.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, recorded)
    assert plan is not None, why
    # q, k, v, the experts' halves, the shard, the norm, the scale, the embedding; the pad rows' fill
    assert plan.copies == 3 + 2 * E + 4 and plan.fills == 1 and len(plan.steps) == 3, why

    flat2 = _bucket(1)[0].clone()  # a later bucket of the same layout, in a buffer of its own
    recorded.vocab.data[H:] = 5.0  # the replayed fill must put the pad rows back
    plan.replay(flat2)
    reference.load_weights(bucket_views(flat2, names, dtypes, shapes))
    for k, v in _state(reference).items():
        assert torch.equal(v, recorded.state_dict()[k]), k
    assert not torch.equal(_state(reference)["qkv"], Toy().qkv)  # the load really wrote something


def test_a_reallocated_parameter_invalidates_the_plan():
    m = Toy()
    flat, names, dtypes, shapes = _bucket(0)
    plan, _ = record_load(lambda: m.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, m)
    assert plan.valid()
    m.w13 = torch.nn.Parameter(torch.zeros(E, 2 * FF, H), requires_grad=False)  # a reload from disk swaps tensors
    assert not plan.valid()


class Derived(Toy):
    """DeepSeek-style: a weight computed from loaded ones after the copies (it would go stale)."""

    def load_weights(self, weights):
        super().load_weights(weights)
        self.absorbed = self.qkv.data[:H] @ self.qkv.data[H:2 * H].T


class Converting(Toy):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "norm":
                self.norm.data.copy_(w.to(torch.float64).to(torch.float32))


class Computed(Toy):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":
                self.qkv.data[:H].copy_(w * 2)


def test_loads_that_are_not_pure_copies_are_refused():
    for cls, word in ((Derived, "computes"), (Converting, "computes"), (Computed, "computes")):
        m = cls()
        flat, names, dtypes, shapes = _bucket(0)
        plan, why = record_load(lambda: m.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, m)
        assert plan is None and word in why, (cls.__name__, why)
    m = Toy()
    flat, names, dtypes, shapes = _bucket(0)
    plan, why = record_load(lambda: None, flat, m)
    assert plan is None and "copied nothing" in why


class Experts(torch.nn.Module):
    """SGLang's fused experts at engine TP rank 1 of 2: ``w13[e]`` = [gate rows of this rank; up rows],
    ``w2[e]`` = this rank's columns of ``down_proj`` (a strided source)."""

    I_FULL = 8

    def __init__(self, experts: int = 6):
        super().__init__()
        half = self.I_FULL // 2
        self.w13 = torch.nn.Parameter(torch.zeros(experts, 2 * half, H), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(experts, H, half), requires_grad=False)

    def load_weights(self, weights):
        half = self.I_FULL // 2
        for name, w in weights:
            e, part = int(name.split(".")[1]), name.split(".")[2]
            if part == "down":
                self.w2.data[e].copy_(w.narrow(1, half, half))
            else:
                self.w13.data[e].narrow(0, 0 if part == "gate" else half, half).copy_(w.narrow(0, half, half))


def _expert_bucket(seed: int, order, parts=("down", "gate", "up")):
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (Experts.I_FULL, H), "up": (Experts.I_FULL, H), "down": (H, Experts.I_FULL)}
    named = [(f"e.{e}.{p}", torch.randn(*shapes[p], generator=g)) for e in order for p in parts]
    names, dtypes, shapes = [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named]
    return torch.cat([t.flatten().view(torch.uint8) for _, t in named]), names, dtypes, shapes


@pytest.mark.parametrize("index_backwards", [False, True], ids=["cpu", "index_copy"])
def test_expert_copies_merge_into_few_calls_and_load_the_same_bytes(monkeypatch, index_backwards):
    """Every expert's three copies (the down_proj one strided) become a handful of calls, whether the
    bucket lists the experts in order or backwards (megatron's parameter buffer: one ``index_copy_`` on
    CUDA, forced here on CPU too), and the replay writes exactly what the model's own load writes."""
    monkeypatch.setattr(replayed_load, "_index_backwards", lambda t: index_backwards)
    for order in (range(6), range(5, -1, -1), [0, 1, 2, 4, 5]):
        recorded, reference = Experts(), Experts()
        flat, names, dtypes, shapes = _expert_bucket(0, order)
        plan, why = record_load(lambda: recorded.load_weights(bucket_views(flat, names, dtypes, shapes)), flat,
                                recorded)
        assert plan is not None, why
        counts = plan.counts()
        # gate/up: contiguous, one fused call; down (strided): one call, of merged copies per evenly spaced run
        assert counts["copies"] == 3 * len(order) and counts["calls"] == 2, (list(order), counts)
        merged_down = 1 if 3 in order else 2  # one run of evenly spaced experts, or two around the gap
        backwards = order[0] > order[-1] and not index_backwards  # else one copy per expert
        assert counts["copies_run"] == 2 * len(order) + (len(order) if backwards else merged_down), counts
        flat2 = _expert_bucket(1, order)[0].clone()
        plan.replay(flat2)
        reference.load_weights(bucket_views(flat2, names, dtypes, shapes))
        for k, v in _state(reference).items():
            assert torch.equal(v, recorded.state_dict()[k]), (list(order), k)


def test_copies_into_one_place_keep_their_order():
    """A step whose destinations overlap is replayed copy by copy in the recorded order (the later copy
    wins), never merged."""

    class Twice(Experts):
        def load_weights(self, weights):
            for name, w in weights:
                self.w13.data[0].narrow(0, 0, 4).copy_(w.narrow(0, 0, 4))

    m = Twice()
    flat, names, dtypes, shapes = _expert_bucket(0, range(3), parts=("gate",))
    plan, why = record_load(lambda: m.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, m)
    assert plan is not None and plan.counts()["copies_run"] == 3, why
    flat2 = _expert_bucket(1, range(3), parts=("gate",))[0].clone()
    plan.replay(flat2)
    last = bucket_views(flat2, names, dtypes, shapes)[-1][1]
    assert torch.equal(m.w13.data[0, :4], last[:4])


class Fp8Toy(torch.nn.Module):
    """SGLang's block-FP8 layers as a loader sees them: fused q/k/v and stacked gate/up experts in e4m3, each
    with its fp32 ``weight_scale_inv`` (one per 128x128 block), and a bf16 norm."""

    def __init__(self, experts: int = 2, n: int = 128):
        super().__init__()
        f8 = torch.float8_e4m3fn
        self.qkv = torch.nn.Parameter(torch.zeros(3 * n, n, dtype=f8), requires_grad=False)
        self.qkv_weight_scale_inv = torch.nn.Parameter(torch.zeros(3, 1), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(experts, 2 * n, n, dtype=f8), requires_grad=False)
        self.w13_weight_scale_inv = torch.nn.Parameter(torch.zeros(experts, 2, 1), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16), requires_grad=False)
        self.n = n

    def load_weights(self, weights):
        for name, w in weights:
            scale = name.endswith("_scale_inv")
            leaf = name.removesuffix("_scale_inv").removesuffix(".weight").split(".")[-1]
            if leaf in ("q_proj", "k_proj", "v_proj"):
                i = ("q_proj", "k_proj", "v_proj").index(leaf)
                (self.qkv_weight_scale_inv.data.narrow(0, i, 1) if scale
                 else self.qkv.data.narrow(0, i * self.n, self.n)).copy_(w)
            elif ".experts." in name:
                e, i = int(name.split(".experts.")[1].split(".")[0]), ("gate_proj", "up_proj").index(leaf)
                (self.w13_weight_scale_inv.data[e].narrow(0, i, 1) if scale
                 else self.w13.data[e].narrow(0, i * self.n, self.n)).copy_(w)
            else:
                self.norm.data.copy_(w)


def _fp8_bucket(seed: int, experts: int = 2, n: int = 128):
    from mrl.weight_sync.fp8 import quantize_bucket
    from mrl.weight_sync.planner import HFTensor

    h = "model.layers.0."
    spec = [(h + "input_layernorm.weight", (n,))] + [(f"{h}self_attn.{p}.weight", (n, n)) for p in
                                                     ("q_proj", "k_proj", "v_proj")]
    spec += [(f"{h}mlp.experts.{e}.{p}.weight", (n, n)) for e in range(experts) for p in ("gate_proj", "up_proj")]
    g = torch.Generator().manual_seed(seed)
    entries, flat = quantize_bucket([HFTensor(name, s, "bfloat16") for name, s in spec],
                                    [torch.randn(s, generator=g).to(torch.bfloat16) for _, s in spec])
    return flat.clone(), [e.name for e in entries], [e.dtype for e in entries], [list(e.shape) for e in entries]


def test_fp8_buckets_of_codes_and_scales_replay_like_any_dtype():
    """A bucket the FP8 sync sends (e4m3 codes, fp32 scales and bf16 back to back) decodes by its dtype
    names and is recorded and replayed as plain copies, scales included."""
    recorded, reference = Fp8Toy(), Fp8Toy()
    flat, names, dtypes, shapes = _fp8_bucket(0)
    assert set(dtypes) == {"float8_e4m3fn", "float32", "bfloat16"} and flat.numel() == bucket_nbytes(dtypes, shapes)
    views = dict(bucket_views(flat, names, dtypes, shapes))
    assert views["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert views["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 1)
    plan, why = record_load(lambda: recorded.load_weights(bucket_views(flat, names, dtypes, shapes)), flat, recorded)
    assert plan is not None and plan.copies == len(names), why
    flat2 = _fp8_bucket(1)[0]
    plan.replay(flat2)
    reference.load_weights(bucket_views(flat2, names, dtypes, shapes))
    got = recorded.state_dict()
    for k, v in reference.state_dict().items():  # bytes: torch.equal has no float8 kernel on CPU
        assert torch.equal(v.view(torch.uint8), got[k].view(torch.uint8)), k
    assert recorded.qkv_weight_scale_inv.abs().min() > 0
