"""Keep Sampling Mask against a real SGLang 0.5.10 CPU engine (TP1, fp32, tiny model).

Sampled with top-k/top-p (and min-p), ``return_logprob`` and ``top_logprobs_num = top_k``; transformers gives
the trainer-side logits (fp32 CPU engine logits match it to ~1e-6). Checked at every response position:
the sampled token is in the trainer-side support; the support rebuilt from the engine's own top logprobs
equals the trainer-side one; the engine reports ``log softmax(logits / T)`` over the full vocabulary (temperature
applied, no truncation), so the masked logprob = engine logprob - log(engine mass of the support).
The engines run without --enable-deterministic-inference, so ``sampling_seed`` is accepted but unused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mrl.sglang.client import EngineClient
from tests.peek import count_support_mismatch
from mrl.routing.sampling_mask import (
    masked_logprobs,
    support_from_top_logprobs,
    support_mask,
)

NEW = 16
# the tiny model's logits are nearly flat (spread ~0.2): at T=1 only top-k bites; T=0.05 makes top-p and min-p bite
REQUESTS = [
    ([1, 17, 42, 99, 7], dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.0)),
    ([1, 300, 5, 9, 11], dict(temperature=0.05, top_k=20, top_p=0.8, min_p=0.05)),
]


@pytest.fixture(scope="module")
def responses(engines):
    async def go(url):
        client = EngineClient(url)
        outs = await asyncio.gather(*(
            client.generate(prompt, {"max_new_tokens": NEW, "ignore_eos": True, "sampling_seed": 1234 + i, **params},
                            rid=f"smask-{i}", return_logprob=True, top_logprobs_num=params["top_k"])
            for i, (prompt, params) in enumerate(REQUESTS)))
        await client.close()
        return outs

    return asyncio.run(go(engines["tp1"].url))


@pytest.fixture(scope="module")
def trainer_logits(ckpt_dir, responses):
    """Logits [R, V] predicting each response token, from transformers on prompt + response."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir["tiny"], dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for (prompt, _), r in zip(REQUESTS, responses):
            logits = model(torch.tensor([prompt + r.output_ids])).logits[0]
            out.append(logits[len(prompt) - 1: len(prompt) + len(r.output_ids) - 1])
    return out


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_engine_support_equals_trainer_support_and_contains_the_sample(responses, trainer_logits, i):
    params, r, logits = REQUESTS[i][1], responses[i], trainer_logits[i]
    assert len(r.output_ids) == NEW and len(r.output_top_logprobs) == NEW
    assert all(len(step) == params["top_k"] for step in r.output_top_logprobs)
    tokens = torch.tensor(r.output_ids)
    mask = support_mask(logits, **params)
    engine_ids = support_from_top_logprobs(r.output_top_logprobs, **params)
    assert count_support_mismatch(mask, engine_ids) == 0
    assert all(t in ids for t, ids in zip(r.output_ids, engine_ids))
    _, outside = masked_logprobs(logits, tokens, mask, params["temperature"], on_outside="raise")
    assert not outside.any()
    sizes = mask.sum(-1)
    if i == 0:
        assert sizes.eq(params["top_k"]).all()  # flat logits at T=1: top-k decides
    else:
        assert sizes.lt(params["top_k"]).any() and sizes.gt(1).any()  # top-p / min-p cut inside the top-20


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_engine_logprobs_are_temperature_scaled_and_untruncated(responses, trainer_logits, i):
    params, r, logits = REQUESTS[i][1], responses[i], trainer_logits[i]
    temperature, tokens = params["temperature"], torch.tensor(r.output_ids)
    engine_lp = torch.tensor(r.output_logprobs)
    full = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(engine_lp, full, atol=1e-4, rtol=0)  # measured <= 2e-6 (T=0.05 scales logit error by 20)

    mask = support_mask(logits, **params)
    masked, _ = masked_logprobs(logits, tokens, mask, temperature, on_outside="raise")
    engine_ids = support_from_top_logprobs(r.output_top_logprobs, **params)
    log_mass = torch.tensor([torch.logsumexp(torch.tensor([lp for lp, t in step if t in ids]), 0).item()
                             for step, ids in zip(r.output_top_logprobs, engine_ids)])
    torch.testing.assert_close(masked, engine_lp - log_mass, atol=1e-4, rtol=0)
    assert (log_mass < -1e-3).all()  # the support never holds all the mass here: engine logprob != masked logprob
