"""Prompt data (built-in tasks, JSONL) and rewards (dotted-path loading, async scoring with failures)."""

import asyncio
import os
import time

import pytest

from mrl.config.load import compose
from mrl.config.schema import BadRowPolicy, DataConfig, RewardConfig, RewardExecutor, RewardOnError
from mrl.data import (TASKS, BadRowError, JsonlDataset, Prompt, SyntheticTask, build_prompt_source, build_task,
                      encode_prompts, iter_prompts)
from mrl.reward import RewardError, RewardScorer, load_reward_fn
from mrl.reward.builtin import FORMAT_CREDIT, contains, exact_match, format_and_correct, prefix_match

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "data")
PROMPTS = os.path.join(FIXTURES, "prompts.jsonl")
FNS = "tests.unit.reward_fns"
THREAD = RewardExecutor.thread  # user fns default to processes (reward.executor=auto)
SHORT_ANSWER_TASKS = sorted(n for n, t in TASKS.items() if t.reward_fn.endswith(".exact_match"))
"""Tasks answered in a few tokens (countdown's worked solutions: tests/unit/test_countdown.py)."""


# ---- built-in tasks ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_is_deterministic_in_seed_and_index(name):
    a, b = build_task(name, seed=7), build_task(name, seed=7)
    idx = [0, 5, 3 * len(a) + 1, 2, 10 * len(a)]  # out of order and across epochs
    assert [a.sample(i) for i in idx] == [b.sample(i) for i in reversed(idx)][::-1]
    other = build_task(name, seed=8)
    assert [a.sample(i).text for i in range(len(a))] != [other.sample(i).text for i in range(len(a))]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_splits_are_disjoint_and_cover_the_inputs(name):
    train, held_out = build_task(name, split="train"), build_task(name, split="eval", seed=99)
    assert set(train.items()).isdisjoint(held_out.items())
    assert sorted(train.items() + held_out.items()) == sorted(train.inputs())
    assert 0.05 < len(held_out) / (len(train) + len(held_out)) < 0.4  # eval_fraction 0.2 by hash
    texts = {train.sample(i).text for i in range(3 * len(train))}
    assert texts.isdisjoint(held_out.sample(i).text for i in range(3 * len(held_out)))
    for epoch in range(2):  # each epoch visits every item once
        n = len(train)
        assert sorted(train.sample(epoch * n + i).meta["input"] for i in range(n)) == sorted(train.items())


@pytest.mark.parametrize("name", SHORT_ANSWER_TASKS)
def test_references_score_one_and_wrong_answers_zero(name):
    task = build_task(name)
    for i in range(40):
        p = task.sample(i)
        ref = task.reference(p)
        assert ref == p.answer
        for response in (ref, f" {ref}\n", f"{ref}<eos>junk", f"{ref}\nmore lines"):
            assert exact_match(p, response) == 1.0 and format_and_correct(p, response) == 1.0
        wrong = ref[::-1] + ref if len(set(ref)) > 1 else ("0" if ref != "0" else "1")
        assert exact_match(p, wrong) == 0.0 and exact_match(p, "") == 0.0
        assert format_and_correct(p, "?!") == 0.0


def test_reward_builtins():
    p = build_task("add_mod").sample(0)
    wrong = str((int(p.answer) + 1) % 10)
    assert format_and_correct(p, wrong) == FORMAT_CREDIT  # a digit: well formed, wrong
    assert format_and_correct(p, wrong + wrong) == 0.0
    q = Prompt(id="x", text="?", answer="42", meta={})
    assert prefix_match(q, "42 because") == 1.0 and prefix_match(q, "4") == 0.0
    assert contains(q, "so it is 42.") == 1.0 and contains(q, "24") == 0.0
    assert format_and_correct(q, "41") == FORMAT_CREDIT and format_and_correct(q, "4 1") == 0.0


def test_answers_are_short_for_the_tiny_tokenizer():
    from mrl.models.tiny import build_tokenizer

    tok = build_tokenizer(512)
    for name in SHORT_ANSWER_TASKS:
        task = build_task(name)
        prompts = [task.sample(i) for i in range(len(task))]
        ids = encode_prompts(prompts, tok)
        for p, p_ids in zip(prompts, ids):
            a_ids = tok.encode(task.reference(p)).ids
            assert 1 <= len(a_ids) <= 3, (p, a_ids)
            assert p_ids + a_ids == tok.encode(p.text + p.answer).ids  # "=" is a token boundary


