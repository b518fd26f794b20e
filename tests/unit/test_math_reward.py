"""The math reward (mrl/reward/math_answer.py, ``reward=math``) and final-answer extraction
(``mrl.reward.builtin.extract_final_answer``): equivalent forms score 1, wrong ones 0, unparsed ones
``UNPARSED_REWARD``, and a pathological answer ends within math-verify's limits, in the scorer's process
workers too."""

from __future__ import annotations

import asyncio
import time

import pytest

from mrl.config.load import compose
from mrl.config.schema import RewardConfig, RewardExecutor
from mrl.data import Prompt
from mrl.reward import RewardScorer, math_answer
from mrl.reward.builtin import extract_final_answer
from mrl.reward.math_answer import UNPARSED_REWARD, equivalent, grade_math_answer

FN = "mrl.reward.math_answer.equivalent"
TOWER = r"\boxed{9^{9^{9^{9}}}}"  # parses at once; sympy's comparison with a number would not end


def _p(answer: str) -> Prompt:
    return Prompt(id="q", text="?", answer=answer)


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{\frac{1}{2}} first, then \boxed{\frac{\sqrt{2}}{\{3\}}}.", r"\frac{\sqrt{2}}{\{3\}}"),  # last box
    (r"\boxed{\boxed{7}+1}", r"\boxed{7}+1"),                # the enclosing box
    (r"a \boxed{3} b \boxed{4", "3"),                        # a box left open (cut off) is skipped
    (r"\fbox{12}", "12"),
    (r"The final answer is $\boxed{5}$.", "5"),
    ("She has 16 - 3 - 4 = 9 eggs.\n#### 1,000\n", "1,000"),  # GSM8K
    ("#### 7\nmore text\n#### 8 \n", "8"),
    ("#### 42<|im_end|>ignored", "42"),                     # EOS texts end the response
    ("Some steps.\nThe answer is 42.", "42"),
    (r"Answer: $\frac34$", r"\frac34"),
    (r"the answer is \(x=2\)", "x=2"),
    ("steps\n\n  3/4  \n\n", "3/4"),                          # the last non-empty line
    ("#### \nso 5", "so 5"),
    ("", None),
    ("  \n<eos>5", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extraction_is_linear_on_nested_and_unclosed_boxes():
    start = time.monotonic()
    assert extract_final_answer(r"\boxed{" * 20000) == r"\boxed{" * 20000  # nothing closes: the last line
    assert extract_final_answer("{" * 20000 + r"\boxed{9}" + "}" * 20000) == "9"
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("response,label", [
    (r"The answer is \boxed{\frac{3}{4}}", "0.75"),
    (r"\boxed{\dfrac34}", "3/4"),
    ("so 3/4 of them", r"\frac{3}{4}"),
    ("#### 1,000", "1000"),
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"),  # a GSM8K label
    (r"... hence \boxed{18}", r"We find $x = 18$, so the answer is $\boxed{18}$."),            # a MATH label
    ("The answer is 42.", "42"),
    ("The answer is 42.0", "42"),
    ("#### -3", "-3"),
    ("#### 50%", "50"),                                  # a percent sign is dropped
    ("x = 5", "5"),
    ("5 apples", "5"),
    (r"The answer is $5\text{ cm}$", "5"),
    (r"\boxed{\{1,2\}}", r"\{2, 1\}"),                   # sets, in any order
    (r"\boxed{[1,2)}", "[1, 2)"),                         # intervals
    (r"\boxed{\sqrt{2}/2}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),                    # symbolic equality
    (r"\boxed{10^{5}}", "100000"),
    (r"\boxed{\pi}", r"\pi"),
    (r"\boxed{B}", "B"),
])
def test_equivalent_forms_score_one(response, label):
    assert equivalent(_p(label), response) == 1.0


@pytest.mark.parametrize("response,label", [
    ("The answer is 43.", "42"),
    ("#### 3", "-3"),
    (r"\boxed{(1,2)}", "[1, 2)"),       # open vs half-open
    (r"\boxed{3.14159}", r"\pi"),       # close is not equal
    (r"\boxed{0.333}", "1/3"),
    (r"\boxed{B}", "A"),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}"),
    ("#### 42\nwait, no\n#### 41", "42"),  # the last final answer counts
])
def test_wrong_answers_score_zero(response, label):
    grade = grade_math_answer(response, label)
    assert grade.parsed and not grade.correct
    assert equivalent(_p(label), response) == 0.0


@pytest.mark.parametrize("response", ["", "   \n\n", "I do not know", "(" * 3000 + "1" + ")" * 3000, "<eos>42"])
def test_unparsed_answers_score_the_documented_value(response):
    grade = grade_math_answer(response, "42")
    assert not grade.parsed and not grade.correct
    assert equivalent(_p("42"), response) == UNPARSED_REWARD == 0.0


def test_a_label_that_does_not_parse_is_an_error_of_the_data():
    with pytest.raises(ValueError, match="prompt.answer ''"):
        equivalent(_p(""), "#### 42")


def test_a_pathological_answer_ends_at_the_time_limit_in_the_main_thread(monkeypatch):
    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1)
    for response in (TOWER, r"\boxed{" + "x^{" * 50 + "2" + "}" * 50 + "}"):
        start = time.monotonic()
        assert equivalent(_p("1"), response) == 0.0
        # without the limit the comparison does not end; a loaded box delays the alarm's handler by seconds
        assert time.monotonic() - start < 30 * math_answer.TIMEOUT_S


def _score(executor: RewardExecutor, pairs: list[tuple[str, str]]) -> tuple[list, dict]:
    cfg = RewardConfig(fn=FN, executor=executor, num_workers=1, timeout_s=30.0)

    async def go():
        with RewardScorer(cfg) as scorer:
            return await scorer.score_many([(_p(label), text) for label, text in pairs]), scorer.stats

    return asyncio.run(go())


def test_in_the_scorers_process_workers_a_pathological_answer_scores_zero_and_the_worker_lives_on():
    start = time.monotonic()
    results, stats = _score(RewardExecutor.process, [("1", TOWER), ("0.75", r"\boxed{3/4}")])
    assert [r.value for r in results] == [0.0, 1.0] and all(r.error is None for r in results)
    assert stats["timeouts"] == stats["errors"] == stats["pool_restarts"] == 0
    assert time.monotonic() - start < 25  # worker start-up and one math-verify time limit, not the call's 30 s


def test_in_worker_threads_the_reward_runs_without_signals():
    results, stats = _score(RewardExecutor.thread, [("0.75", r"\boxed{3/4}"), ("2", "#### 3")])
    assert [r.value for r in results] == [1.0, 0.0] and stats["errors"] == 0


def test_the_preset_runs_the_reward_in_processes():
    r = compose(["reward=math"]).reward
    assert r.fn == FN and r.executor is RewardExecutor.process and r.timeout_s > 2 * math_answer.TIMEOUT_S
