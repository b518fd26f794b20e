"""The environment interface of multi-turn rollouts: async ``reset`` / ``step``, loaded by dotted path.

    class MyEnv(Environment):
        async def reset(self, prompt: Prompt) -> str:
            return prompt.text                        # the first observation: the episode's prompt
        async def step(self, turn: str) -> Step:
            call = parse_tool_call(turn)              # the model's text -> ("lookup", "cab") or None
            if call is None:
                return Step(reward=float(turn.strip() == self.answer), done=True)
            return Step(observation=await self.tool(*call))   # raise ToolError for a failed call

    mrl train rollout.env.fn=my_pkg.envs.MyEnv +rollout.env.args.table=/data/t.json

One instance per episode (``rollout.env.args`` go to its constructor), so instance attributes are the
episode's state. The episode loop (``mrl.rollout.multiturn``) owns tokens, limits and counting:

- ``ToolError`` from ``step``: the message becomes the next observation (``error_observation``), the
  episode goes on, the error is counted;
- ``step`` taking longer than ``rollout.env.tool_timeout_s``: cancelled, the same as a ToolError saying
  so (the environment must tolerate a cancelled step);
- any other exception, from ``reset`` or ``step``: the episode (and its GRPO group) is dropped and counted;
  the run goes on.
"""

from __future__ import annotations

import abc
import functools
import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from mrl.data.prompt import Prompt


class ToolError(Exception):
    """A tool call failed on the model's input (unknown tool, bad argument, missing key): the message
    becomes the next observation, so the model can read it and try again."""


@dataclass(frozen=True)
class Step:
    observation: str = ""
    """Text appended to the conversation before the next model turn (tokenized once, loss mask 0)."""
    reward: float = 0.0
    """Added to the episode's reward (the GRPO reward is the sum over steps)."""
    done: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.observation, str):
            raise TypeError(f"Step.observation must be a str, got {type(self.observation).__name__}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"Step.reward must be a finite number, got {self.reward!r}")


class Environment(abc.ABC):
    """One episode's environment. Subclasses implement ``reset`` and ``step``; both are coroutines
    (a blocking tool belongs in ``asyncio.to_thread``: the loop runs every episode of the rollout)."""

    @abc.abstractmethod
    async def reset(self, prompt: Prompt) -> str:
        """The first observation (usually ``prompt.text``): the conversation's first tokens."""

    @abc.abstractmethod
    async def step(self, turn: str) -> Step:
        """React to one model turn (its decoded text, special tokens dropped)."""

    def error_observation(self, message: str) -> str:
        """The observation that shows the model a failed tool call (``ToolError`` or a timeout)."""
        return f"error: {message}\n"


_CALL = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\((?P<arg>[^()]*)\)\s*$")


def parse_tool_call(turn: str) -> tuple[str, str] | None:
    """``name(arg)`` alone on the turn (surrounding space ignored) -> ``(name, arg)``; else None, which
    environments read as a final answer. A minimal syntax the tiny default model can learn; richer
    environments parse their own (JSON, XML tags) in ``step``."""
    m = _CALL.match(turn)
    return (m["name"], m["arg"].strip()) if m else None


@functools.cache
def load_env_factory(path: str) -> Callable[..., Environment]:
    """The class (or factory) at dotted ``path`` ("pkg.module.Class"), checked to be callable."""
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"rollout.env.fn={path!r}: expected a dotted path 'package.module.Class'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"rollout.env.fn={path!r}: module {module_name!r} not found ({e})") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"rollout.env.fn={path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ValueError(f"rollout.env.fn={path!r}: a {type(obj).__name__} is not callable")
    return obj


def make_env(path: str, args: dict[str, Any] | None = None) -> Environment:
    """A fresh environment for one episode."""
    env = load_env_factory(path)(**dict(args or {}))
    if not isinstance(env, Environment):
        raise TypeError(f"rollout.env.fn={path!r} made a {type(env).__name__}, not an mrl.env.Environment")
    return env