class _TemplatedTokenizer:
    chat_template = "<u>{content}</u><a>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return f"<u>{messages[0]['content']}</u><a>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text] if not add_special_tokens else [1] + [ord(c) for c in text]


def test_encode_prompts_applies_a_chat_template_only_when_present_and_wanted():
    p = Prompt(id="0", text="ab", answer="ba")
    assert encode_prompts([p], _TemplatedTokenizer()) == [[ord(c) for c in "<u>ab</u><a>"]]
    assert encode_prompts([p], _TemplatedTokenizer(), chat_template=False) == [[1, ord("a"), ord("b")]]


def test_build_task_errors_name_the_field():
    with pytest.raises(ValueError, match=r"data\.task: unknown task 'sort'"):
        build_task("sort")
    with pytest.raises(ValueError, match=r"data\.task_args: task 'add_mod' takes no arguments"):
        build_task("add_mod", task_args={"max_len": 4})
    with pytest.raises(ValueError, match=r"data\.task_args: task 'reverse' takes \['alphabet', 'max_len', 'min_len'\]"):
        build_task("reverse", task_args={"length": 4})
    longer = build_task("reverse", task_args={"max_len": 4})
    assert isinstance(longer, SyntheticTask) and len(longer.inputs()) == 16 + 64 + 256


# ---- JSONL ---------------------------------------------------------------------------------------

def test_jsonl_skips_and_counts_each_kind_of_bad_row():
    ds = JsonlDataset(PROMPTS)
    assert len(ds) == 4 and ds.stats.num_rows == 4
    assert ds.stats.skipped == {"invalid_json": 2, "missing_key": 2, "wrong_type": 4, "empty_prompt": 1}
    assert ds.stats.first_lines == {"invalid_json": [4, 13], "missing_key": [6, 11], "wrong_type": [7, 9, 10, 14],
                                    "empty_prompt": [8]}
    assert "invalid_json: 2 at lines 4, 13" in ds.stats.summary() and "9 skipped" in ds.stats.summary()
    rows = [ds[i] for i in range(len(ds))]
    assert [r.id for r in rows] == ["q1", "q2", "prompts.jsonl:3", "q12"]
    assert rows[1].answer == "7" and rows[1].meta == {"source": "manual", "line": 2}


@pytest.mark.parametrize("line,reason",
                         [(4, "invalid_json"), (6, "missing_key"), (7, "wrong_type"), (8, "empty_prompt")])
def test_jsonl_error_mode_raises_with_file_and_line(tmp_path, line, reason):
    with open(PROMPTS) as f:
        lines = f.read().splitlines()
    path = tmp_path / "one_bad.jsonl"
    path.write_text("\n".join(lines[:3] + [lines[line - 1]]) + "\n")
    with pytest.raises(BadRowError, match=rf"one_bad\.jsonl:4: {reason}: .*data\.on_bad_row=error"):
        JsonlDataset(str(path), on_bad_row=BadRowPolicy.error)
    assert len(JsonlDataset(str(path))) == 3


