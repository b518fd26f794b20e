"""The countdown task (mrl/data/countdown.py, ``CountdownTask`` in mrl/data/tasks.py, ``data=countdown``) and
its reward (``mrl.reward.builtin.countdown``, ``reward=countdown``): expressions are checked without eval, the
worked solutions verify, wrong and malformed answers score 0, the problems and splits are the same in every
process and for every seed, and the preflight refuses a reward or token budget the task cannot train with."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from mrl.config.load import compose
from mrl.data import build_task
from mrl.data.countdown import Chain, countdown_value, random_chain, worked_solution
from mrl.preflight import check_data
from mrl.reward.builtin import countdown, exact_match, extract_final_answer

HARD = {"num_numbers": 5, "max_number": 50, "ops": "+-*/"}


@pytest.mark.parametrize("expression,numbers,value", [
    ("3*5+7", [3, 5, 7], 22),
    ("(7+3)*5", [3, 5, 7], 50),
    ("7 + 3 * 5", [3, 5, 7], 22),
    ("3*5", [3, 5, 7], 15),                 # unused numbers are allowed
    ("5/3*6", [3, 5, 6], 10),               # exact fractions on the way
    ("2/3", [2, 3], Fraction(2, 3)),
    ("8-9", [8, 9], -1),
    ("2*2", [2, 2, 5], 4),                  # a number given twice may be used twice
    ("3*5+7=22", [3, 5, 7], 22),            # a trailing "= value" is ignored
    ("(3×5)÷5", [3, 5, 5], 3),
])
def test_valid_expressions_have_their_exact_value(expression, numbers, value):
    assert countdown_value(expression, numbers) == value


@pytest.mark.parametrize("expression", [
    "3*3",                      # 3 given once, used twice
    "3*4",                      # 4 not given
    "-3+5", "3**5", "3.0*5", "5//3", "5%3", "3 5",
    "5/(3-3)",                  # division by zero
    "__import__('os').system('true')", "abs(3)", "x*3", "[3, 5]", "3 if 5 else 7", "",
    "(" * 150 + "3" + ")" * 150,  # too deep for a countdown answer
    "+".join(["3"] * 200),
])
def test_invalid_expressions_have_no_value(expression):
    assert countdown_value(expression, [3, 3 if expression == "5/(3-3)" else 5, 7]) is None


def test_a_policys_malformed_answer_draws_no_warning():
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # not "error": the parser would raise it as SyntaxError
        warnings.simplefilter("always")
        assert countdown_value("3in 5", [3, 5]) is None
    assert not caught  # a SyntaxWarning from the parser would reach the console once per sample


@pytest.mark.parametrize("seed", range(200))
def test_worked_solutions_reach_the_target_in_valid_steps(seed):
    rng = random.Random(seed)
    chain = random_chain(rng, num_numbers=rng.randint(2, 6), max_number=rng.choice([9, 20, 100]), ops="+-*/")
    if chain is None:
        return
    text = worked_solution(chain)
    *steps, last = text.split("\n")
    assert len(steps) == len(chain.ops) and last == f"#### {chain.expression()}"
    assert all(v >= 1 for v in chain.values)  # positive integers all the way
    assert extract_final_answer(text) == chain.expression()
    assert countdown_value(chain.expression(), list(chain.numbers)) == chain.target


def test_the_expression_is_parenthesized_only_where_needed():
    assert Chain((3, 2, 5), "+*").expression() == "(3+2)*5"
    assert Chain((3, 2, 5), "*+").expression() == "3*2+5"
    assert Chain((9, 2, 5, 4), "-+*").expression() == "(9-2+5)*4"
    assert Chain((8, 2, 2, 3), "/-*").expression() == "(8/2-2)*3"


def test_references_score_one_and_wrong_answers_zero():
    for args in ({}, {"num_numbers": 2, "ops": "+-*"}, HARD, {"ordered": False}):
        task = build_task("countdown", task_args=args)
        for i in range(60):
            p = task.sample(i)
            ref = task.reference(p)
            assert countdown(p, ref) == 1.0 and countdown(p, ref + "<eos>junk") == 1.0
            expr = ref.rsplit("#### ", 1)[1]
            assert countdown(p, rf"so \boxed{{{expr}}}") == 1.0 and countdown(p, f"The answer is {expr}.") == 1.0
            assert countdown(p, f"#### {p.answer}") == 0.0           # the target alone uses no number
            assert countdown(p, f"#### {expr}+{max(p.meta['numbers'])}") == 0.0  # a number used once too often
            assert countdown(p, ref[:-1]) == 0.0 or ref[-1] == ")"  # cut off
            assert countdown(p, "") == 0.0 and countdown(p, "#### (") == 0.0
            assert exact_match(p, ref) == 0.0


def test_any_valid_solution_counts():
    p = build_task("countdown", task_args={"num_numbers": 2, "ops": "+"}).sample(0)
    a, b = p.meta["numbers"]
    assert countdown(p, f"#### {b}+{a}") == 1.0 and countdown(p, f"#### ({b}+{a})*1") == 0.0


def test_problems_and_splits_are_the_same_for_every_seed_and_disjoint():
    for args in ({}, HARD):
        train = build_task("countdown", seed=0, task_args=args)
        assert sorted(train.items()) == sorted(build_task("countdown", seed=5, task_args=args).items())
        held_out = build_task("countdown", split="eval", seed=5, task_args=args)
        assert set(train.items()).isdisjoint(held_out.items())
        assert [train.sample(i) for i in range(5)] != [build_task("countdown", seed=5, task_args=args).sample(i)
                                                       for i in range(5)]  # the order follows the seed


def test_difficulty_is_set_by_the_task_args():
    small, hard = build_task("countdown"), build_task("countdown", task_args=HARD)
    p = small.sample(0)
    assert len(p.meta["numbers"]) == 3 and p.text == f"{' '.join(map(str, p.meta['numbers']))}->{p.answer}="
    assert set(small.reference(p)) <= set("0123456789+-=\n# ")
    assert all(len(hard.sample(i).meta["numbers"]) == 5 for i in range(20))
    assert hard.max_response_tokens > small.max_response_tokens
    assert 100 < len(small) + len(build_task("countdown", split="eval")) <= 2000
    more = build_task("countdown", task_args=HARD | {"num_problems": 3000})
    assert set(hard.items()) < set(more.items())  # a larger pool keeps the smaller one
    unordered = build_task("countdown", task_args={"ordered": False})
    assert all(unordered.sample(i).meta["numbers"] == sorted(unordered.sample(i).meta["numbers"]) for i in range(20))


@pytest.mark.parametrize("args,key", [({"num_numbers": 1}, "num_numbers"), ({"max_number": 1}, "max_number"),
                                      ({"ops": "+^"}, "ops"), ({"ops": ""}, "ops"), ({"ops": "++"}, "ops"),
                                      ({"num_problems": 1}, "num_problems"), ({"size": 3}, "task_args")])
def test_bad_task_args_name_the_key(args, key):
    with pytest.raises(ValueError, match=rf"data\.(task_args\.)?{key}"):
        build_task("countdown", task_args=args)


def test_worked_solutions_fit_the_tiny_tokenizer_and_the_warm_start_sees_them():
    from mrl.models.tiny import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer(512)
    eos = SPECIAL_TOKENS.index("<eos>")
    for args in ({}, HARD):
        task = build_task("countdown", task_args=args)
        for i in range(200):
            p = task.sample(i)
            ref = task.reference(p)
            tokens, prompt_len = task.warm_start_tokens(p, tok, eos)
            assert tokens[:prompt_len] == tok.encode(p.text).ids  # "=" is a token boundary
            assert tokens == tok.encode(p.text + ref).ids + [eos]
            assert len(tokens) - prompt_len <= task.max_response_tokens


def test_the_presets_compose_and_the_preflight_checks_the_pairing():
    cfg = compose(["data=countdown", "reward=countdown"])
    assert cfg.data.task == "countdown" and cfg.reward.fn == "mrl.reward.builtin.countdown"
    assert cfg.rollout.max_new_tokens >= build_task("countdown", task_args=cfg.data.task_args).max_response_tokens
    assert cfg.algo.max_response_len == cfg.rollout.max_new_tokens
    assert check_data(cfg, "local") is None
    for reward in ("exact_match", "math", "format_and_correct"):
        msg = check_data(compose(["data=countdown", f"reward={reward}"]), "local")
        assert msg.startswith("reward.fn=mrl.reward.") and "reward=countdown" in msg
    msg = check_data(compose(["data=countdown", "reward=countdown", "rollout.max_new_tokens=8"]), "local")
    assert msg.startswith("rollout.max_new_tokens=8: ") and "set rollout.max_new_tokens=" in msg
    harder = [f"data.task_args.{k}={v}" for k, v in HARD.items()]
    need = build_task("countdown", task_args=HARD).max_response_tokens
    msg = check_data(compose(["data=countdown", "reward=countdown", *harder]), "local")
    assert f"set rollout.max_new_tokens={need} or more" in msg
    assert check_data(compose(["data=countdown", "reward=countdown", *harder, f"rollout.max_new_tokens={need}"]),
                      "local") is None
    assert "data.task_args.max_number" in check_data(compose(["data=countdown", "data.task_args.max_number=1"]),
                                                     "local")
