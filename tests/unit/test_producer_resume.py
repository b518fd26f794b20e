"""A checkpoint taken while groups are in flight: their prompts are recorded (``Producer.unfinished``) and
a resumed producer generates them first, so no drawn prompt is skipped and none is repeated."""

from __future__ import annotations

import os
import time

import pytest

from mrl.config.schema import RewardConfig
from mrl.data.tasks import build_task
from mrl.reward.scorer import RewardScorer
from mrl.rollout.scorers import RuleScorer
from mrl.rollout.buffer import RolloutBuffer
from mrl.sglang.client import ClientTimeouts, EngineClient
from mrl.rollout.manager import RolloutManager
from mrl.rollout.producer import Producer
from mrl.rollout.sample import SamplingSpec
from tests.fakes.fake_sglang import FakeSGLang, Faults


@pytest.fixture(scope="module")
def tok(ckpt_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(ckpt_dir["tiny"], "tokenizer.json"))


def _producer(url: str, tok, **kw) -> tuple[Producer, RolloutBuffer]:
    mgr = RolloutManager([EngineClient(url, timeouts=ClientTimeouts(generate=60))],
                         sampling=SamplingSpec(max_new_tokens=3), probe_timeout_s=60)
    buf = RolloutBuffer(max_staleness=4, drop_stale=True)
    return Producer(manager=mgr, scorer=RuleScorer(RewardScorer(RewardConfig())), source=build_task("copy_last"),
                    tokenizer=tok, buffer=buf, group_size=2, dynamic_sampling=False, **kw), buf


def _until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_prompts_in_flight_at_a_checkpoint_are_generated_first_after_resume(tok):
    with FakeSGLang(faults=Faults(hang=True)) as srv:  # the engine never answers: groups stay in flight
        prod, _ = _producer(srv.url, tok)
        prod.start()
        prod.allow(3)
        _until(lambda: len(prod.unfinished()) == 3)
        assert prod.unfinished() == [0, 1, 2] and prod.next_index == 3
        prod.stop()
    with FakeSGLang() as srv:
        prod, buf = _producer(srv.url, tok, start_index=3, redo=[0, 2])
        assert prod.unfinished() == [0, 2]  # still owed before anything runs
        prod.start()
        prod.allow(3)
        _until(lambda: len(buf) >= 3)
        prod.stop()
        prod.check()
    groups = buf.take(3, 0, timeout=5)
    assert sorted(g.samples[0].group_id for g in groups) == [0, 2, 3]  # the owed prompts, then the next one
    assert prod.next_index == 4 and prod.unfinished() == []
