"""Keep Sampling Mask: the support equals SGLang 0.5.10's sampler support; off-support tokens get no mass.

Hand-computed small-vocab cases, then SGLang's own ``top_k_top_p_min_p_sampling_from_probs_torch`` as the
oracle (its multinomial is intercepted to read back exactly which sorted entries it kept), then the
trainer's loss path: ``train_step.forward_backward`` on an in-process tiny megatron model.
"""

import math

import pytest
import torch

from mrl.sglang.protocol import parse_generate
from tests.peek import count_support_mismatch
from mrl.routing.sampling_mask import (
    IncompleteSupportError,
    OutsideSupportError,
    mask_from_support_ids,
    SupportSpec,
    engine_support,
    masked_logprobs,
    support_from_top_logprobs,
    support_logprobs,
    support_mask,
    support_tensor,
)
from tests.fakes.fake_sglang import fixture
from tests.unit.test_packing import gloo_world, tiny  # noqa: F401  (in-process tiny megatron model, module-scoped)

P = [0.1, 0.4, 0.2, 0.3]  # sorted: id1 0.4, id3 0.3, id2 0.2, id0 0.1


def logits_of(probs):
    return torch.tensor([probs]).log()


def support(logits, **kw):
    args = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) | kw
    return sorted(support_mask(logits, **args)[0].nonzero().flatten().tolist())


def engine_top_logprobs(logits_NV, temperature, num):
    """What SGLang returns as output_top_logprobs: topk of log(softmax(logits / T)), [lp, id, text]."""
    lp, ids = torch.log(torch.softmax(logits_NV / temperature, -1)).topk(num, dim=-1)
    return [[[v, i, None] for v, i in zip(r_lp, r_id)] for r_lp, r_id in zip(lp.tolist(), ids.tolist())]


@pytest.mark.parametrize("top_k,want", [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (4, [0, 1, 2, 3]),
                                        (-1, [0, 1, 2, 3]), (100, [0, 1, 2, 3])])
def test_top_k_only(top_k, want):
    assert support(logits_of(P), top_k=top_k) == want


@pytest.mark.parametrize("top_p,want", [
    (0.3, [1]),             # 0.4 alone crosses 0.3: kept, nothing after it
    (0.5, [1, 3]),          # 0.4 < 0.5, so 0.3 (the token that crosses top_p) is kept
    (0.75, [1, 2, 3]),
    (0.95, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_only_keeps_the_crossing_token(top_p, want):
    assert support(logits_of(P), top_p=top_p) == want


def test_top_k_and_top_p_use_unrenormalized_mass_on_pytorch_backend():
    p = logits_of([0.4, 0.3, 0.2, 0.1])
    assert support(p, top_k=3, top_p=0.5) == [0, 1]
    assert support(p, top_k=1, top_p=0.9) == [0]
    # excl mass before 0.3 is 0.4 <= 0.5 -> kept; renormalized over the top-2 it would be 0.4/0.7 > 0.5
    assert support(p, top_k=2, top_p=0.5) == [0, 1]
    # flashinfer with min_p renormalizes over the top-k first (top_k_renorm_prob -> top_p_renorm_prob)
    assert support(p, top_k=2, top_p=0.5, min_p=0.01, backend="flashinfer") == [0]
    assert support(p, top_k=2, top_p=0.5, backend="flashinfer") == [0, 1]  # joint: no renormalization


@pytest.mark.parametrize("min_p,want", [(0.0, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.4, [0, 1]), (1.0, [0])])
def test_min_p(min_p, want):
    assert support(logits_of([0.5, 0.25, 0.15, 0.1]), min_p=min_p) == want  # threshold = 0.5 * min_p


@pytest.mark.parametrize("temperature,want", [(2.0, [0, 1, 2]), (1.0, [0, 1]), (0.5, [0]), (0.0, [0])])
def test_temperature_is_applied_before_top_p(temperature, want):
    # T=2: [.455 .276 .167 .102] excl .731 <= .85; T=1: [.644 .237 .087 .032] excl .881 > .85; T=.5: .867 > .85
    assert support(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), temperature=temperature, top_p=0.85) == want


def test_temperature_zero_is_greedy_whatever_top_k_says():
    assert support(torch.tensor([[0.0, 3.0, 2.9, 1.0]]), temperature=0.0, top_k=-1) == [1]


def test_ties_at_the_boundary_keep_every_tied_token():
    ties = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert support(ties, top_k=2) == [0, 1, 2]
    assert support(ties, top_k=1) == [0, 1, 2]
    assert support(logits_of([0.3, 0.3, 0.3, 0.1]), top_p=0.2) == [0, 1, 2]


def test_underflowed_tokens_are_not_in_the_support():
    # probs [1, 0, 0, 0] in fp32: the engine's sort keeps zeros in its top-3, multinomial never draws them
    assert support(torch.tensor([[0.0, -200.0, -200.0, -300.0]]), top_k=3) == [0]


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0), dict(min_p=-0.1),
                                dict(temperature=-1.0)])
