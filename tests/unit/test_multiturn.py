"""Multi-turn episodes: the environment interface, the lookup task, and the episode loop's limits and faults.

The loop runs against the fixture-shaped fake server (deterministic tokens, SGLang's routes layout,
``routed_experts_start_len`` honoured) to inject environment faults cheaply; the real engine's side
(routes equal to one prefill, versions across syncs, prefix cache) is tests/integration/test_multiturn_engine.py.
"""

from __future__ import annotations

import asyncio
import base64
import os

import numpy as np
import pytest
import torch

from mrl.data import build_task
from mrl.data.prompt import Prompt
from mrl.data.tasks import lookup_value
from mrl.env import Environment, Step, ToolError, make_env, parse_tool_call
from mrl.env.lookup import LookupEnv
from mrl.sglang.client import EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.multiturn import EpisodeLimits, EpisodeRunner
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec
from tests.fakes.fake_sglang import FakeSGLang, FakeState, routes_b64

CODEC = RoutesCodec(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 1, 2))
PROMPT = Prompt(id="p", text="find ab=", answer="7")


class Scripted(Environment):
    """``script``: per turn, an observation str, or an exception to raise ("sleep" sleeps 5 s)."""

    script: list = []

    def __init__(self, *, fail_reset: bool = False):
        self.fail_reset, self.n = fail_reset, 0

    async def reset(self, prompt):
        if self.fail_reset:
            raise RuntimeError("reset broke")
        return prompt.text

    async def step(self, turn):
        item = self.script[min(self.n, len(self.script) - 1)]
        self.n += 1
        if isinstance(item, BaseException):
            raise item
        if item == "sleep":
            await asyncio.sleep(5)
        if item is None:
            return Step(reward=1.0, done=True)
        return Step(observation=item)


ENV = f"{__name__}.Scripted"


@pytest.fixture(scope="module")
def tok(ckpt_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(ckpt_dir["tiny"], "tokenizer.json"))


def episode(tok, script, *, limits=EpisodeLimits(max_turns=4, max_turn_tokens=5, max_total_tokens=200,
                                                 tool_timeout_s=0.5), env_args=None):
    Scripted.script = script

    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=5), codec=CODEC)
        runner = EpisodeRunner(mgr, tok, env_fn=ENV, env_args=env_args, limits=limits)
        s = await runner.run_episode(PROMPT, 0, 0)
        await mgr.slots[0].client.close()
        return s, runner

    with FakeSGLang() as srv:
        return asyncio.run(go(srv.url))


# -- interface ------------------------------------------------------------------------------------------
def test_parse_tool_call():
    assert parse_tool_call("get(ab)") == ("get", "ab")
    assert parse_tool_call("  get( ab ) \n") == ("get", "ab")
    assert parse_tool_call("7") is None and parse_tool_call("get(ab) 7") is None and parse_tool_call("") is None


def test_env_loading_errors_are_clear():
    with pytest.raises(ValueError, match="dotted path"):
        make_env("nodots")
    with pytest.raises(ValueError, match="not found"):
        make_env("no_such_pkg_xyz.Env")
    with pytest.raises(ValueError, match="no attribute"):
        make_env("mrl.env.lookup.Nope")
    with pytest.raises(TypeError, match="not an mrl.env.Environment"):
        make_env("collections.OrderedDict")
    with pytest.raises(ValueError, match="finite"):
        Step(reward=float("nan"))
    with pytest.raises(TypeError, match="str"):
        Step(observation=[1, 2])


def test_config_refuses_bad_env_limits():
    from mrl.config.schema import EnvConfig

    for bad in ({"max_turns": 0}, {"max_total_tokens": 1}, {"max_turn_tokens": 0}, {"tool_timeout_s": 0},
                {"fn": "nodots"}):
        with pytest.raises(ValueError, match="rollout.env"):
            EnvConfig(**bad)


