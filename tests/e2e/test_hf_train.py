"""``mrl train data=hf`` end to end, shortened: chat rows from a Parquet file, rendered by the model's chat template
(a tiny checkpoint given one, whose tokenizer adds <bos> as Llama's does), prompts over the budget left out and
counted in the console and the metrics, the warm start and two RL steps on a real SGLang CPU engine."""

from __future__ import annotations

import json
import os
import shutil

import datasets

from tests.e2e.test_train_loop import mrl_train
from tests.unit.test_hf_data import BOS, TEMPLATE

LONG = 3  # rows over the budget


def _chat_model(tmp_path) -> str:
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from mrl.config.schema import TinyPreset
    from mrl.models.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "chat_tiny"), TinyPreset.tiny)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "chat_template": TEMPLATE}, f)
    return path


def test_a_run_on_chat_rows_from_a_parquet_file(tmp_path):
    letters = "abcdef"
    rows = [{"messages": [{"role": "user", "content": f"last {a}{b}="}], "answer": b}
            for a in letters for b in letters]
    rows += [{"messages": [{"role": "user", "content": "last " + "ab" * 100 + "="}], "answer": "b"}] * LONG
    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    model = _chat_model(tmp_path)
    run = tmp_path / "run"
    p, rows_out = mrl_train(run, f"model.hf_path={model}", "data=hf", f"data.path={path}",
                            "data.messages_key=messages", "data.max_prompt_tokens=48", "data.eval_fraction=0",
                            "reward.fn=tests.e2e.reward_fns.chat_copy_last", "reward.on_error=raise",
                            "train.mode=sync", "train.steps=2", "train.sft_warmup_steps=2",
                            "train.prompts_per_step=4", "train.eval_every=0", "train.save_at_end=false",
                            "train.save_hf=false", timeout=900)
    line = next(x for x in p.stdout.splitlines() if x.startswith("[mrl] data: "))
    assert line == (f"[mrl] data: {path} [train]: 36 prompts of {36 + LONG} rows, {LONG} skipped (too_long: {LONG} "
                    "at rows 37, 38, 39); prompt budget 48 tokens (data.max_prompt_tokens); chat template applied")
    steps = [r for r in rows_out if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/data_train_prompts"] == 36 and r["rollout/data_train_too_long"] == LONG
               and r["rollout/data_train_skipped"] == 0 and r["rollout/reward_errors"] == 0 for r in steps), steps
    shutil.rmtree(model)
