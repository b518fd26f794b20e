"""Multi-turn episodes: token in, token out, one sample per episode.

    runner = EpisodeRunner(manager, tokenizer, env_fn="mrl.env.lookup.LookupEnv", limits=EpisodeLimits())
    samples = await runner.run_group(prompt, n=8, group_id=0)   # rewards from the environment

The conversation is one growing token list. The environment's first observation is tokenized into
``prompt_ids``; each model turn is appended exactly as the engine produced it (``RolloutManager.
generate_turn``: per-token logprobs, versions, aborts and retries as for a single-turn sample); each
later observation is tokenized once, on its own, and appended with loss mask 0. Nothing is ever decoded
and re-encoded into the conversation (a chat template re-rendered each turn can merge or split tokens
at the seams, and the trained tokens would no longer be the sampled ones).

Routes: each engine call asks only for the rows its input adds (``routed_experts_start_len``), so the
sample's routes are the concatenation, one row per token but the last, observation tokens included (the
trainer's forward pass runs over them). An episode always ends after a model turn, so every row exists.

Versions: a weight sync may land inside a turn (the turn resumes from its partial) or between turns;
each model token keeps the version that produced it, an observation token the version of the turn it
answers (it does not depend on the weights; so the staleness bound sees only model tokens).

Limits: ``max_turns`` model turns, ``max_total_tokens`` for the whole conversation, ``max_turn_tokens``
per turn, ``tool_timeout_s`` per ``step``. A ``ToolError`` or a timed-out step becomes an observation
with the error text (counted); any other exception of the environment drops the episode (counted).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from mrl.data.prompt import Prompt
from mrl.env.base import Step, ToolError, load_env_factory, make_env
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import Sample


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    max_turns: int = 4
    max_total_tokens: int = 256
    """Prompt + every turn + every observation."""
    max_turn_tokens: int = 32
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 2 or self.max_turn_tokens < 1:
            raise ValueError(f"episode limits: need max_turns >= 1, max_total_tokens >= 2, max_turn_tokens >= 1; "
                             f"got {self}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"episode limits: tool_timeout_s must be > 0, got {self.tool_timeout_s}")


class EpisodeRunner:
    def __init__(self, manager: RolloutManager, tokenizer, *, env_fn: str, env_args: dict[str, Any] | None = None,
                 limits: EpisodeLimits | None = None):
        """``tokenizer``: a ``tokenizers.Tokenizer`` (``encode(text, add_special_tokens=...).ids``, ``decode``)."""
        load_env_factory(env_fn)  # a bad path fails here, at start, not in the first episode
        self.manager, self.tok, self.env_fn = manager, tokenizer, env_fn
        self.env_args = dict(env_args or {})
        self.limits = limits or EpisodeLimits()
        self.counts: Counter = Counter()
        """episodes, episodes_dropped, turns, tool_errors, tool_timeouts, finish_<reason>."""

    async def run_group(self, prompt: Prompt, n: int, group_id: int) -> list[Sample]:
        return list(await asyncio.gather(*(self.run_episode(prompt, group_id, i) for i in range(n))))

    async def run_episode(self, prompt: Prompt, group_id: int, index: int) -> Sample:
        """One episode to its end. Never raises for engine or environment faults: ``sample.error`` is
        set and counted instead. ``sample.reward`` is the sum of the environment's step rewards."""
        lim = self.limits
        self.counts["episodes"] += 1
        try:
            env = make_env(self.env_fn, self.env_args)
            first = await asyncio.wait_for(env.reset(prompt), lim.tool_timeout_s)
        except Exception as e:  # a broken environment drops this episode, never the run
            return self._dropped(Sample(prompt_ids=[], group_id=group_id, index=index, max_new_tokens=0),
                                 f"environment reset raised {type(e).__name__}: {e}")
        ids = self.tok.encode(first).ids
        sample = Sample(prompt_ids=ids, group_id=group_id, index=index,
                        max_new_tokens=max(0, lim.max_total_tokens - len(ids)))
        sample.reward, sample.metadata["turns"], sample.metadata["tool_errors"] = 0.0, 0, 0
        if not ids or len(ids) >= lim.max_total_tokens:
            return self._dropped(sample, f"first observation of {len(ids)} tokens leaves no room under "
                                         f"max_total_tokens={lim.max_total_tokens}")
        finish = "max_turns"
        for turn in range(lim.max_turns):
            start = len(sample.response_ids)
            budget = min(lim.max_turn_tokens, lim.max_total_tokens - len(sample.tokens))
            await self.manager.generate_turn(sample, budget)
            if sample.error is not None:  # the engines could not finish the turn (counted by the manager)
                self.counts["episodes_failed"] += 1
                return sample
            sample.metadata["turns"] += 1
            self.counts["turns"] += 1
            step = await self._step(env, sample, self.tok.decode(sample.response_ids[start:], skip_special_tokens=True))
            if step is None:
                return sample
            sample.reward += float(step.reward)
            if step.done:
                finish = "done"
                break
            if turn == lim.max_turns - 1:  # no turn would follow the observation: end on the model's turn
                break
            obs = self.tok.encode(step.observation, add_special_tokens=False).ids
            if len(sample.tokens) + len(obs) >= lim.max_total_tokens:  # no room left for a model token
                finish = "length"
                break
            self._append_observation(sample, obs)
        sample.finish_reason = finish
        self.counts[f"finish_{finish}"] += 1
        sample.check()
        return sample

    async def _step(self, env, sample: Sample, turn: str) -> Step | None:
        """``env.step`` under the tool timeout; a tool error becomes an error observation, anything else
        drops the episode (None)."""
        try:
            step = await asyncio.wait_for(env.step(turn), self.limits.tool_timeout_s)
            if not isinstance(step, Step):
                raise TypeError(f"step returned a {type(step).__name__}, not an mrl.env.Step")
            return step
        except ToolError as e:
            self.counts["tool_errors"] += 1
            sample.metadata["tool_errors"] += 1
            return Step(observation=env.error_observation(str(e)))
        except asyncio.TimeoutError:
            self.counts["tool_timeouts"] += 1
            sample.metadata["tool_errors"] += 1
            return Step(observation=env.error_observation(f"tool timed out after {self.limits.tool_timeout_s:g} s"))
        except Exception as e:
            self._dropped(sample, f"environment step raised {type(e).__name__}: {e}")
            return None

    def _append_observation(self, sample: Sample, obs: list[int]) -> None:
        n = len(obs)
        sample.response_ids += obs
        sample.loss_mask += [0] * n
        sample.response_logprobs += [0.0] * n  # never trained (mask 0); a number keeps the arrays aligned
        sample.versions += [sample.versions[-1]] * n  # the turn it answers; a turn always precedes it
        if self.manager.top_logprobs_num:  # Keep Sampling Mask: the token itself is its whole support
            sample.support += [[t] for t in obs]
            sample.support_log_mass += [0.0] * n

    def _dropped(self, sample: Sample, why: str) -> Sample:
        self.counts["episodes_dropped"] += 1
        sample.error = why
        sample.metadata["env_dropped"] = True
        return sample

    def stats(self) -> dict[str, float]:
        """Counts, plus the mean turns per finished episode."""
        c = dict(self.counts)
        done = sum(v for k, v in c.items() if k.startswith("finish_"))
        if done:
            c["turns_per_episode"] = c.get("turns", 0) / done
        return {k: (float(v) if not isinstance(v, float) or math.isfinite(v) else 0.0) for k, v in c.items()}
