"""Reward faults: a crashed worker's pool is rebuilt (later rewards are real, not error values); an error rate
above ``reward.max_error_rate`` stops the run naming the fn and its last error; user fns run in processes by
default; a data-supplied ``answer_pattern`` that backtracks forever is stopped by ``reward.timeout_s``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from mrl.config.load import compose
from mrl.config.schema import RewardConfig, RewardExecutor
from mrl.data import Prompt
from mrl.reward import RewardError, RewardScorer
from mrl.reward.scorer import ERROR_RATE_WINDOW, resolve_executor
from tests.conftest import REPO

pytestmark = pytest.mark.reliability
FNS = "tests.unit.reward_fns"
P = Prompt(id="p0", text="3+4=", answer="7")


def _score(cfg: RewardConfig, batches: list[list[str]]):
    async def main():
        out = []
        with RewardScorer(cfg) as scorer:
            for texts in batches:
                out.append(await scorer.score_many([(P, t) for t in texts]))
            return out, scorer.stats
    return asyncio.run(main())


def test_crashed_reward_worker_pool_is_rebuilt(reliability):
    cfg = RewardConfig(fn=f"{FNS}.crash", executor=RewardExecutor.process, num_workers=2, timeout_s=60)
    (before, crashed, after), stats = _score(cfg, [["7"], ["crash"], ["7", "7", "7"]])
    assert before[0].value == 1.0
    assert crashed[0].value == 0.0 and "BrokenProcessPool" in crashed[0].error  # crashed twice: counted
    assert [r.value for r in after] == [1.0, 1.0, 1.0] and all(r.error is None for r in after)
    assert stats["pool_restarts"] >= 1 and stats["errors"] == 1
    reliability.record(category="fault", name="reward worker process crashes", survived=True,
                       injected="reward fn calling os._exit in its worker (reward.executor=process)",
                       expected="the call is counted as an error, the pool is rebuilt, later rewards are real",
                       message=f"{crashed[0].error}; pool_restarts {stats['pool_restarts']}, then 3 of 3 scored 1.0")


def test_error_rate_above_limit_stops_with_fn_and_last_error(reliability):
    cfg = RewardConfig(fn=f"{FNS}.flaky", executor=RewardExecutor.thread, max_error_rate=0.5)
    (res,), stats = _score(cfg, [["bad 1", "7", "7"] * 40])  # a third fail: under the limit
    assert stats["errors"] == 40 and sum(r.value == 1.0 for r in res) == 80
    with pytest.raises(RewardError) as e:
        _score(cfg, [[f"bad {i}" for i in range(ERROR_RATE_WINDOW)]])
    msg = str(e.value)
    assert msg.startswith(f"reward.fn={FNS}.flaky: {ERROR_RATE_WINDOW} of the last {ERROR_RATE_WINDOW} calls "
                          "failed, more than reward.max_error_rate=0.5"), msg
    assert msg.endswith("ValueError: cannot parse 'bad 63'"), msg
    with pytest.raises(ValueError, match=r"reward.max_error_rate: must be in \[0, 1\], got 1.5"):
        RewardConfig(max_error_rate=1.5)
    reliability.record(category="bad_input", name="reward fn failing on most calls", survived=True,
                       injected=f"reward fn raising on every call, {ERROR_RATE_WINDOW} calls",
                       expected="the run stops naming reward.fn and the last error", message=msg)


def test_user_reward_fns_default_to_processes():
    assert resolve_executor(compose([]).reward) is RewardExecutor.thread  # built-in exact_match
    assert resolve_executor(compose(["reward=format_and_correct"]).reward) is RewardExecutor.thread
    user = compose([f"reward.fn={FNS}.pid"]).reward
    assert user.executor is RewardExecutor.auto and resolve_executor(user) is RewardExecutor.process
    (res,), _ = _score(RewardConfig(fn=f"{FNS}.pid", num_workers=1), [["x"]])
    assert res[0].error is None and res[0].value != float(os.getpid())


_CATASTROPHIC = """
import asyncio, time
from mrl.config.schema import RewardConfig, RewardExecutor
from mrl.data import Prompt
from mrl.reward import RewardScorer
p = Prompt(id="evil", text="x", answer="b", meta={"answer_pattern": "(a|a)+"})
cfg = RewardConfig(fn="mrl.reward.builtin.format_and_correct", executor=RewardExecutor.thread, timeout_s=1.0)
async def main():
    with RewardScorer(cfg) as s:
        return await s.score(p, "a" * 40 + "!")
t0 = time.monotonic()
r = asyncio.run(main())
print(round(time.monotonic() - t0, 1), r.value, r.error)
"""


def test_answer_pattern_that_backtracks_forever_is_stopped_by_the_timeout(reliability):
    # In a subprocess: a regex without a limit holds the GIL for hours, and pytest with it. The subprocess
    # exiting proves the match itself stopped: interpreter exit joins the reward threads.
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _CATASTROPHIC], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    seconds, value, error = p.stdout.strip().split(" ", 2)
    assert float(seconds) < 10 and value == "0.0" and time.monotonic() - t0 < 40
    # the scorer's limit and the match's are the same; whichever notices first names the failure
    assert error in ("timed out after 1.0s", "TimeoutError: answer_pattern '(a|a)+' of prompt 'evil' did not finish "
                                             "matching within 1.0 s (reward.timeout_s)"), error
    reliability.record(category="timeout", name="answer_pattern with catastrophic backtracking", survived=True,
                       injected="answer_pattern '(a|a)+' against 40 a's and a '!', reward.timeout_s=1",
                       expected="the call fails (counted) within the limit", message=f"{error} (after {seconds} s)")
