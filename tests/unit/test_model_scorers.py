"""The judge and reward model scorers' own logic, without engines: the template and the verdict parse, the
judge's retries and fallback over a scripted pool, the configs and presets, the preflight's refusals, and the
pools the trainer side builds for them. The engines themselves: tests/integration/test_model_scorers.py."""

from __future__ import annotations

import asyncio
import json
import re
import types

import pytest

from mrl.config.load import compose
from mrl.config.scoring import JudgeConfig
from mrl.data import Prompt
from mrl.models.tiny import build_tokenizer
from mrl.scoring import ScoringError, ScoringGroup
from mrl.scoring.checks import model_scorer_problem, template_problem, verdict_regex_problem
from mrl.scoring.judge import JudgeScorer, parse_verdict, render
from mrl.scoring.model_scorer import ScorerTokenizer

P = Prompt(id="p0", text="last cab=", answer="b")
YES_NO = re.compile(JudgeConfig(hf_path="x").verdict_regex)


def test_template_and_verdict_parse():
    assert render("{prompt}|{answer}|{response}", prompt="q", response="r", answer="a") == "q|a|r"
    v = {"yes": 1.0, "no": 0.0}
    assert parse_verdict(" YES", YES_NO, v, [0, 10]) == 1.0
    assert parse_verdict("I think no.", YES_NO, v, [0, 10]) == 0.0
    assert parse_verdict("yesterday nothing", YES_NO, v, [0, 10]) is None  # words, not verdicts
    assert parse_verdict("", YES_NO, v, [0, 10]) is None
    score = re.compile(r"Score:\s*(\d+(?:\.\d+)?)")
    assert parse_verdict("Score: 7", score, None, [0, 10]) == pytest.approx(0.7)
    assert parse_verdict("Score: 2.5 of 5", score, None, [0, 5]) == pytest.approx(0.5)
    assert parse_verdict("Score: 11", score, None, [0, 10]) is None  # outside the range: not a verdict
    assert parse_verdict("Score: x", score, None, [0, 10]) is None


def test_template_and_regex_refusals():
    assert template_problem(JudgeConfig(hf_path="x").template) is None
    assert "only {prompt}, {response} and {answer}" in template_problem("{question} {response}")
    assert "has no {response}" in template_problem("{prompt} {answer}")
    assert "cannot be filled in" in template_problem("{response")
    assert "no format spec" in template_problem("{response:>9}")
    assert template_problem("{{literal}} {response}") is None
    assert "has no capture group" in verdict_regex_problem(r"(?i)yes|no")
    assert "does not compile" in verdict_regex_problem("(yes")
    assert verdict_regex_problem(r"(?:x)?(\d+)") is None


