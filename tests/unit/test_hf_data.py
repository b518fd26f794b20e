"""``data=hf`` (mrl/data/hf_files.py): prompts from local JSONL, Parquet and Arrow files through ``datasets``; column
mapping, the model's chat template, held-out splits, the prompt budget (left out and counted), a seeded order
that a resumed run continues, and bad files named in the preflight."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import datasets
import pyarrow as pa
import pytest

from mrl.config.load import compose
from mrl.data import BadRowError, build_prompt_source, load_tokenizer, prompt_ids
from tests.conftest import REPO

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
            "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
BOS = 1  # the tiny tokenizer's <bos>
ROWS = [{"id": f"q{i}", "prompt": f"rev {'ab' * (i % 3 + 1)}=", "answer": str(i)} for i in range(12)]


def _model_dir(path, *, template: bool = False, bos: bool = False) -> str:
    """The tiny model's tokenizer (no weights: the loader reads tokenizer.json, config.json and the template);
    ``bos``: its post-processor adds <bos> as Llama's and DeepSeek's do; ``template``: a chat template that
    writes <bos> itself."""
    from tokenizers.processors import TemplateProcessing

    from mrl.models.tiny import build_tokenizer

    os.makedirs(path)
    tok = build_tokenizer(512)
    if bos:
        tok.post_processor = TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"max_position_embeddings": 64}, f)
    if template:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                       "chat_template": TEMPLATE}, f)
    return str(path)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("m") / "plain")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("m") / "chat", template=True, bos=True)


def _write(rows: list[dict], path) -> str:
    """``rows`` as a file of the format its extension names, written by ``datasets`` / pyarrow."""
    path = str(path)
    ds = datasets.Dataset.from_list(rows)
    if path.endswith(".parquet"):
        ds.to_parquet(path)
    elif path.endswith((".jsonl", ".json")):
        ds.to_json(path)
    else:  # Arrow IPC: a stream (what datasets writes), or a file (".feather"-style, named .arrow here)
        table = ds.data.table
        with pa.OSFile(path, "wb") as sink:
            opener = pa.ipc.new_file if path.endswith(".file.arrow") else pa.ipc.new_stream
            with opener(sink, table.schema) as w:
                w.write_table(table)
    return path


def _load(model_dir: str, *overrides: str, split: str = "train", max_new_tokens: int = 8):
    cfg = compose(["data=hf", *overrides])
    return build_prompt_source(cfg.data, split=split, model_dir=model_dir, max_new_tokens=max_new_tokens)


def _all(ds) -> list:
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("name", ["p.jsonl", "p.parquet", "p.arrow", "p.file.arrow"])
def test_each_format_gives_the_rows_prompts(plain_dir, tmp_path, name):
    path = _write(ROWS, tmp_path / name)
    ds = _load(plain_dir, f"data.path={path}", "data.eval_fraction=0", "data.shuffle=false")
    assert [(p.id, p.text, p.answer) for p in _all(ds)] == [(r["id"], r["prompt"], r["answer"]) for r in ROWS]
    assert [p.meta["row"] for p in _all(ds)] == list(range(1, 13)) and not any(p.templated for p in _all(ds))
    assert ds.counts() == {"data_train_prompts": 12, "data_train_too_long": 0, "data_train_skipped": 0}


def test_a_glob_reads_every_shard_and_save_to_disk_files(plain_dir, tmp_path):
    _write(ROWS[:5], tmp_path / "train-0.parquet")
    _write(ROWS[5:], tmp_path / "train-1.parquet")
    ds = _load(plain_dir, f"data.path={tmp_path}/train-*.parquet", "data.eval_fraction=0", "data.shuffle=false")
    assert [p.id for p in _all(ds)] == [r["id"] for r in ROWS]
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))  # data-00000-of-00001.arrow
    ds = _load(plain_dir, f"data.path={tmp_path}/saved/*.arrow", "data.eval_fraction=0", "data.shuffle=false")
    assert [p.text for p in _all(ds)] == [r["prompt"] for r in ROWS]


def test_columns_are_mapped_and_the_rest_goes_to_meta_as_json(plain_dir, tmp_path):
    day = datetime.datetime(2026, 1, 2)
    rows = [{"question": "2+2=", "label": 4, "source": "gsm", "when": day, "max_new_tokens": 6},
            {"question": "3+5=", "label": 8.5, "source": "math", "when": day, "max_new_tokens": 7}]
    path = _write(rows, tmp_path / "q.parquet")
    ds = _load(plain_dir, f"data.path={path}", "data.prompt_key=question", "data.answer_key=label",
               "data.eval_fraction=0", "data.shuffle=false")
    a, b = _all(ds)
    assert (a.id, a.text, a.answer, b.answer) == ("q.parquet:1", "2+2=", "4", "8.5")  # no id column: file:row
    assert a.meta == {"source": "gsm", "when": str(day), "max_new_tokens": 6, "row": 1}
    json.dumps(a.meta)  # a checkpoint stores the prompts of buffered groups as JSON
    no_label = _load(plain_dir, f"data.path={path}", "data.prompt_key=question", "data.answer_key=null",
                     "data.eval_fraction=0")
    assert {p.answer for p in _all(no_label)} == {""} and "label" in no_label[0].meta


def test_chat_messages_are_rendered_by_the_models_template_with_its_special_tokens_once(chat_dir, tmp_path):
    from transformers import AutoTokenizer

    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"rev {x}="}]
             for x in ("ab", "ba", "abc")]
    path = _write([{"messages": m, "answer": "x"} for m in chats], tmp_path / "chat.jsonl")
    ds = _load(chat_dir, f"data.path={path}", "data.messages_key=messages", "data.eval_fraction=0",
               "data.shuffle=false")
    hf, tok = AutoTokenizer.from_pretrained(chat_dir), load_tokenizer(chat_dir)
    for p, messages in zip(_all(ds), chats):
        assert p.templated and p.text == f"<bos><|system|>be brief\n<|user|>{messages[1]['content']}\n<|assistant|>"
        assert p.meta["messages"] == messages
        ids = prompt_ids(p, tok)
        # what transformers makes of the chat: the template's <bos> and no second one from the post-processor
        assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        assert ids.count(BOS) == 1 and ids[0] == BOS
    assert "chat template applied" in ds.summary()


def test_plain_prompts_get_the_template_only_when_asked(chat_dir, tmp_path):
    path = _write(ROWS, tmp_path / "p.parquet")
    common = (f"data.path={path}", "data.eval_fraction=0", "data.shuffle=false")
    plain = _load(chat_dir, *common)
    assert plain[0].text == "rev ab=" and not plain[0].templated
    assert prompt_ids(plain[0], load_tokenizer(chat_dir))[0] == BOS  # the tokenizer's own <bos>, once
    wrapped = _load(chat_dir, *common, "data.chat_template=true")
    assert wrapped[0].text == "<bos><|user|>rev ab=\n<|assistant|>" and wrapped[0].templated


def test_messages_without_a_template_is_an_error_naming_column_and_model(plain_dir, tmp_path):
    path = _write([{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}], tmp_path / "chat.parquet")
    with pytest.raises(ValueError, match=rf"data.messages_key=messages: {path} holds chat messages, but the model's "
                                         rf"tokenizer \({plain_dir}\) has no chat template"):
        _load(plain_dir, f"data.path={path}", "data.messages_key=messages")
    with pytest.raises(ValueError, match="data.chat_template=true, but the model's tokenizer"):
        _load(plain_dir, f"data.path={_write(ROWS, tmp_path / 'p.parquet')}", "data.chat_template=true")
    with pytest.raises(Exception, match="data.chat_template: =false with data.messages_key=messages"):
        compose(["data=hf", f"data.path={path}", "data.messages_key=messages", "data.chat_template=false"])
    with pytest.raises(Exception, match="data.max_prompt_tokens: is read by data=hf only"):
        compose(["data=jsonl", f"data.path={path}", "+data.max_prompt_tokens=8"])


def test_malformed_rows_are_skipped_and_counted_or_raise_naming_file_and_row(chat_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "ok"}], "answer": "1", "max_new_tokens": None},
            {"messages": None, "answer": "2", "max_new_tokens": None},
            {"messages": [], "answer": "3", "max_new_tokens": None},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "4",
             "max_new_tokens": None},
            {"messages": [{"role": "user", "content": "ok too"}], "answer": None, "max_new_tokens": None},
            {"messages": [{"role": "user", "content": "budget"}], "answer": "6", "max_new_tokens": 0},
            {"messages": [{"role": "user", "content": "budget"}], "answer": "7", "max_new_tokens": 5},
            {"messages": [{"role": "tool", "content": "42"}], "answer": "8", "max_new_tokens": None}]
    path = _write(rows, tmp_path / "chat.parquet")
    common = (f"data.path={path}", "data.messages_key=messages", "data.eval_fraction=0", "data.shuffle=false")
    ds = _load(chat_dir, *common)
    assert [(p.meta["row"], p.meta["max_new_tokens"]) for p in _all(ds)] == [(1, None), (7, 5)]
    assert ds.stats.skipped == {"missing_value": 2, "bad_messages": 2, "wrong_type": 1, "template_error": 1}
    assert ds.stats.first_lines == {"missing_value": [2, 5], "bad_messages": [3, 4], "wrong_type": [6],
                                    "template_error": [8]}
    assert ds.counts()["data_train_skipped"] == 6 and "missing_value: 2 at rows 2, 5" in ds.summary()
    with pytest.raises(BadRowError, match=rf"^{path}:row 2: missing_value: messages are null \(data.on_bad_row="):
        _load(chat_dir, *common, "data.on_bad_row=error")


def test_prompts_over_the_budget_are_left_out_and_counted_never_cut(plain_dir, tmp_path):
    tok = load_tokenizer(plain_dir)
    lengths = [len(tok.encode(r["prompt"]).ids) for r in ROWS]
    budget = sorted(set(lengths))[1]  # the middle length of three: the longest third goes
    path = _write(ROWS, tmp_path / "p.parquet")
    ds = _load(plain_dir, f"data.path={path}", f"data.max_prompt_tokens={budget}", "data.eval_fraction=0",
               "data.shuffle=false")
    over = [i + 1 for i, n in enumerate(lengths) if n > budget]
    assert over and len(ds) == len(ROWS) - len(over)  # a prompt of exactly the budget is kept
    assert all(len(prompt_ids(p, tok)) <= budget for p in _all(ds))
    assert ds.counts() == {"data_train_prompts": len(ds), "data_train_too_long": len(over), "data_train_skipped": 0}
    assert ds.stats.first_lines["too_long"] == over[:5]
    assert f"too_long: {len(over)} at rows" in ds.summary() and f"prompt budget {budget} tokens" in ds.summary()
    # by default the budget is the model's context (64 here) less rollout.max_new_tokens
    default = _load(plain_dir, f"data.path={path}", "data.eval_fraction=0", max_new_tokens=64 - budget)
    assert len(default) == len(ds) and default.max_prompt_tokens == budget
    with pytest.raises(ValueError, match=rf"data.path={path}: no usable prompt in the train split: .* 0 prompts of "
                                         r"12 rows, 12 skipped \(too_long: 12 at rows 1, 2, 3, 4, 5, ...\)"):
        _load(plain_dir, f"data.path={path}", "data.max_prompt_tokens=1", "data.eval_fraction=0")


def test_held_out_rows_split_by_a_hash_of_the_prompt_and_split_seed(plain_dir, tmp_path):
    rows = [{"prompt": f"p{i % 150}", "answer": str(i)} for i in range(300)]  # each prompt twice
    path = _write(rows, tmp_path / "p.jsonl")

    def texts(*o, split="train"):
        return sorted(p.text for p in _all(_load(plain_dir, f"data.path={path}", "data.eval_fraction=0.2", *o,
                                                 split=split)))

    train, held = texts(), texts(split="eval")
    assert len(train) + len(held) == 300 and not set(train) & set(held)  # both copies of a prompt on one side
    assert 0.1 < len(held) / 300 < 0.3
    assert texts("data.seed=7", split="eval") == held  # the run's seed orders, it does not split
    assert texts("data.split_seed=1", split="eval") != held
    eval_file = _write(rows[:4], tmp_path / "held.parquet")
    own = _load(plain_dir, f"data.path={path}", f"data.eval_path={eval_file}", split="eval")
    assert len(own) == 4 and len(_load(plain_dir, f"data.path={path}", f"data.eval_path={eval_file}")) == 300
    with pytest.raises(ValueError, match="data.eval_path: not set and data.eval_fraction=0"):
        _load(plain_dir, f"data.path={path}", "data.eval_fraction=0", split="eval")


RESUME = """
import json, sys
from mrl.config.load import compose
from mrl.data import build_prompt_source
cfg = compose(["data=hf", "data.path=" + sys.argv[1], "data.seed=5"])
src = build_prompt_source(cfg.data, model_dir=sys.argv[2], max_new_tokens=8)
print(json.dumps([src.sample(i).id for i in range(int(sys.argv[3]), int(sys.argv[4]))]))
"""


def test_a_resumed_run_continues_the_uninterrupted_order(plain_dir, tmp_path):
    """The order is a function of (data.seed, epoch) only: a fresh process (another hash seed) asked from the
    stored index on continues what the uninterrupted run draws, across epochs; each epoch visits every prompt."""
    path = _write(ROWS, tmp_path / "p.parquet")
    ds = _load(plain_dir, f"data.path={path}", "data.seed=5")
    n = len(ds)
    whole = [ds.sample(i).id for i in range(3 * n)]
    assert all(sorted(whole[e * n:(e + 1) * n]) == sorted(p.id for p in _all(ds)) for e in range(3))
    assert whole[:n] != whole[n:2 * n]  # reshuffled each epoch
    k = n + 3  # resumed mid-epoch
    out = subprocess.run([sys.executable, "-c", RESUME, path, plain_dir, str(k), str(3 * n)], capture_output=True,
                         text=True, cwd=REPO, env=dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=REPO),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == whole[k:]
    assert [_load(plain_dir, f"data.path={path}", "data.seed=6").sample(i).id for i in range(n)] != whole[:n]


def test_templated_prompts_survive_the_checkpoints_json(chat_dir, tmp_path):
    from mrl.trainer.state import state_from_json, state_to_json

    path = _write([{"messages": [{"role": "user", "content": "hi"}], "answer": "x", "when": datetime.date(2026, 1, 2)}],
                  tmp_path / "c.parquet")
    p = _load(chat_dir, f"data.path={path}", "data.messages_key=messages", "data.eval_fraction=0")[0]
    assert state_from_json(json.loads(json.dumps(state_to_json(p)))) == p


def test_the_producer_sends_templated_prompts_without_a_second_bos(chat_dir, tmp_path):
    """The rollout path: the producer encodes a rendered chat as transformers does (the template's special
    tokens, none added), and a producer started at a stored index draws what the first one drew from there."""
    from transformers import AutoTokenizer

    from mrl.config.schema import RewardConfig
    from mrl.reward.scorer import RewardScorer
    from mrl.rollout.buffer import RolloutBuffer
    from mrl.rollout.manager import RolloutManager
    from mrl.rollout.producer import Producer
    from mrl.rollout.sample import SamplingSpec
    from mrl.rollout.scorers import RuleScorer
    from mrl.sglang.client import EngineClient
    from tests.fakes.fake_sglang import FakeSGLang
    from tests.unit.test_producer_resume import _until

    chats = [[{"role": "user", "content": f"rev {'ab' * (i + 1)}="}] for i in range(6)]
    path = _write([{"messages": m, "answer": "x"} for m in chats], tmp_path / "chat.parquet")
    src = _load(chat_dir, f"data.path={path}", "data.messages_key=messages", "data.eval_fraction=0")
    hf, tok = AutoTokenizer.from_pretrained(chat_dir), load_tokenizer(chat_dir)

    def groups(start: int, n: int):
        with FakeSGLang() as srv:
            buf = RolloutBuffer(max_staleness=4, drop_stale=True)
            prod = Producer(manager=RolloutManager([EngineClient(srv.url)], sampling=SamplingSpec(max_new_tokens=2)),
                            scorer=RuleScorer(RewardScorer(RewardConfig())), source=src, tokenizer=tok, buffer=buf,
                            group_size=2, dynamic_sampling=False, start_index=start)
            prod.start()
            prod.allow(n)
            _until(lambda: len(buf) >= n)
            prod.stop()
            prod.check()
        return sorted(buf.take(n, 0, timeout=5), key=lambda g: g.samples[0].group_id)

    first = groups(0, 5)
    for g in first:
        want = hf.apply_chat_template(g.prompt.meta["messages"], tokenize=True, add_generation_prompt=True)
        assert g.samples[0].prompt_ids == want["input_ids"] and want["input_ids"].count(BOS) == 1
    assert [g.prompt.id for g in groups(3, 2)] == [g.prompt.id for g in first[3:]]
