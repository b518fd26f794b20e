"""Reward fns for tests/unit/test_reward_data.py, loaded by dotted path (``tests.unit.reward_fns.<name>``)."""

import asyncio
import os
import time

NOT_CALLABLE = 3


def boom(prompt, response_text):
    raise RuntimeError("boom")


def sleepy(prompt, response_text):
    """Sleeps N seconds for a response "sleep N", then 1.0."""
    if response_text.startswith("sleep"):
        time.sleep(float(response_text.split()[1]))
    return 1.0


def pid(prompt, response_text):
    return float(os.getpid())


def returns_str(prompt, response_text):
    return "1.0"


def returns_nan(prompt, response_text):
    return float("nan")


def one_arg(prompt):
    return 1.0


async def async_sleepy(prompt, response_text):
    if response_text.startswith("sleep"):
        await asyncio.sleep(float(response_text.split()[1]))
    if response_text == "own timeout":
        raise TimeoutError("the verifier's own timeout")
    return 1.0


def crash(prompt, response_text):
    """The worker process dies (as a segfaulting verifier would) on a response "crash", else 1.0."""
    if response_text == "crash":
        os._exit(3)
    return 1.0


def flaky(prompt, response_text):
    if response_text.startswith("bad"):
        raise ValueError(f"cannot parse {response_text!r}")
    return 1.0
