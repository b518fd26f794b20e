"""Reward fns and environments with something wrong, for tests/unit/test_preflight.py (by dotted path)."""

from mrl.env.base import Environment, Step


def one_arg(prompt):
    """A reward fn that forgot ``response_text``."""
    return 1.0


def good(prompt, response_text):
    return 1.0


class NotAnEnv:
    """A class that is no ``mrl.env.Environment``."""


class TableEnv(Environment):
    """An environment whose factory needs a ``table``."""

    def __init__(self, table: str):
        self.table = table

    async def reset(self, prompt) -> str:
        return prompt.text

    async def step(self, turn: str) -> Step:
        raise NotImplementedError