# -- the lookup task ------------------------------------------------------------------------------------
def test_lookup_task_needs_its_tool():
    task = build_task("lookup", seed=3)
    p = task.sample(0)
    assert p.text == f"find {p.meta['input']}=" and p.answer == lookup_value(p.meta["salt"], p.meta["input"])
    # the same key maps to other digits in other epochs: the prompt alone does not give the answer
    key = p.meta["input"]
    answers = {task.sample(i).answer for i in range(0, 40 * len(task)) if task.sample(i).meta["input"] == key}
    assert len(answers) >= 5
    assert build_task("lookup", seed=3).sample(0) == p  # deterministic

    async def go():
        env = LookupEnv()
        assert await env.reset(p) == p.text
        step = await env.step(f"get({key})")
        assert step == Step(observation=f" {p.answer}\nans=") and not step.done
        with pytest.raises(ToolError, match="unknown tool"):
            await env.step("put(ab)")
        with pytest.raises(ToolError, match="no key"):
            await env.step("get(xyz)")
        assert (await env.step(p.answer)) == Step(reward=1.0, done=True)
        wrong = str((int(p.answer) + 1) % 10)
        assert (await env.step(wrong)) == Step(reward=0.0, done=True)
        with pytest.raises(ValueError, match="meta"):
            await LookupEnv().reset(Prompt(id="x", text="find ab=", answer="1"))

    asyncio.run(go())


# -- the episode loop -----------------------------------------------------------------------------------
def test_episode_layout_masks_versions_and_routes(tok):
    s, runner = episode(tok, [" obs one\n", " two\n", None])
    assert s.error is None and s.finish_reason == "done" and s.reward == 1.0 and s.metadata["turns"] == 3
    o1, o2 = (tok.encode(o, add_special_tokens=False).ids for o in (" obs one\n", " two\n"))
    assert s.loss_mask == [1] * 5 + [0] * len(o1) + [1] * 5 + [0] * len(o2) + [1] * 5
    assert s.response_ids[5:5 + len(o1)] == o1 and s.response_ids[10 + len(o1):10 + len(o1) + len(o2)] == o2
    assert s.response_logprobs[5:5 + len(o1)] == [0.0] * len(o1)
    assert len(s.versions) == len(s.response_ids)
    # one call per turn, each asked only for its rows; their concatenation = the fake's whole-sequence routes
    assert s.num_segments == 3
    full = CODEC.decode(routes_b64(s.tokens[:-1], FakeState()), prompt_len=len(s.tokens) - 1, response_len=0)
    assert np.array_equal(s.routes, full)
    assert runner.counts["episodes"] == 1 and runner.counts["turns"] == 3 and runner.counts["finish_done"] == 1


def test_tool_error_and_timeout_become_observations(tok):
    s, runner = episode(tok, [ToolError("no key 'zz'"), "sleep", None])
    assert s.error is None and s.finish_reason == "done" and s.metadata["tool_errors"] == 2
    text = tok.decode(s.response_ids, skip_special_tokens=True)
    assert "error: no key 'zz'\n" in text and "error: tool timed out after 0.5 s\n" in text
    assert runner.counts["tool_errors"] == 1 and runner.counts["tool_timeouts"] == 1


@pytest.mark.parametrize("where", ["step", "reset"])
def test_environment_exception_drops_the_episode(tok, where):
    s, runner = episode(tok, [KeyError("boom"), None], env_args={"fail_reset": where == "reset"})
    assert s.error is not None and s.metadata["env_dropped"]
    assert ("step raised KeyError" if where == "step" else "reset raised RuntimeError: reset broke") in s.error
    assert runner.counts["episodes_dropped"] == 1


