"""Bad input: each gives a clear error naming what is wrong, or a counted skip, before anything starts.

- ``mrl train`` overrides: unknown key (also through ``+key=``, which Hydra would otherwise accept into a
  structured config and mrl silently ignore), wrong type, bad enum value, out-of-range value, unknown
  preset: exit 1 in about a second, the message naming the field;
- dataset rows: malformed JSONL rows are skipped and counted per reason (``data.on_bad_row=error`` names
  file:line); reward fns that raise, time out or return a non-number are counted;
- checkpoints: an HF checkpoint whose tensors do not match its config.json; a trainer checkpoint written for
  another model (layer count, shapes) refused before loading, naming the checkpoint, the model and tensors;
- tokenizer: one that does not belong to the model (more tokens than its vocabulary, or missing) is refused
  at startup naming tokenizer.json and config.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.reliability
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")

OVERRIDES = {  # override -> what the error must say
    "unknown key": ("train.stepz=3", ["Key 'stepz' not in 'TrainConfig'", "full_key: train.stepz"]),
    "unknown key added with +": ("+train.sft_warmup_step=0",
                                 ["train.sft_warmup_step: not a field of TrainConfig (did you mean "
                                  "train.sft_warmup_steps?)"]),
    "wrong type": ("train.steps=many", ["Value 'many' of type 'str' could not be converted to Integer",
                                        "full_key: train.steps"]),
    "bad enum value": ("parallel.dispatcher=flex", ["Invalid value 'flex', expected one of [alltoall, allgather]",
                                                    "full_key: parallel.dispatcher"]),
    "value out of range": ("rollout.top_p=0", ["rollout.top_p: must be in (0, 1], got 0.0"]),
    "unknown preset": ("parallel=tp3", ["Could not find 'parallel/tp3'", "Available options in 'parallel'"]),
}


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_invalid_override_fails_at_once_naming_the_field(case, tmp_path, reliability):
    override, want = OVERRIDES[case]
    p = subprocess.run([MRL, "train", f"run_dir={tmp_path / 'run'}", override], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 1
    for w in want:
        assert w in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing started
    reliability.record(category="bad_input", name=f"override: {case}", survived=True,
                       injected=f"mrl train {override}", expected="exit 1 before anything starts, naming the field",
                       message=" / ".join(want))


def test_malformed_dataset_rows_are_skipped_and_counted(tmp_path, reliability):
    from mrl.data import BadRowError, JsonlDataset

    rows = ['{"prompt": "2+2=", "answer": "4"}', '{"prompt": "3+3=", "answer": 6}', "{not json",
            '{"answer": "1"}', '{"prompt": 7, "answer": "1"}', '{"prompt": "", "answer": "1"}', "",
            '{"prompt": "1+1=", "answer": ["2"]}']
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(rows) + "\n")
    ds = JsonlDataset(str(path))
    assert len(ds) == 2 and ds.stats.num_skipped == 5
    assert ds.stats.skipped == {"invalid_json": 1, "missing_key": 1, "wrong_type": 2, "empty_prompt": 1}
    with pytest.raises(BadRowError, match=r"p\.jsonl:3: "):
        JsonlDataset(str(path), on_bad_row="error")
    reliability.record(category="bad_input", name="malformed JSONL rows", survived=True,
                       injected="7 rows: 2 good, invalid JSON, missing key, 2 wrong types, empty prompt (+1 blank)",
                       expected="skipped and counted per reason (data.on_bad_row=error: raises with file:line)",
                       message=ds.stats.summary().replace(str(tmp_path) + "/", ""),
                       details={"rows": 7, "kept": 2, "skipped": 5})


def test_reward_fn_failures_are_counted(reliability):
    from mrl.config.schema import RewardConfig
    from mrl.data import Prompt
    from mrl.reward.scorer import RewardScorer

    async def go(fn):
        with RewardScorer(RewardConfig(fn=fn, timeout_s=0.5)) as s:
            res = await s.score_many([(Prompt(id="p", text="x", answer="1"), t) for t in ("a", "sleep 2", "b")])
            return res, s.stats

    res, stats = asyncio.run(go("tests.unit.reward_fns.boom"))
    assert [r.value for r in res] == [0.0, 0.0, 0.0] and stats["errors"] == 3
    assert res[0].error == "RuntimeError: boom"
    res2, stats2 = asyncio.run(go("tests.unit.reward_fns.sleepy"))
    assert [r.value for r in res2] == [1.0, 0.0, 1.0] and stats2["timeouts"] == 1
    reliability.record(category="bad_input", name="reward fn raises / times out", survived=True,
                       injected="reward.fn raising on every call; a call taking 2 s with reward.timeout_s=0.5",
                       expected="scored reward.error_value (or dropped / raised, reward.on_error), always counted",
                       message=f"{res[0].error}; timed out after 0.5s",
                       details={"errors_counted": stats["errors"], "timeouts_counted": stats2["timeouts"]})


def test_hf_checkpoint_not_matching_its_config(ckpt_dir, tmp_path, reliability):
    from safetensors.torch import load_file, save_file

    from mrl.models import get_bridge
    from mrl.models.checkpoint import CheckpointError, HFCheckpoint

    bad = tmp_path / "tiny"
    shutil.copytree(ckpt_dir["tiny"], bad)
    t = load_file(bad / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :32].contiguous()
    del t["model.norm.weight"]
    save_file(t, bad / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        b = get_bridge(str(bad))
        HFCheckpoint(str(bad)).check_against(b.hf_tensor_shapes(b.padded_vocab(128, 1)))
    msg = str(e.value)
    assert "missing tensors: ['model.norm.weight']" in msg
    assert "model.layers.0.self_attn.o_proj.weight has [64, 32]" in msg
    reliability.record(category="bad_input", name="HF checkpoint not matching its config.json", survived=True,
                       injected="model.hf_path with one tensor missing and one mis-shaped",
                       expected="refused before loading, naming each tensor",
                       message=msg.replace(str(tmp_path), "<dir>"))


def test_tokenizer_of_another_model_is_refused(ckpt_dir, tmp_path, reliability):
    from mrl.models import get_bridge
    from mrl.models.checkpoint import CheckpointError, check_tokenizer

    def check(path):
        b = get_bridge(path)
        check_tokenizer(path, vocab_size=b.vocab_size, special_ids={
            k: getattr(b.hf_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})

    for preset in ("tiny", "stress_a", "stress_b"):
        check(ckpt_dir[preset])  # the built-in models pass
    other = tmp_path / "stress_a"
    shutil.copytree(ckpt_dir["stress_a"], other)  # vocab_size 500
    shutil.copy(os.path.join(ckpt_dir["tiny"], "tokenizer.json"), other / "tokenizer.json")  # 512 tokens
    with pytest.raises(CheckpointError) as e:
        check(str(other))
    msg = str(e.value)
    assert f"{other}/tokenizer.json does not match the model: it has 512 tokens but {other}/config.json has " \
           "vocab_size=500" in msg
    os.remove(other / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        check(str(other))
    reliability.record(category="bad_input", name="tokenizer of another model", survived=True,
                       injected="stress_a (vocab 500) with the tiny model's tokenizer.json (512 tokens); then none",
                       expected="refused at trainer start-up (Policy), naming tokenizer.json and config.json",
                       message=msg.replace(str(tmp_path), "<dir>"))


def test_trainer_checkpoint_of_another_model_is_refused(ckpt_dir, tmp_path, reliability):
    """A trainer checkpoint of the tiny model (3 layers) resumed by stress_a (4 layers, other shapes)."""
    out = tmp_path / "res.json"
    r = run_torchrun("tests.unit.test_bad_input", [ckpt_dir["tiny"], ckpt_dir["stress_a"], str(tmp_path), str(out)],
                     1, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["same_model"] == "loaded"
    msg = res["other_model"]
    ckpt = tmp_path / "ckpt"
    assert msg.startswith(f"CheckpointError: {ckpt}: this trainer checkpoint does not match the model of "
                          f"model.hf_path={ckpt_dir['stress_a']}: 3 transformer layers in the checkpoint, 4 in the "
                          "model; mis-shaped tensors: "), msg
    assert "decoder.layers.0.self_attention.linear_proj.weight is [64, 64] in the checkpoint, [64, 96] in the " \
           "model" in msg and "tensors missing from the checkpoint: [" in msg and "'decoder.layers.3." in msg
    reliability.record(category="bad_input", name="trainer checkpoint of another model", survived=True,
                       injected="resume (Policy.load) of a tiny-model checkpoint by stress_a",
                       expected="refused before loading, naming checkpoint, model and tensors",
                       message=msg.replace(str(tmp_path), "<run_dir>").replace(ckpt_dir["stress_a"], "<stress_a>"))


def _resume_worker(model_a: str, model_b: str, run_dir: str, out: str) -> None:
    """Save a trainer checkpoint of ``model_a``; load it into ``model_a`` (must work) and ``model_b``."""
    from mrl.config.load import compose
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy

    res = {}
    ckpt = os.path.join(run_dir, "ckpt")
    for name, model in (("same_model", model_a), ("other_model", model_b)):
        cfg = compose([f"model.hf_path={model}", f"run_dir={run_dir}"])
        policy = Policy(cfg, init_parallel(cfg.parallel), model)
        if not os.path.isdir(ckpt):
            policy.sft_step([[5, 6, 7, 8, 9]], [2], 1e-3)  # an optimizer step: Adam state to save
            policy.save(ckpt)
        try:
            policy.load(ckpt)
            res[name] = "loaded"
        except Exception as e:
            res[name] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _resume_worker(*sys.argv[1:5])
