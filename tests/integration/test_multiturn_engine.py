"""Multi-turn episodes against a real SGLang engine (CPU mode, fp32, tiny Qwen3-MoE, TP=1).

- token in, token out: model turns are the engine's tokens, observations are tokenized once (loss mask 0);
- routes: each turn asks only for the rows it adds, and their concatenation equals the routes the engine
  records when it prefills the whole final conversation in one request (cache flushed first);
- versions: an episode driven across two weight-version changes keeps each token's version;
- prefix reuse: later turns find the earlier turns in the radix cache (hit rate reported).

On the session's TP1 engine; its weights are left as found (only the version label moves).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from mrl.data.prompt import Prompt
from mrl.env.base import Environment, Step
from mrl.models import get_bridge
from mrl.sglang.client import EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.multiturn import EpisodeLimits, EpisodeRunner
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec

OBSERVATIONS = [" tool says 7\nans=", " error: no key\n=", " ok\n"]


class ScriptedEnv(Environment):
    """Answers each turn with the next scripted observation; done after ``turns`` turns."""

    def __init__(self, *, turns: int = 3):
        self.turns, self.n = turns, 0

    async def reset(self, prompt: Prompt) -> str:
        return prompt.text

    async def step(self, turn: str) -> Step:
        self.n += 1
        if self.n >= self.turns:
            return Step(reward=1.0, done=True)
        return Step(observation=OBSERVATIONS[self.n - 1], reward=0.25)


ENV = f"{__name__}.ScriptedEnv"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engine(engines):
    return engines["tp1"]


@pytest.fixture(scope="module")
def codec(ckpt_dir):
    return RoutesCodec.from_bridge(get_bridge(ckpt_dir["tiny"]))


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(ckpt_dir["tiny"], "tokenizer.json"))


def _runner(url, codec, tok, *, turn_tokens: int, turns: int = 3, temperature: float = 0.0):
    client = EngineClient(url)
    mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=turn_tokens, temperature=temperature,
                                                         ignore_eos=True), codec=codec)
    limits = EpisodeLimits(max_turns=turns, max_turn_tokens=turn_tokens, max_total_tokens=4096)
    return client, mgr, EpisodeRunner(mgr, tok, env_fn=ENV, env_args={"turns": turns}, limits=limits)


PROMPT = Prompt(id="p0", text="find ab=", answer="7")


def test_episode_tokens_masks_and_routes_equal_one_prefill(engine, codec, tokenizer):
    async def go():
        client, mgr, runner = _runner(engine.url, codec, tokenizer, turn_tokens=12)
        await client.flush_cache()
        s = await runner.run_episode(PROMPT, group_id=0, index=0)
        # the whole final conversation in one request, nothing cached: the engine's own routes for it
        await client.flush_cache()
        full = await client.generate(s.tokens, {"max_new_tokens": 1, "temperature": 0.0}, rid="mt-full",
                                     return_routed_experts=True)
        full_routes = codec.decode(full.routed_experts, prompt_len=len(s.tokens), response_len=1)
        await client.close()
        return s, full_routes, mgr.stats

    s, full_routes, stats = run(go())
    assert s.error is None and s.finish_reason == "done" and s.metadata["turns"] == 3
    assert s.reward == pytest.approx(1.5)
    obs = [tokenizer.encode(o, add_special_tokens=False).ids for o in OBSERVATIONS[:2]]
    # layout: turn (12, mask 1) + observation (mask 0) + turn + observation + turn
    want_mask = [1] * 12 + [0] * len(obs[0]) + [1] * 12 + [0] * len(obs[1]) + [1] * 12
    assert s.loss_mask == want_mask
    assert s.response_ids[12:12 + len(obs[0])] == obs[0]  # observations appended as tokenized, once
    assert s.response_ids[24 + len(obs[0]):24 + len(obs[0]) + len(obs[1])] == obs[1]
    assert s.prompt_ids == tokenizer.encode(PROMPT.text).ids
    assert all(lp == 0.0 for lp, m in zip(s.response_logprobs, s.loss_mask) if not m)
    assert s.num_segments == 3  # one call per turn: each turn asked only for its own rows
    t = len(s.tokens)
    assert s.routes.shape == (t - 1, len(codec.moe_layers), codec.top_k)
    # the full prefill routes every token (its last row is the one-token generation's input, t - 1 rows
    # of the conversation before it)
    assert full_routes.shape[0] == t
    same = np.array_equal(s.routes, full_routes[:t - 1])
    as_sets = np.array_equal(np.sort(s.routes, -1), np.sort(full_routes[:t - 1], -1))
    differ = int((s.routes != full_routes[:t - 1]).any(-1).sum())
    assert same, f"per-turn routes differ from one prefill on {differ} (token, layer) rows; as sets equal: {as_sets}"
    # turns 2 and 3 continue the previous turn's prefix in the radix cache
    assert stats.cached_tokens > 0 and stats.prompt_tokens > stats.cached_tokens


def test_episode_keeps_versions_across_two_syncs(engine, codec, tokenizer):
    async def go():
        client, mgr, runner = _runner(engine.url, codec, tokenizer, turn_tokens=120)
        task = asyncio.create_task(runner.run_episode(PROMPT, group_id=1, index=0))
        # sync 1 inside turn 2 (turn 1 answered, then a moment), sync 2 once turn 2 is back (3 calls:
        # turn 1, turn 2's aborted segment, its resumption): as the loop does, drain (abort in-flight, hold
        # new calls), flush the cache (KV of the old weights), new version, go on
        for version, after_calls, delay in (("1", 1, 0.3), ("2", 3, 0.0)):
            while not task.done() and mgr.stats.segments < after_calls:
                await asyncio.sleep(0.02)
            await asyncio.sleep(delay)
            await mgr.drain(timeout=60)
            await client.pause("abort")
            await client.flush_cache()
            await client.update_weight_version(version, abort_all_requests=False)
            await client.resume()
            mgr.undrain()
        s = await task
        # later tests expect version 0; the engine tags tokens with a version from the next continue on
        await client.pause("abort")
        await client.update_weight_version("0", abort_all_requests=False)
        await client.resume()
        await client.close()
        return s

    s = run(go())
    assert s.error is None and s.finish_reason == "done"
    v = s.versions
    assert v == sorted(v), "versions went backwards"
    assert set(v) == {0, 1, 2}, f"the episode did not span both syncs: {sorted(set(v))}"
    for i, m in enumerate(s.loss_mask):
        if m == 0:  # an observation carries the version of the turn it answers
            assert v[i] == v[i - 1]
    assert s.routes.shape[0] == len(s.tokens) - 1
    assert s.loss_mask.count(1) == 3 * 120