def test_turn_and_token_limits(tok):
    s, runner = episode(tok, [" again\n"], limits=EpisodeLimits(max_turns=3, max_turn_tokens=4, max_total_tokens=200))
    # the episode ends on the model's last turn: no observation after it, every token has its route row
    assert s.finish_reason == "max_turns" and s.metadata["turns"] == 3 and s.loss_mask[-4:] == [1] * 4
    assert s.routes.shape[0] == len(s.tokens) - 1
    n_prompt = len(tok.encode(PROMPT.text).ids)
    s, _ = episode(tok, [" a much longer observation than fits\n"],
                   limits=EpisodeLimits(max_turns=5, max_turn_tokens=4, max_total_tokens=n_prompt + 10))
    assert s.finish_reason == "length" and len(s.tokens) <= n_prompt + 10 and s.loss_mask == [1] * 4
    s, runner = episode(tok, [None], limits=EpisodeLimits(max_total_tokens=n_prompt))
    assert s.error and "no room" in s.error and runner.counts["episodes_dropped"] == 1


def test_routes_start_len_is_checked_by_the_client():
    async def go(url):
        c = EngineClient(url)
        with pytest.raises(ValueError, match="outside"):
            await c.generate([1, 2, 3], {"max_new_tokens": 1}, rid="r", return_routed_experts=True,
                             routed_experts_start_len=4)
        out = await c.generate([1, 2, 3], {"max_new_tokens": 2}, rid="r", return_routed_experts=True,
                               routed_experts_start_len=2)
        assert len(base64.b64decode(out.routed_experts)) == (3 + 2 - 1 - 2) * 3 * 2 * 4
        await c.close()

    with FakeSGLang() as srv:
        asyncio.run(go(srv.url))


# -- the producer ---------------------------------------------------------------------------------------
def _producer_run(tok, script, env_args, wait_for):
    """A producer of episode groups (group size 2) on the fake server until ``wait_for(producer)``."""
    import time

    from mrl.rollout.buffer import RolloutBuffer
    from mrl.rollout.producer import Producer
    from mrl.rollout.scorers import EnvScorer

    Scripted.script = script
    with FakeSGLang() as srv:
        mgr = RolloutManager([EngineClient(srv.url)], sampling=SamplingSpec(max_new_tokens=3), codec=CODEC)
        runner = EpisodeRunner(mgr, tok, env_fn=ENV, env_args=env_args,
                               limits=EpisodeLimits(max_turns=3, max_turn_tokens=3))
        buf = RolloutBuffer(max_staleness=4, drop_stale=True)
        prod = Producer(manager=mgr, scorer=EnvScorer(), source=build_task("lookup"), tokenizer=tok,
                        buffer=buf, group_size=2, dynamic_sampling=False, episodes=runner)
        prod.start()
        prod.allow(2)
        deadline = time.monotonic() + 60
        while not wait_for(prod, buf) and time.monotonic() < deadline:
            time.sleep(0.05)
        prod.stop()
        prod.check()
        return prod, buf, runner


def test_producer_buffers_episode_groups_with_the_environments_rewards(tok):
    prod, buf, runner = _producer_run(tok, [" obs\n", None], None, lambda p, b: len(b) >= 2)
    groups = buf.take(2, 0, timeout=5)
    assert [g.rewards for g in groups] == [[1.0, 1.0], [1.0, 1.0]]  # from Step(reward=1.0), not reward.fn
    for s in (s for g in groups for s in g.samples):
        assert s.loss_mask.count(0) > 0 and s.routes.shape[0] == len(s.tokens) - 1
    assert prod.counts["groups_buffered"] == 2 and runner.counts["episodes"] == 4


def test_producer_drops_groups_whose_environment_fails_and_goes_on(tok):
    prod, buf, runner = _producer_run(tok, [None], {"fail_reset": True},
                                      lambda p, b: p.counts["groups_env_dropped"] >= 3)
    # each dropped group gave its credit back, so the producer kept going: never the run
    assert prod.counts["groups_env_dropped"] >= 3 and len(buf) == 0 and prod.error is None
    assert runner.counts["episodes_dropped"] >= 6