def _ckpt(tmp_path, name: str, arch: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    build_tokenizer(512).save(str(d / "tokenizer.json"))
    return str(d)


def test_preflight_refuses_missing_or_wrong_checkpoints_bad_templates_and_patterns(tmp_path):
    from mrl.preflight import check_reward_fn as check_scoring

    lm = _ckpt(tmp_path, "lm", "Qwen3ForCausalLM")
    rm = _ckpt(tmp_path, "rm", "Qwen3ForSequenceClassification")

    def judge(*o):
        return check_scoring(compose(["scoring=judge", *o]), "local")

    assert judge(f"scoring.judge.hf_path={lm}") is None
    assert "no config.json there" in judge(f"scoring.judge.hf_path={tmp_path}/nowhere")
    assert "is a classifier" in judge(f"scoring.judge.hf_path={rm}")
    msg = judge(f"scoring.judge.hf_path={lm}", "scoring.judge.template='Q: {question} A: {response}'")
    assert "scoring.judge.template=" in msg and "['question']" in msg
    msg = judge(f"scoring.judge.hf_path={lm}", "scoring.judge.verdict_regex='(?i)yes|no'")
    assert "scoring.judge.verdict_regex=" in msg and "no capture group" in msg
    rmc = compose(["scoring=reward_model", f"scoring.reward_model.hf_path={rm}"])
    assert check_scoring(rmc, "local") is None
    msg = check_scoring(compose(["scoring=reward_model", f"scoring.reward_model.hf_path={lm}"]), "local")
    assert "is no reward model" in msg and "Qwen3ForCausalLM" in msg
    (tmp_path / "rm" / "tokenizer.json").unlink()
    assert "no tokenizer.json there" in model_scorer_problem(
        "reward_model", types.SimpleNamespace(NODE="scoring.reward_model", hf_path=rm))


def test_configs_and_presets():
    cfg = compose(["scoring=judge", "scoring.judge.hf_path=/j"])
    assert not cfg.scoring.default and list(cfg.scoring.model_scorers) == ["judge"]
    assert cfg.scoring.reward_weight == 0.0 and cfg.scoring.judge.engine.dtype == "float32"
    cfg = compose(["scoring=reward_model", "scoring.reward_model.hf_path=/r", "scoring.reward_weight=1"])
    assert list(cfg.scoring.model_scorers) == ["reward_model"]
    with pytest.raises(ValueError, match="nothing would score"):
        compose(["scoring=judge"])  # no judge checkpoint and reward.fn weighted 0
    cfg = compose(["scoring.judge.hf_path=/j", "scoring.judge.verdicts=null", "scoring.judge.score_range=[1,5]"])
    assert cfg.scoring.judge.verdicts is None and cfg.scoring.judge.score_range == [1, 5]
    with pytest.raises(ValueError, match="scoring.judge.score_range"):
        compose(["scoring.judge.hf_path=/j", "scoring.judge.score_range=[5,1]"])
    with pytest.raises(ValueError, match="scoring.reward_model.engine.url_dir"):
        compose(["scoring.reward_model.hf_path=/r", "scoring.reward_model.engine.url_dir=/x"])
    with pytest.raises(ValueError, match="scoring.judge.hf_path"):
        compose(["scoring.judge.engine.urls=[http://127.0.0.1:1]"])


def test_the_trainer_side_builds_a_pool_per_model_scorer(tmp_path):
    from mrl.trainer.engines import RunEngines

    cfg = compose([f"run_dir={tmp_path}", "scoring.judge.hf_path=/j", "scoring.reward_model.hf_path=/r",
                   "scoring.reward_model.engine.urls=[http://127.0.0.1:9]"])
    assert list(RunEngines(cfg).side_groups()) == ["judge"]  # the reward model's are given by URL
    cfg = compose([f"run_dir={tmp_path}", "scoring.reward_model.hf_path=/r", "scoring.reward_model.engine.count=2"])
    groups = RunEngines(cfg).side_groups()
    cmd = groups["reward_model"].engines[1].command()
    assert cmd[cmd.index("--model-path") + 1] == "/r" and "--is-embedding" in cmd
    assert "--enable-return-routed-experts" not in cmd


class ScriptedPool:
    """Answers each generate with the next text of ``script`` (encoded): the judge's logic on its own."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.calls = tok, list(script), []

    async def generate(self, ids, params, *, rid):
        self.calls.append((rid, params["temperature"]))
        return types.SimpleNamespace(output_ids=self.tok.encode(self.script.pop(0)).ids)

    def stats(self):
        return {}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("judge_tok")
    build_tokenizer(512).save(str(d / "tokenizer.json"))
    return ScorerTokenizer(str(d))


def _judge(tok, script, **kw):
    cfg = JudgeConfig(hf_path="-", engine=JudgeConfig().engine, **kw)
    pool = ScriptedPool(tok.tok, script)
    return JudgeScorer(cfg, pool, tok), pool


def _group(n: int) -> ScoringGroup:
    return ScoringGroup(P, [types.SimpleNamespace(group_id=3, index=i) for i in range(n)], ["b"] * n)


def test_judge_retries_an_unparseable_verdict_then_falls_back_or_drops(tok):
    scorer, pool = _judge(tok, ["hmm", "YES"], parse_retries=2, temperature=0.0, retry_temperature=0.7)
    out = asyncio.run(scorer.score(_group(1)))
    assert out.rewards == [1.0] and out.errors == [None]
    assert [t for _, t in pool.calls] == [0.0, 0.7]  # the retry samples: a greedy verdict would repeat
    assert scorer.stats()["unparseable"] == 1 and scorer.stats()["verdicts"] == 1

    scorer, pool = _judge(tok, ["NO", "junk", "junk", "junk"], parse_retries=2)
    out = asyncio.run(scorer.score(_group(2)))
    assert out.rewards == [0.0, None] and out.dropped  # no made-up score: the group is dropped
    assert "no verdict in 3 attempts" in out.errors[1] and "junk" in out.errors[1]
    st = scorer.stats()
    assert st["unparseable"] == 3 and st["groups_unparseable"] == 1 and st["groups_failed"] == 1

    scorer, _ = _judge(tok, ["junk"], parse_retries=0, fallback=0.25)
    out = asyncio.run(scorer.score(_group(1)))
    assert out.rewards == [0.25] and not out.dropped and "no verdict" in out.errors[0]
    assert scorer.stats()["fallbacks"] == 1


def test_a_judge_that_never_parses_stops_the_run(tok):
    scorer, _ = _judge(tok, ["junk"] * 64, parse_retries=0, max_error_rate=0.5)
    with pytest.raises(ScoringError, match="scoring.judge.max_error_rate"):
        for _ in range(64):
            asyncio.run(scorer.score(_group(1)))