def test_invalid_params_are_refused_like_sglang(kw):
    with pytest.raises(ValueError):
        support(logits_of(P), **kw)


def test_off_support_token_gets_zero_mass_and_zero_gradient():
    logits = logits_of(P).repeat(2, 1).requires_grad_(True)
    mask = support_mask(logits, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)  # {1, 3}
    tokens = torch.tensor([1, 0])  # row 1 sampled id 0: outside the support
    with pytest.raises(OutsideSupportError, match="1 sampled token"):
        masked_logprobs(logits, tokens, mask, 1.0, on_outside="raise")
    lp, outside = masked_logprobs(logits, tokens, mask, 1.0, on_outside="drop")
    assert outside.tolist() == [False, True]
    assert lp[0].item() == pytest.approx(math.log(0.4 / 0.7), abs=1e-6)
    assert lp[1].item() == float("-inf") and lp[1].exp().item() == 0.0
    lp.masked_fill(outside, 0.0).sum().backward()
    g = logits.grad
    assert torch.equal(g[:, [0, 2]], torch.zeros(2, 2))  # off-support logits: exactly zero gradient
    assert torch.equal(g[1], torch.zeros(4))              # dropped row: no gradient at all
    assert g[0, 1] == pytest.approx(1 - 0.4 / 0.7) and g[0, 3] == pytest.approx(-0.3 / 0.7)


def test_outside_rows_carry_no_gradient_even_if_not_dropped():
    logits = logits_of(P).requires_grad_(True)
    mask = torch.tensor([[False, True, False, True]])
    lp, outside = masked_logprobs(logits, torch.tensor([2]), mask, 1.0, on_outside="drop")
    lp.sum().backward()
    assert outside.item() and torch.equal(logits.grad, torch.zeros(1, 4))


def test_masked_logprob_is_engine_logprob_minus_log_support_mass():
    torch.manual_seed(0)
    logits = torch.randn(6, 32) * 2
    mask = support_mask(logits, temperature=0.7, top_k=5, top_p=0.8, min_p=0.0)
    tokens = (logits.masked_fill(~mask, -1e9)).argmax(-1)
    lp, _ = masked_logprobs(logits, tokens, mask, 0.7, on_outside="raise")
    engine_lp = torch.log_softmax(logits / 0.7, -1)  # what SGLang reports: temperature, no truncation
    want = engine_lp.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(engine_lp.masked_fill(~mask, -torch.inf), -1)
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.0),
                                dict(temperature=0.3, top_k=20, top_p=0.9, min_p=0.05),
                                dict(temperature=0.5, top_k=8, top_p=1.0, min_p=0.0),
                                dict(temperature=0.0, top_k=5, top_p=1.0, min_p=0.0),
                                dict(temperature=0.4, top_k=8, top_p=0.7, min_p=0.1, backend="flashinfer")])
