"""The environment of the built-in ``lookup`` task (``mrl.data.tasks.LookupTask``): one tool, ``get(key)``.

    find cab=          <- first observation (the prompt)
    get(cab)<eos>      <- model turn 1: a tool call                       (loss mask 1)
     7\\nans=           <- observation: the episode's table value of cab   (loss mask 0)
    7<eos>             <- model turn 2: the answer; reward 1 iff it is the value of the prompt's key

Any turn that is not a tool call is the final answer. A call of another tool, or a key that is not a
string of the task's letters, is a ``ToolError`` (its message is the next observation).
"""

from __future__ import annotations

from mrl.data.prompt import Prompt
from mrl.data.tasks import lookup_value
from mrl.env.base import Environment, Step, ToolError, parse_tool_call


class LookupEnv(Environment):
    def __init__(self, *, answer_prefix: str = "ans="):
        self.answer_prefix = answer_prefix
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> str:
        for k in ("salt", "input", "alphabet", "min_len", "max_len"):
            if k not in prompt.meta:
                raise ValueError(f"LookupEnv: prompt {prompt.id} has no meta[{k!r}] (not a data=lookup prompt?)")
        self.prompt = prompt
        return prompt.text

    async def step(self, turn: str) -> Step:
        call = parse_tool_call(turn)
        if call is None:
            return Step(reward=float(turn.strip() == self.prompt.answer), done=True)
        return Step(observation=f" {self.get(*call)}\n{self.answer_prefix}")

    def get(self, name: str, key: str) -> str:
        m = self.prompt.meta
        if name != "get":
            raise ToolError(f"unknown tool {name!r} (tools: get(key))")
        if not (m["min_len"] <= len(key) <= m["max_len"] and set(key) <= set(m["alphabet"])):
            raise ToolError(f"no key {key!r}")
        return lookup_value(m["salt"], key)
