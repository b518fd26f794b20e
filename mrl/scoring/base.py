"""The scorer interface: a whole group in, per-sample rewards (and optionally per-token rewards) out.

    class MyScorer(Scorer):
        async def score(self, group: ScoringGroup) -> GroupScores:
            return GroupScores(rewards=[float(len(t) < 20) for t in group.texts])

A scorer sees what the rollout produced for one prompt: the prompt, every sample's token ids, decoded text,
the engine's logprobs, which response tokens the model generated (``loss_mask``: the turn boundaries of a
multi-turn episode) and the sample's metadata (an environment's info, its reward). It returns one reward
per sample, ``None`` for a sample that must not be trained (the group is then dropped, counted), and may
return a reward per response token: those reach the advantage as ``mrl.algo.token_advantages`` says.

Scorers run on the rollout process's event loop, concurrently with generation: ``score`` must not block
(run blocking work in a thread, or talk to a server). A scorer that cannot score a group raises
``ScoringError`` (the run stops, naming it) or returns ``None`` rewards (the group is dropped, counted).
"""

from __future__ import annotations

import abc
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from mrl.data.prompt import Prompt


class ScoringError(RuntimeError):
    """A group that could not be scored (its calls failed wherever they went), or, raised out of a scorer,
    one that cannot go on (too many failed groups): the run stops."""


class NoScoringEngine(ScoringError):
    """Every engine of a scoring pool is down and none is starting: the run stops."""


@dataclass
class ScoringGroup:
    """One prompt's samples as the rollout left them (``mrl.rollout.sample.Sample``: ``prompt_ids``,
    ``response_ids``, ``response_logprobs``, ``loss_mask``, ``metadata``, ``reward``) and their texts."""

    prompt: Prompt
    samples: list[Any]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.samples)

    def turns(self, i: int) -> list[tuple[int, int]]:
        """Sample ``i``'s model turns as ``[start, end)`` spans of its response tokens (one span for a
        single-turn sample; observations of an episode lie between the spans)."""
        mask = list(self.samples[i].loss_mask) or [1] * len(self.samples[i].response_ids)
        spans, start = [], None
        for t, m in enumerate(mask + [0]):
            if m and start is None:
                start = t
            elif not m and start is not None:
                spans.append((start, t))
                start = None
        return spans


@dataclass
class GroupScores:
    """What a scorer says of a group: ``rewards[i]`` of sample i (None: not trainable, the group is dropped);
    ``token_rewards[i][t]`` of its response token t (None: the scorer gives none); ``errors[i]`` a failure
    that was scored anyway (counted)."""

    rewards: list[float | None]
    token_rewards: list[list[float]] | None = None
    errors: list[str | None] = field(default_factory=list)

    def check(self, group: ScoringGroup, who: str) -> "GroupScores":
        """The shapes match the group's; raises ``ValueError`` naming ``who`` otherwise."""
        if len(self.rewards) != len(group):
            raise ValueError(f"{who}: {len(self.rewards)} rewards for a group of {len(group)}")
        if self.token_rewards is not None:
            if len(self.token_rewards) != len(group):
                raise ValueError(f"{who}: token rewards for {len(self.token_rewards)} samples, "
                                 f"the group has {len(group)}")
            for i, (tr, s) in enumerate(zip(self.token_rewards, group.samples)):
                if len(tr) != len(s.response_ids):
                    raise ValueError(f"{who}: sample {i} has {len(s.response_ids)} response tokens, "
                                     f"{len(tr)} token rewards")
        if not self.errors:
            self.errors = [None] * len(group)
        return self

    @property
    def dropped(self) -> bool:
        return any(r is None for r in self.rewards)


class Scorer(abc.ABC):
    """A group-level scorer (see the module docstring). ``stats`` are counters the loop logs under
    ``rollout/scoring_*``; ``aclose`` and then ``close`` end what it started (connections, servers, workers)."""

    name: str = "scorer"

    @abc.abstractmethod
    async def score(self, group: ScoringGroup) -> GroupScores:
        """Rewards of ``group``'s samples (and, optionally, of their response tokens)."""

    def stats(self) -> dict[str, float]:
        return {}

    async def aclose(self) -> None:
        """Close what lives on the scoring event loop (HTTP sessions); called on that loop before ``close``."""

    def close(self) -> None:
        pass


def load_scorer(path: str, args: dict[str, Any] | None = None) -> Scorer:
    """An instance of the ``Scorer`` subclass (or factory returning one) at dotted ``path``, built with ``args``.

    Raises ValueError naming the path and what is wrong."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"scoring.scorers: cls={path!r} is not a dotted path 'package.module.Class'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as e:
        raise ValueError(f"scoring.scorers: cls={path!r}: module {e.name!r} not found") from None
    except AttributeError:
        raise ValueError(f"scoring.scorers: cls={path!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"scoring.scorers: cls={path!r} is a {type(obj).__name__}, not a class or factory")
    try:
        inspect.signature(obj).bind(**(args or {}))
    except TypeError as e:
        raise ValueError(f"scoring.scorers: cls={path!r} cannot take args={dict(args or {})} ({e})") from None
    except ValueError:
        pass
    scorer = obj(**(args or {}))
    if not isinstance(scorer, Scorer):
        raise ValueError(f"scoring.scorers: cls={path!r} made a {type(scorer).__name__}, not an mrl.scoring.Scorer")
    return scorer