def test_build_batch_carries_the_loss_mask_and_normalizes_over_trained_tokens():
    from mrl.config.schema import Aggregation, AlgoConfig, Config, RolloutConfig
    from mrl.rollout.buffer import Group
    from mrl.rollout.sample import Sample
    from mrl.trainer.batch import build_batch

    def sample(mask, n=None):
        n = len(mask) if n is None else n
        return Sample(prompt_ids=[1, 2], group_id=0, index=0, max_new_tokens=n, response_ids=list(range(3, 3 + n)),
                      response_logprobs=[-1.0] * n, versions=[0] * n, loss_mask=mask)

    cfg = Config(rollout=RolloutConfig(n_samples_per_prompt=2), algo=AlgoConfig(aggregation=Aggregation.token_mean))
    multi = [Group(PROMPT, [sample([1, 0, 0, 1]), sample([1, 1, 1, 1])], [1.0, 0.0])]
    batch, norm, _ = build_batch(multi, cfg, with_routes=False)
    assert batch.loss_mask == [[1, 0, 0, 1], [1, 1, 1, 1]] and norm == 6.0  # 2 observation tokens not counted
    single = [Group(PROMPT, [sample([1, 1]), sample([], n=2)], [1.0, 0.0])]  # []: a sample stored before masks
    batch, norm, _ = build_batch(single, cfg, with_routes=False)
    assert batch.loss_mask is None and norm == 4.0


def test_lookup_warm_start_is_the_solving_episode_token_for_token(tok):
    task = build_task("lookup")
    p = task.sample(4)
    ids, n = task.warm_start_tokens(p, tok, eos=2)

    async def episode_tokens():  # what the episode loop appends for the solving turns
        env = LookupEnv()
        first = tok.encode(await env.reset(p)).ids
        call = tok.encode(f"get({p.meta['input']})", add_special_tokens=False).ids + [2]
        step = await env.step(tok.decode(call, skip_special_tokens=True))
        obs = tok.encode(step.observation, add_special_tokens=False).ids
        answer = tok.encode(p.answer, add_special_tokens=False).ids + [2]
        final = await env.step(tok.decode(answer, skip_special_tokens=True))
        assert final == Step(reward=1.0, done=True)
        return first, first + call + obs + answer

    first, want = asyncio.run(episode_tokens())
    assert ids == want and n == len(first)
    # the solving turn fits the task's turn budget (rollout.env.max_turn_tokens defaults to it): the default
    # max_new_tokens (4) cuts the tool call short, and the episode never learns
    call = tok.encode(f"get({p.meta['input']})", add_special_tokens=False).ids + [2]
    assert task.max_turn_tokens >= len(call) > 4


def test_advantages_are_taken_within_each_group_of_its_own_size():
    from mrl.algo import compute_advantages
    from mrl.config.schema import AlgoConfig, Config, RolloutConfig
    from mrl.rollout.buffer import Group
    from mrl.rollout.sample import Sample
    from mrl.trainer.batch import build_batch

    def sample():
        return Sample(prompt_ids=[1, 2], group_id=0, index=0, max_new_tokens=2, response_ids=[3, 4],
                      response_logprobs=[-1.0, -1.0], versions=[0, 0])

    cfg = Config(rollout=RolloutConfig(n_samples_per_prompt=2), algo=AlgoConfig())
    groups = [Group(PROMPT, [sample(), sample()], [1.0, 0.0]), Group(PROMPT, [sample()] * 3, [1.0, 1.0, 0.0])]
    batch, _, _ = build_batch(groups, cfg, with_routes=False)
    want = [*compute_advantages(torch.tensor([1.0, 0.0]), 2, cfg.algo).tolist(),
            *compute_advantages(torch.tensor([1.0, 1.0, 0.0]), 3, cfg.algo).tolist()]
    assert batch.advantages == pytest.approx(want) and batch.advantages[2] == batch.advantages[3] > 0
