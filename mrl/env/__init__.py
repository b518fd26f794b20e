"""Environments for multi-turn, tool-using rollouts (``rollout.env.fn``): interface and built-ins."""

from mrl.env.base import Environment, Step, ToolError, load_env_factory, make_env, parse_tool_call

__all__ = ["Environment", "Step", "ToolError", "load_env_factory", "make_env", "parse_tool_call"]
