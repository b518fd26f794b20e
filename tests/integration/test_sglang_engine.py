"""Real SGLang (CPU mode, fp32) vs transformers and mrl's Megatron on the same tiny checkpoint, TP=1 and TP=2.

- greedy generation equals transformers' greedy output;
- engine logprobs equal Megatron's for the same tokens (<= 1e-3);
- recorded routes equal the experts Megatron's router picks (as sets per token and layer);
- abort + resume reproduces the uninterrupted greedy sequence;
- per-token weight versions are right across a version change.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from mrl.models import get_bridge
from mrl.sglang.client import EngineClient
from mrl.engine.server.cpu_attention import INSTALLED_MARK
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec
from tests.conftest import run_torchrun

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 9, 11, 250, 3], [1, 64, 128]]
NEW = 24
TPS = ["tp1", "tp2"]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def codec(ckpt_dir):
    return RoutesCodec.from_bridge(get_bridge(ckpt_dir["tiny"]))


@pytest.fixture(scope="module")
def hf_greedy(ckpt_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ckpt_dir["tiny"], dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = m.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def engine_samples(engines, codec):
    """Greedy samples from each engine through the rollout manager (one request per sample)."""

    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=NEW, temperature=0.0,
                                                                         ignore_eos=True), codec=codec)
        groups = await asyncio.gather(*(mgr.generate_group(p, n=1, group_id=i) for i, p in enumerate(PROMPTS)))
        return [g[0] for g in groups]

    return {tp: run(go(engines[tp].url)) for tp in TPS}


@pytest.fixture(scope="module")
def megatron_scores(ckpt_dir, engine_samples, tmp_path_factory):
    """Megatron (TP1, and TP2+SP) logprobs and natural routes for the TP1 engine's sequences."""
    d = tmp_path_factory.mktemp("score")
    seqs = [s.tokens for s in engine_samples["tp1"]]
    (d / "in.json").write_text(json.dumps({"sequences": seqs}))
    out = {}
    for name, nproc, args in [("tp1", 1, []), ("tp2", 2, ["--tp", "2"])]:
        f = d / f"{name}.json"
        r = run_torchrun("tests.jobs.score", ["--hf", ckpt_dir["tiny"], "--input", str(d / "in.json"),
                                            "--out", str(f), *args], nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = json.loads(f.read_text())["results"]
    return out


@pytest.mark.parametrize("tp", TPS)
def test_engine_runs_mrl_batched_cpu_attention(engine_samples, engines, tp):
    """The outputs these tests check came from mrl's batched attention (every TP rank's scheduler)."""
    with open(engines[tp].log_path) as f:
        assert f.read().count(INSTALLED_MARK) == engines[tp].tp


@pytest.mark.parametrize("tp", TPS)
def test_greedy_equals_transformers(engine_samples, hf_greedy, tp):
    for s, ref in zip(engine_samples[tp], hf_greedy):
        assert s.response_ids == ref
        assert s.finish_reason == "length" and s.versions == [0] * NEW


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_engine_logprobs_equal_megatron(engine_samples, megatron_scores, tp, layout):
    worst = 0.0
    for s, sc in zip(engine_samples[tp], megatron_scores[layout]):
        mc = np.asarray(sc["logprobs"])[len(s.prompt_ids) - 1:]  # logprob of each response token
        worst = max(worst, float(np.abs(mc - np.asarray(s.response_logprobs)).max()))
    assert worst <= 1e-3, worst


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_recorded_routes_equal_megatron_router(engine_samples, megatron_scores, tp, layout):
    for s, sc in zip(engine_samples[tp], megatron_scores[layout]):
        mc = np.asarray(sc["routes"])[: s.routes.shape[0]]  # engine rows: every position but the last
        assert mc.shape == s.routes.shape
        # megatron's no_grad top-k is unsorted: compare the expert sets of each token and layer
        assert np.array_equal(np.sort(mc, -1), np.sort(s.routes.astype(np.int64), -1))


@pytest.mark.parametrize("tp", TPS)
def test_abort_and_resume_reproduce_uninterrupted_greedy(engines, codec, tp):
    async def go(url):
        client = EngineClient(url)
        t0 = time.perf_counter()
        ref = await client.generate(PROMPTS[0], {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True},
                                    rid=f"ref-{tp}", return_routed_experts=True)
        duration = time.perf_counter() - t0
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=300, temperature=0.0, ignore_eos=True),
                             codec=codec)
        task = asyncio.create_task(mgr.run_sample(_sample(PROMPTS[0], 300)))
        await asyncio.sleep(0.4 * duration)  # mid-generation
        await client.pause("abort")  # in-flight request returns its partial; the resubmission blocks
        await client.resume()
        s = await task
        await client.close()
        return ref, s

    ref, s = run(go(engines[tp].url))
    assert s.num_aborts == 1 and s.num_segments == 2, "the pause did not interrupt the request"
    assert s.response_ids == ref.output_ids
    np.testing.assert_allclose(s.response_logprobs, ref.output_logprobs, atol=1e-4)
    ref_routes = codec.decode(ref.routed_experts, prompt_len=5, response_len=300)
    assert np.array_equal(s.routes, ref_routes)


def _sample(prompt, n):
    from mrl.rollout.sample import Sample

    return Sample(prompt_ids=list(prompt), group_id=0, index=0, max_new_tokens=n)


@pytest.mark.parametrize("tp", TPS)
def test_per_token_versions_across_a_version_change(engines, codec, tp):
    async def go(url):
        client = EngineClient(url)
        t0 = time.perf_counter()
        await client.generate(PROMPTS[2], {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True},
                              rid=f"timing-{tp}")
        duration = time.perf_counter() - t0
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=300, temperature=0.0, ignore_eos=True),
                             codec=codec)
        task = asyncio.create_task(mgr.generate_group(PROMPTS[1], n=2, group_id=0))
        await asyncio.sleep(0.4 * duration)  # mid-generation
        await client.pause("abort")
        await client.flush_cache()
        await client.update_weight_version("1", abort_all_requests=False)
        await client.resume()
        samples = await task
        version = await client.weight_version()
        # later tests expect version 0; the engine tags tokens with a version from the next continue on
        await client.pause("abort")
        await client.update_weight_version("0", abort_all_requests=False)
        await client.resume()
        await client.close()
        return samples, version

    samples, version = run(go(engines[tp].url))
    assert version == "1"
    for s in samples:
        assert s.num_aborts == 1
        k = s.versions.index(1)
        assert 0 < k < 300 and s.versions == [0] * k + [1] * (300 - k)
        assert len(s.response_ids) == 300 and s.routes.shape == (len(PROMPTS[1]) + 299, 3, 2)
