"""A generative judge and a reward model on real SGLang engines (CPU), their servers built by the trainer side
(``RunEngines.side_groups``) and started by the pool, as in a run:

- the judge is the tiny random policy, whose text is no verdict: the judge's text is the engine's own greedy
  generation for the rendered template (decoded), unparseable verdicts are retried (counted) and then fall back
  or drop the group; a verdict table that holds the engine's text parses it;
- the reward model (a tiny ``Qwen3ForSequenceClassification``, served on SGLang's classification path) scores
  prompt + response as transformers' own forward of the checkpoint does (fp32); its engine SIGKILLed, the pool
  replaces it and the group is rescored to the same values.
"""

from __future__ import annotations

import asyncio
import os
import signal
import types

import pytest

from mrl.config.load import compose
from mrl.config.scoring import JudgeConfig
from mrl.data import Prompt
from mrl.models.tiny import make_tiny_model, make_tiny_reward_model
from mrl.scoring import ScoringGroup
from mrl.scoring.judge import JudgeScorer, render
from mrl.scoring.pool import ScoringPool
from mrl.scoring.reward_model import RewardModelScorer
from mrl.sglang.client import EngineClient
from mrl.trainer.engines import RunEngines

PROMPTS = [Prompt(id="p0", text="last cab=", answer="b"), Prompt(id="p1", text="sum 12+30=", answer="42")]
TEXTS = [["b", "c", "bb"], ["42", "4", "the answer is 42"]]
ENGINE = ["engine.cpu_threads=1", "engine.max_running_requests=16", "timeout_s=120"]


def _groups() -> list[ScoringGroup]:
    return [ScoringGroup(p, [types.SimpleNamespace(group_id=g, index=i) for i in range(len(t))], list(t))
            for g, (p, t) in enumerate(zip(PROMPTS, TEXTS))]


def _pool(node: str, hf_path: str, run_dir, **over) -> tuple[ScoringPool, object]:
    cfg = compose([f"run_dir={run_dir}", f"scoring.{node}.hf_path={hf_path}",
                   *[f"scoring.{node}.{o}" for o in ENGINE], *[f"scoring.{node}.{k}={v}" for k, v in over.items()]])
    group = RunEngines(cfg).side_groups()[node]
    return ScoringPool(getattr(cfg.scoring, node), group, name=node).start(), getattr(cfg.scoring, node)


def _run(scorer, groups):
    async def go():
        try:
            return [await scorer.score(g) for g in groups]
        finally:
            await scorer.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("judge") / "tiny"))
    pool, cfg = _pool("judge", model, tmp_path_factory.mktemp("judge_run"))
    yield pool, cfg
    pool.close()
    assert not any(e.pids() for e in pool.engines.engines)


def _judge(pool, cfg, **kw) -> JudgeScorer:
    return JudgeScorer(JudgeConfig(hf_path=cfg.hf_path, engine=cfg.engine, max_new_tokens=8, **kw), pool)


def test_the_judge_retries_junk_then_drops_or_falls_back(judge):
    pool, cfg = judge
    scorer = _judge(pool, cfg, parse_retries=1, retry_temperature=1.0)
    out = _run(scorer, _groups())
    assert all(o.dropped for o in out)  # a random model says no YES/NO: no group is trained on a made-up score
    st = scorer.stats()
    assert st["unparseable"] == 2 * 6 and st["verdicts"] == 0 and st["groups_unparseable"] == 2, st
    assert st["groups_failed"] == 2 and st["engines_healthy"] == 1

    # the text the judge read is the engine's greedy generation for the rendered template, decoded
    ids = scorer.tok.encode_messages([{"role": "user", "content": render(
        scorer.cfg.template, prompt=PROMPTS[0].text, response=TEXTS[0][0], answer=PROMPTS[0].answer)}],
        generation_prompt=True)

    async def greedy():
        c = EngineClient(pool.slots[0].client.url)
        try:
            out = await c.generate(ids, {"max_new_tokens": 8, "temperature": 0.0}, rid="direct", return_logprob=False)
        finally:
            await c.close()
        return scorer.tok.decode(out.output_ids)

    said = asyncio.run(greedy())
    scorer = _judge(pool, cfg, parse_retries=0, fallback=0.0)
    out = _run(scorer, _groups()[:1])
    assert out[0].rewards == [0.0, 0.0, 0.0] and not out[0].dropped
    assert f"(last: {said[:80]!r})" in out[0].errors[0]
    assert scorer.stats()["fallbacks"] == 3

    # a verdict table that holds the engine's (greedy, deterministic) text: parsed, no retry
    scorer = _judge(pool, cfg, parse_retries=0, verdict_regex=r"(?s)^\s*(.+?)\s*$", verdicts={said.strip(): 0.75})
    out = _run(scorer, _groups()[:1])
    assert out[0].rewards[0] == 0.75 and scorer.stats()["verdicts"] >= 1


@pytest.mark.reliability
def test_reward_model_equals_transformers_and_a_killed_engine_is_replaced(tmp_path, reliability):
    import torch
    import transformers

    rm = make_tiny_reward_model(str(tmp_path / "rm"), seed=3)
    pool, cfg = _pool("reward_model", rm, tmp_path / "run", **{"engine.max_restarts": 1})
    scorer = RewardModelScorer(cfg, pool)
    try:
        cmd = pool.engines.engines[0].command()
        assert "--is-embedding" in cmd
        first = [o.rewards for o in _run(scorer, _groups())]
        model = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
        with torch.no_grad():
            want = [[model(torch.tensor([scorer.input_ids(p.text, t)])).logits[0, 0].item() for t in texts]
                    for p, texts in zip(PROMPTS, TEXTS)]
        worst = max(abs(a - b) for g, w in zip(first, want) for a, b in zip(g, w))
        assert worst < 1e-4, (first, want)
        spread = max(x for g in want for x in g) - min(x for g in want for x in g)
        assert spread > 0.1, f"the scores should differ between texts: {want}"

        os.killpg(os.getpgid(pool.engines.engines[0].proc.pid), signal.SIGKILL)
        again = [o.rewards for o in _run(scorer, _groups())]
        assert max(abs(a - b) for g, h in zip(again, first) for a, b in zip(g, h)) < 1e-5
        st = scorer.stats()
        assert st["engines_lost"] == 1 and st["engines_restarted"] == 1 and st["engines_healthy"] == 1, st
        assert st["groups_failed"] == 0 and len(pool.engines.engines) == 2 and not pool.engines.engines[0].pids()
        reliability.record(category="fault", name="reward model engine SIGKILLed", injected="SIGKILL of the reward "
                           "model's process group between two scorings", expected="replaced, the groups rescored the "
                           "same", survived=True, message="", details={"max_gap_vs_transformers": worst, "stats": st})
    finally:
        pool.close()
    assert not any(e.pids() for e in pool.engines.engines)