@pytest.mark.parametrize("extra", [0, 3])
def test_support_from_top_logprobs_equals_full_logits_support(kw, extra):
    torch.manual_seed(1)
    logits = torch.randn(40, 200) * 3
    top = engine_top_logprobs(logits, kw["temperature"] or 1.0, kw["top_k"] + extra)
    ids = support_from_top_logprobs(top, **kw)
    mask = support_mask(logits, **kw)
    assert count_support_mismatch(mask, ids) == 0
    assert torch.equal(mask_from_support_ids(ids, 200), mask)


def test_top_logprobs_fewer_than_top_k_work_only_when_the_cut_is_inside():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    top3 = engine_top_logprobs(logits, 1.0, 3)
    assert support_from_top_logprobs(top3, temperature=1.0, top_k=6, top_p=0.5, min_p=0.0) == [[0]]
    with pytest.raises(IncompleteSupportError, match="top_logprobs_num >= top_k"):
        support_from_top_logprobs(top3, temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    with pytest.raises(IncompleteSupportError):
        support_from_top_logprobs(top3, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)


def test_count_support_mismatch_counts_positions():
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, True]])
    assert count_support_mismatch(mask, [[0, 1], [0, 1], [1]]) == 2


def test_recorded_greedy_response_support_is_the_sampled_token():
    out = parse_generate(fixture("gen_logprob_start0_top2.json")["body"], ("http://fixture", "/generate"))
    ids = support_from_top_logprobs(out.output_top_logprobs, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0)
    assert ids == [[t] for t in out.output_ids]


# -- SGLang's own sampler as the oracle ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def sglang_sampler():
    return pytest.importorskip("sglang.srt.layers.sampler")


