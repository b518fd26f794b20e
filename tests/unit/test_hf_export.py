"""The export's directory handling (``mrl.models.hf_export``) and what ``mrl export`` refuses before starting any
rank (``mrl.jobs.export.launch``): OUT is written as OUT.partial and renamed, an existing OUT is refused unless
--force, and a path that is not a complete trainer checkpoint is named for what it is."""

from __future__ import annotations

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from mrl.jobs.export import find_source, launch
from mrl.models.checkpoint import CheckpointError, HFCheckpoint
from mrl.models.hf_export import ShardWriter, begin_output, copy_model_files, publish, write_index
from mrl.process import LOOP_STATE_FILE


def test_shards_and_index_read_back_as_one_checkpoint(tmp_path):
    """Two writers (two ranks), shards of at most 600 bytes: the files get transformers' names in order, the
    index maps every tensor to its file, and the checkpoint reads back as written."""
    want = {f"w{i}": torch.full((10, 10), float(i)) for i in range(5)}  # 400 bytes each
    a, b = (ShardWriter(str(tmp_path), prefix=p, max_bytes=600) for p in ("rank00000", "rank00001"))
    for i, (k, v) in enumerate(want.items()):
        (a if i < 3 else b).add(k, v)
    total = write_index(str(tmp_path), [a.close(), b.close()])
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == [
        f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]  # one tensor per file at this size
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert total == index["metadata"]["total_size"] == 5 * 400
    assert index["weight_map"]["w0"] == "model-00001-of-00005.safetensors"
    assert index["weight_map"]["w4"] == "model-00005-of-00005.safetensors"
    ck = HFCheckpoint(str(tmp_path))
    assert all(torch.equal(ck.read(k), v) for k, v in want.items())


def test_model_files_are_copied_without_weights(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    (src / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "model_type": "x"}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        (src / name).write_text("{}")
    copied = copy_model_files(str(src), str(dst), dtype="float32", engine_config={"model_type": "y", "extra": 1})
    assert copied == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
                      "tokenizer_config.json"]
    # the dtype is the export's; engine keys the config lacks are added, those it has are kept
    assert json.loads((dst / "config.json").read_text()) == {"torch_dtype": "float32", "model_type": "x", "extra": 1}


def test_out_is_whole_or_absent(tmp_path):
    out = tmp_path / "out"
    partial = begin_output(str(out), force=False)
    assert partial == f"{out}.partial" and not out.exists()
    (tmp_path / "out.partial" / "a").write_text("1")
    publish(partial, str(out))
    assert (out / "a").read_text() == "1" and not os.path.exists(partial)
    with pytest.raises(CheckpointError, match="already exists.*--force"):
        begin_output(str(out), force=False)
    partial = begin_output(str(out), force=True)  # what an interrupted export left is removed first
    (tmp_path / "out.partial" / "b").write_text("2")
    assert (out / "a").exists()  # the old OUT stays whole until the new one is complete
    publish(partial, str(out))
    assert sorted(os.listdir(out)) == ["b"] and not (tmp_path / "out.old").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="a file already exists"):
        begin_output(str(tmp_path / "file"), force=True)


@pytest.fixture
def run_dir(tmp_path, ckpt_dir):
    """A run directory as ``mrl train`` leaves it (checkpoint contents aside): config.yaml, a complete
    checkpoint step_2 and an incomplete step_4."""
    from mrl.config.load import compose

    run = tmp_path / "run"
    cfg = compose([f"model.hf_path={ckpt_dir['tiny']}", f"run_dir={run}"])
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / LOOP_STATE_FILE).write_text("{}")
    (run / "checkpoints" / "step_4").mkdir()
    (run / "checkpoints" / "step_4" / ".metadata").write_text("")
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return run


def test_a_run_directory_means_its_newest_complete_checkpoint(run_dir, ckpt_dir):
    src = find_source(str(run_dir))
    assert src.checkpoint == str(run_dir / "checkpoints" / "step_2")
    assert src.config_path == str(run_dir / "config.yaml") and src.cfg.model.hf_path == ckpt_dir["tiny"]
    assert find_source(src.checkpoint, hf=ckpt_dir["stress_a"]).cfg.model.hf_path == ckpt_dir["stress_a"]


@pytest.mark.parametrize("what, args, message", [
    ("missing", lambda run, ck: [str(run / "nope"), "out"], "no such directory"),
    ("incomplete", lambda run, ck: [str(run / "checkpoints" / "step_4"), "out"], "incomplete checkpoint"),
    ("hf", lambda run, ck: [ck["tiny"], "out"], "a Hugging Face checkpoint"),
    ("other", lambda run, ck: [str(run / "checkpoints"), "out"], "not a trainer checkpoint"),
    ("no config", lambda run, ck: [str(run / "checkpoints" / "step_2"), "out", "--config", str(run / "x.yaml")],
     "x.yaml: missing"),
    ("no model", lambda run, ck: [str(run), "out", "--hf", str(run)], "no config.json there"),
    ("out exists", lambda run, ck: [str(run), str(run / "checkpoints")], "already exists.*--force"),
    ("out inside", lambda run, ck: [str(run / "checkpoints" / "step_2"), str(run / "checkpoints" / "step_2" / "o"),
                                    "--force"], "lies inside the checkpoint it exports"),
    ("out holds it", lambda run, ck: [str(run), str(run), "--force"], "holds or lies inside the checkpoint"),
    ("out is the model", lambda run, ck: [str(run), ck["tiny"], "--force"], "is, holds or lies inside model.hf_path"),
])
def test_mrl_export_refuses_before_starting_a_rank(run_dir, ckpt_dir, tmp_path, monkeypatch, capsys, what, args,
                                                  message):
    import re

    monkeypatch.chdir(tmp_path)
    assert launch(args(run_dir, ckpt_dir)) == 1
    err = capsys.readouterr().err
    assert err.startswith("[mrl] export: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_which_hf_directory_a_step_writes():
    from mrl.config.train import TrainConfig
    from mrl.megatron.export import hf_dir_due

    every = TrainConfig(steps=6, save_hf_every=2)
    assert [hf_dir_due(every, s) for s in range(1, 7)] == [None, "step_2", None, "step_4", None, "final"]
    assert [hf_dir_due(TrainConfig(steps=6, save_hf=False, save_hf_every=3), s) for s in (3, 6)] == ["step_3",
                                                                                                   "step_6"]
    assert [hf_dir_due(TrainConfig(steps=6, save_hf=False), s) for s in range(1, 7)] == [None] * 6
    with pytest.raises(ValueError, match="train.save_hf_every"):
        TrainConfig(save_hf_every=-1)