def test_jsonl_invalid_utf8_and_no_usable_rows(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xff", "answer": "b"}\n')
    assert JsonlDataset(str(path)).stats.skipped == {"invalid_json": 1}
    path.write_bytes(b'{"answer": "b"}\n\n')
    with pytest.raises(ValueError, match=r"no usable rows in .*bytes\.jsonl: 0 rows, 1 skipped \(missing_key"):
        JsonlDataset(str(path))


def test_jsonl_epochs_use_a_seeded_shuffle():
    ds, same, other = JsonlDataset(PROMPTS, seed=3), JsonlDataset(PROMPTS, seed=3), JsonlDataset(PROMPTS, seed=4)
    n = len(ds)
    epochs = [[ds.sample(e * n + i).id for i in range(n)] for e in range(4)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    assert [same.sample(i).id for i in reversed(range(4 * n))][::-1] == sum(epochs, [])
    assert [other.sample(i).id for i in range(4 * n)] != sum(epochs, [])
    plain = iter_prompts(JsonlDataset(PROMPTS, shuffle=False))
    assert [next(plain).id for _ in range(2 * n)] == ["q1", "q2", "prompts.jsonl:3", "q12"] * 2


def test_jsonl_custom_keys(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "hi", "n": 1}\n{"question": "", "n": 2}\n')
    ds = JsonlDataset(str(path), prompt_key="question", answer_key=None)
    assert len(ds) == 1 and ds[0].answer == "" and ds[0].meta == {"n": 1, "line": 1}
    assert ds.stats.skipped == {"empty_prompt": 1}


# ---- config --------------------------------------------------------------------------------------

def test_data_presets_compose_and_build():
    cfg = compose(["data=jsonl", f"data.path={PROMPTS}", "seed=5"])
    assert cfg.data.seed == 5 and cfg.data.on_bad_row is BadRowPolicy.skip
    assert isinstance(build_prompt_source(cfg.data), JsonlDataset)
    with pytest.raises(ValueError, match=r"data\.eval_path: not set"):
        build_prompt_source(cfg.data, split="eval")
    cfg = compose(["data=jsonl", f"data.path={PROMPTS}", f"data.eval_path={FIXTURES}/prompts_eval.jsonl"])
    held_out = build_prompt_source(cfg.data, split="eval")
    assert sorted(held_out.sample(i).id for i in range(2)) == ["e1", "e2"]
    for name in TASKS:
        cfg = compose([f"data={name}"])
        assert cfg.data.task == name and cfg.data.path is None
        assert build_prompt_source(cfg.data).sample(0) == build_task(name, seed=cfg.seed,
                                                                     task_args=cfg.data.task_args).sample(0)
    assert compose(["data=reverse", "data.task_args.max_len=4"]).data.task_args["max_len"] == 4


def test_data_and_reward_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"data\.path: must be set for data\.task=jsonl"):
        compose(["data=jsonl"])
    with pytest.raises(ValueError, match=r"data\.eval_fraction"):
        DataConfig(eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"data\.eval_path"):
        DataConfig(eval_path="x.jsonl")
    with pytest.raises(ValueError, match=r"data\.task_args"):
        DataConfig(path="x.jsonl", task_args={"max_len": 4})
    with pytest.raises(ValueError, match=r"reward\.fn"):
        RewardConfig(fn="exact_match")
    with pytest.raises(ValueError, match=r"reward\.timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"reward\.num_workers"):
        compose(["reward.num_workers=0"])
    cfg = compose(["reward=format_and_correct", "reward.on_error=raise", "reward.executor=process"])
    assert cfg.reward.on_error is RewardOnError["raise"] and cfg.reward.executor is RewardExecutor.process
    assert compose().reward.fn == "mrl.reward.builtin.exact_match"


# ---- reward fns by dotted path -------------------------------------------------------------------

def test_load_reward_fn_errors_say_what_is_wrong(tmp_path, monkeypatch):
    assert load_reward_fn("mrl.reward.builtin.exact_match") is exact_match
    with pytest.raises(ValueError, match=r"'no_such_pkg_xyz\.mod\.fn'.*module 'no_such_pkg_xyz\.mod' not found"):
        load_reward_fn("no_such_pkg_xyz.mod.fn")
    with pytest.raises(ValueError, match=r"module 'mrl\.reward\.no_such_mod' not found"):
        load_reward_fn("mrl.reward.no_such_mod.fn")
    with pytest.raises(ValueError, match=r"'mrl\.reward\.builtin' has no attribute 'exact_matsh'"):
        load_reward_fn("mrl.reward.builtin.exact_matsh")
    with pytest.raises(ValueError, match=r"a int is not callable"):
        load_reward_fn(f"{FNS}.NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"must accept \(prompt, response_text\)"):
        load_reward_fn(f"{FNS}.one_arg")
    with pytest.raises(ValueError, match=r"dotted path"):
        load_reward_fn("exact_match")
    (tmp_path / "broken_rewards_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"importing module 'broken_rewards_xyz' failed.*no_such_dependency_xyz"):
        load_reward_fn("broken_rewards_xyz.fn")


# ---- async scoring -------------------------------------------------------------------------------

P = Prompt(id="p0", text="3+4=", answer="7")


def _score(cfg, texts):
    async def main():
        with RewardScorer(cfg) as scorer:
            results = await scorer.score_many([(P, t) for t in texts])
            return results, scorer.stats
    return asyncio.run(main())


def test_scorer_scores_concurrently_and_bounds_workers():
    results, stats = _score(RewardConfig(), ["7", " 7\n", "8"])
    assert [r.value for r in results] == [1.0, 1.0, 0.0] and all(r.error is None for r in results)
    assert stats == {"calls": 3, "errors": 0, "timeouts": 0, "dropped": 0, "pool_restarts": 0}
    # 4 calls of 0.4 s on 2 workers: the queue wait does not count against the 0.7 s timeout.
    t0 = time.monotonic()
    results, stats = _score(RewardConfig(fn=f"{FNS}.sleepy", executor=THREAD, num_workers=2, timeout_s=0.7),
                            ["sleep 0.4"] * 4)
    assert [r.value for r in results] == [1.0] * 4 and stats["timeouts"] == 0
    assert 0.75 < time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("on_error,value", [("zero", -1.0), ("drop", None)])
def test_scorer_counts_a_raising_fn(on_error, value):
    cfg = RewardConfig(fn=f"{FNS}.boom", executor=THREAD, on_error=RewardOnError[on_error], error_value=-1.0)
    results, stats = _score(cfg, ["7", "8"])
    assert [r.value for r in results] == [value, value]
    assert all(r.error == "RuntimeError: boom" and r.dropped == (value is None) for r in results)
    assert stats["errors"] == 2 and stats["dropped"] == (2 if value is None else 0)


def test_scorer_raise_mode():
    with pytest.raises(RewardError, match=r"tests\.unit\.reward_fns\.boom failed on prompt 'p0': RuntimeError: boom"):
        _score(RewardConfig(fn=f"{FNS}.boom", executor=THREAD, on_error=RewardOnError["raise"]), ["7"])


def test_scorer_counts_non_numbers_as_errors():
    for fn, msg in (("returns_str", "TypeError: reward fn returned a str"),
                    ("returns_nan", "ValueError: reward fn returned nan")):
        results, stats = _score(RewardConfig(fn=f"{FNS}.{fn}", executor=THREAD), ["7"])
        assert results[0].value == 0.0 and results[0].error.startswith(msg) and stats["errors"] == 1


def test_scorer_times_out_a_slow_thread_call_and_keeps_capacity():
    cfg = RewardConfig(fn=f"{FNS}.sleepy", executor=THREAD, num_workers=1, timeout_s=0.3,
                       on_error=RewardOnError.drop)

    async def main():
        with RewardScorer(cfg) as scorer:
            t0 = time.monotonic()
            slow = await scorer.score(P, "sleep 3")
            took = time.monotonic() - t0
            fast = await scorer.score(P, "7")  # the only worker thread is still asleep: a new pool serves it
            return slow, took, fast, scorer.stats
    slow, took, fast, stats = asyncio.run(main())
    assert slow.dropped and slow.error == "timed out after 0.3s" and took < 2.0
    assert fast.value == 1.0
    assert stats == {"calls": 2, "errors": 0, "timeouts": 1, "dropped": 1, "pool_restarts": 1}


def test_scorer_async_fn_timeout_vs_its_own_timeout_error():
    results, stats = _score(RewardConfig(fn=f"{FNS}.async_sleepy", executor=THREAD, timeout_s=0.2),
                            ["7", "sleep 5", "own timeout"])
    assert [r.value for r in results] == [1.0, 0.0, 0.0]
    assert results[1].error == "timed out after 0.2s"
    assert results[2].error == "TimeoutError: the verifier's own timeout"
    assert stats["timeouts"] == 1 and stats["errors"] == 1 and stats["pool_restarts"] == 0


def test_scorer_process_pool_reimports_fn_restarts_on_timeout_and_reruns_victims():
    async def main():
        cfg = RewardConfig(fn=f"{FNS}.pid", executor=RewardExecutor.process, num_workers=2)
        with RewardScorer(cfg) as scorer:
            pids = await scorer.score_many([(P, "x")] * 4)
        cfg = RewardConfig(fn=f"{FNS}.sleepy", executor=RewardExecutor.process, num_workers=2, timeout_s=1.5)
        with RewardScorer(cfg) as scorer:
            first = await scorer.score(P, "7")  # waits for the workers to start (start-up is not timed)
            hang = asyncio.create_task(scorer.score(P, "sleep 60"))
            await asyncio.sleep(0.7)
            victim = asyncio.create_task(scorer.score(P, "sleep 1.2"))  # still running when the hang times out
            results = [first, await hang, await victim, await scorer.score(P, "7")]
            return pids, results, scorer.stats
    pids, results, stats = asyncio.run(main())
    assert all(r.error is None for r in pids) and os.getpid() not in {r.value for r in pids}
    assert results[1].error == "timed out after 1.5s"
    assert results[2].value == 1.0 and results[2].error is None  # killed by the restart, rerun on the new pool
    assert results[0].value == results[3].value == 1.0
    assert stats == {"calls": 4, "errors": 0, "timeouts": 1, "dropped": 0, "pool_restarts": 1}


def test_scorer_refuses_calls_after_close():
    scorer = RewardScorer(RewardConfig())
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(scorer.score(P, "7"))