def sglang_support(sampler, monkeypatch, logits_NV, temperature, top_k, top_p, min_p):
    """The engine's exact kept set: intercept torch.multinomial inside SGLang's pytorch-backend sampler and
    ask it, for every sorted slot j, which token id sits there and whether its probability survived."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    n, v = logits_NV.shape
    probs = torch.softmax(logits_NV / sp.temperature, -1)  # Sampler.forward: div_(temperatures); softmax
    seen = {}

    def fake_multinomial(probs_sort, num_samples):
        seen["kept"] = probs_sort > 0
        return torch.full((probs_sort.shape[0], 1), seen["slot"], dtype=torch.long)

    monkeypatch.setattr(sampler.torch, "multinomial", fake_multinomial)
    mask = torch.zeros(n, v, dtype=torch.bool)
    for j in range(v):
        seen["slot"] = j
        tok = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), torch.full((n,), sp.top_k, dtype=torch.int32), torch.full((n,), sp.top_p),
            torch.full((n,), sp.min_p), sp.min_p > 0, None, torch.zeros(n, dtype=torch.long))
        mask[torch.arange(n), tok.long()] = seen["kept"][:, j]
    monkeypatch.undo()
    assert TOP_K_ALL == 1 << 30
    return mask


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 0.8, 0.0), (0.6, -1, 0.9, 0.0), (1.0, 3, 1.0, 0.0), (0.8, 7, 0.5, 0.1),
    (0.5, -1, 1.0, 0.2), (1.3, 12, 0.95, 0.05), (0.0, -1, 1.0, 0.0),
])
def test_support_mask_equals_sglang_pytorch_sampler(sglang_sampler, monkeypatch, temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 24, generator=g) * torch.linspace(0.3, 4.0, 64)[:, None]  # flat .. peaked rows
    want = sglang_support(sglang_sampler, monkeypatch, logits, temperature, top_k, top_p, min_p)
    got = support_mask(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert torch.equal(got, want)
    top = engine_top_logprobs(logits, temperature or 1.0, 24 if top_k == -1 else top_k)
    ids = support_from_top_logprobs(top, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert count_support_mismatch(want, ids) == 0


def test_sglang_seeded_sampler_can_emit_an_off_support_token(sglang_sampler, monkeypatch):
    """--enable-deterministic-inference: a hash of 2**32-1 gives +inf gumbel noise; on a zeroed (log 0 = -inf)
    entry that is NaN, and argmax picks it. The mask catches the token instead of training on it."""
    s = sglang_sampler
    monkeypatch.setattr(s, "multinomial_with_seed", s.multinomial_with_seed._torchdynamo_orig_callable)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])

    def hash_with_max_at_sorted_slot_4(seed, positions, cols):
        h = torch.full((seed.shape[0], cols.shape[0]), 12345, dtype=torch.int64)
        h[:, 4] = 2**32 - 1
        return h

    monkeypatch.setattr(s, "murmur_hash32", hash_with_max_at_sorted_slot_4)
    probs = torch.softmax(logits, -1)
    tok = s.top_k_top_p_min_p_sampling_from_probs_torch(
        probs, torch.tensor([2], dtype=torch.int32), torch.tensor([1.0]), torch.tensor([0.0]), False,
        torch.tensor([42]), torch.tensor([0]))
    assert tok.tolist() == [4]  # top_k=2 allows only {0, 1}
    mask = support_mask(logits, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    with pytest.raises(OutsideSupportError):
        masked_logprobs(logits, tok, mask, 1.0, on_outside="raise")
    lp, outside = masked_logprobs(logits, tok, mask, 1.0, on_outside="drop")
    assert outside.item() and lp.item() == float("-inf")


# -- the sparse (token-id) support the loss uses ------------------------------------------------------------

def test_support_ids_equal_the_dense_mask():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    mask = support_mask(logits, temperature=0.7, top_k=5, top_p=0.9, min_p=0.0)
    ids = support_tensor([row.nonzero().flatten().tolist() for row in mask])
    tokens = torch.tensor([int(row.nonzero()[0]) for row in mask])
    tokens[2] = int((~mask[2]).nonzero()[0])  # one sampled token outside
    dense, out_d = masked_logprobs(logits, tokens, mask, 0.7, on_outside="drop")
    sparse, out_s = support_logprobs(logits, tokens, ids, 0.7, on_outside="drop")
    assert torch.equal(out_d, out_s) and out_s.tolist() == [False, False, True, False, False, False]
    assert torch.allclose(sparse[~out_s], dense[~out_s], atol=1e-6) and sparse[2] == float("-inf")
    ids[4] = -1  # no support at all: plain log-softmax (prompt or padding position)
    lp, out = support_logprobs(logits, tokens, ids, 0.7, on_outside="drop")
    assert not out[4] and lp[4] == pytest.approx(float(torch.log_softmax(logits[4] / 0.7, -1)[tokens[4]]), abs=1e-6)


def test_engine_support_gives_ids_log_mass_and_empty_when_undecided():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    top = [[[float(lp), int(i), None] for lp, i in zip(*torch.topk(row, 3))] for row in torch.log_softmax(logits, -1)]
    ids, mass = engine_support(top, temperature=1.0, top_k=-1, top_p=0.7, min_p=0.0)
    assert sorted(ids[0]) == [0, 1] and mass[0] == pytest.approx(math.log(0.8), abs=1e-6)
    assert ids[1] == [] and mass[1] == 0.0  # the 0.7 cut falls past the 3 returned candidates


# -- through the training loss path (train_step.forward_backward, real megatron forward/backward) -----------

@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_outside_token_gets_no_mass_and_no_gradient_in_the_loss_path(tiny, packed):  # noqa: F811
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.packing import Packing
    from mrl.megatron.train_step import MicroBatch, forward_backward

    v = tiny.bridge.vocab_size
    temperature = 0.7
    g = torch.Generator().manual_seed(3)
    lengths, prompt = [12, 9], 4
    ids = torch.randint(1, v, (2, 12), generator=g)
    ids[1, 9:] = 0
    tiny.model.eval()
    ref_logits = forward_logits(tiny.model, tiny.layout, ids)[..., :v]  # same weights, no grad
    # supports: the 6 most likely tokens at each response position, with the sampled token swapped in;
    # at sample 0, position 6 the sampled token is left outside its support
    support = torch.full((2, 11, 6), -1, dtype=torch.long)
    mask = torch.zeros(2, 11)
    for b, n in enumerate(lengths):
        for t in range(prompt - 1, n - 1):
            cand, nxt = ref_logits[b, t].topk(7).indices, ids[b, t + 1]
            top = cand[cand != nxt][:6]
            if (b, t) != (0, 6):
                top[-1] = nxt
            support[b, t], mask[b, t] = top, 1.0
    assert not (support[0, 6] == ids[0, 7]).any()

    if packed:
        pk = Packing.build(lengths, [[1, 0]], row_len=22, num_rows=1)  # both samples in one row
        mb = MicroBatch(pk.pack_tokens(ids, 0), data={"mask": mask}, packing=pk,
                        support=pk.pack_predictions(support, -1))
    else:
        mb = MicroBatch(ids, data={"mask": mask}, support=support)
    grads = []

    def keep_grad(_module, _inputs, out):  # logits [s, b, V]: their gradient, as [b, s, V]
        out[0].register_hook(lambda gr: grads.append(gr.transpose(0, 1).clone()))

    hook = tiny.model.output_layer.register_forward_hook(keep_grad)
    seen = {}

    def loss_fn(lp, batch):
        seen["mask"] = batch.data["mask"].clone()
        return -(lp * batch.data["mask"]).sum(), {}

    tiny.model.train()
    try:
        spec = SupportSpec(temperature=temperature, on_outside="drop")
        out = forward_backward(tiny.model, tiny.layout, [mb], vocab_size=v, loss_fn=loss_fn, support=spec)[0]
        with pytest.raises(OutsideSupportError, match="1 sampled token"):
            forward_backward(tiny.model, tiny.layout, [mb], vocab_size=v, loss_fn=loss_fn,
                             support=SupportSpec(temperature=temperature, on_outside="raise"))
    finally:
        hook.remove()
    assert float(out["outside_support_tokens"]) == 1.0
    assert seen["mask"][0, 6] == 0 and seen["mask"].sum() == mask.sum() - 1  # dropped from the loss only
    # in-support tokens: log-softmax of logits / T over the support alone (mass sums to 1 there)
    lp = out["logprobs"]
    for b, n in enumerate(lengths):
        for t in range(prompt - 1, n - 1):
            if (b, t) == (0, 6):
                continue
            x = ref_logits[b, t, support[b, t]] / temperature
            want = x[support[b, t] == ids[b, t + 1]] - torch.logsumexp(x, 0)
            assert float(lp[b, t]) == pytest.approx(float(want), abs=1e-5), (b, t)
    # gradients of the logits: only on support ids, and none at all where the token was outside
    grad = grads[0][..., :v]
    grad = pk.unpack_predictions(grad[:, :-1]) if packed else grad[:, :-1]
    on_support = torch.zeros(2, 11, v, dtype=torch.bool).scatter_(-1, support.clamp(min=0), support >= 0)
    assert torch.equal(grad[~on_support], torch.zeros_like(grad[~on_support]))
    assert torch.equal(grad[0, 6], torch.zeros(v))
    assert (grad[1, prompt - 1].abs() > 0).sum() == 6  # a kept position: every support logit moves


def test_top_logprobs_to_request():
    from mrl.routing.sampling_mask import top_logprobs_to_request

    assert top_logprobs_to_request(temperature=1.0, top_k=20, top_logprobs_num=None) == 20
    assert top_logprobs_to_request(temperature=1.0, top_k=-1, top_logprobs_num=64) == 64
    assert top_logprobs_to_request(temperature=0.0, top_k=-1, top_logprobs_num=None) == 1
    with pytest.raises(ValueError, match="rollout.top_logprobs_num"):
        top_logprobs_to_request(temperature=1.0, top_k=-1, top_logprobs_num=None)
