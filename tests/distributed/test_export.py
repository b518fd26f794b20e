"""``mrl export`` of checkpoints written by short real training runs (``tests.jobs.export_run``), and the end-of-run
export from the live model (``train.save_hf``): transformers loads the result and gives the trainer's logits
(fp32: equal to rounding); a checkpoint trained under TP2 x EP2 exports to the same tensors in one TP1 process
and in its own layout; another model's checkpoint is refused; LoRA runs export the PEFT adapter or the merged
model."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.dist

ATOL = 1e-5  # fp32 on CPU: megatron's and transformers' kernels differ by rounding only (~3e-7 seen)


def mrl_export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mrl", "export", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(glob.glob(f"{path}/*.safetensors")) for k, v in load_file(f).items()}


def hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from tests.jobs.export_run import fixed_ids

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(input_ids=fixed_ids(m.config.vocab_size)).logits


def train(tmp_path_factory, hf: str, parallel: str, nproc: int, *extra: str):
    run = tmp_path_factory.mktemp(f"run_{parallel}") / "run"
    r = run_torchrun("tests.jobs.export_run", ["--hf", hf, "--parallel", parallel, "--run-dir", str(run), *extra],
                     nproc, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def tp2_ep2_run(ckpt_dir, tmp_path_factory):
    """Two RL steps under TP2 x EP2 (ETP1) on 2 ranks: attention split by TP, experts by EP."""
    return train(tmp_path_factory, ckpt_dir["tiny"], "tp2_ep2", 2)


@pytest.fixture(scope="module")
def tp1_export(tp2_ep2_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tp1"
    r = mrl_export(tp2_ep2_run, out)  # the run directory: its newest checkpoint, step_2
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_export_loads_in_transformers_with_the_trainers_logits(tp2_ep2_run, tp1_export, ckpt_dir):
    out = tp1_export
    assert not os.path.exists(f"{out}.partial")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(os.path.basename(f) for f in glob.glob(f"{out}/*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    got, base = tensors(out), tensors(ckpt_dir["tiny"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert set(got) == set(base) and all(not torch.equal(got[k], base[k]) for k in got)  # all trained
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    trainer = torch.load(tp2_ep2_run / "logits.pt")
    diff = (hf_logits(out) - trainer).abs().max().item()
    assert diff <= ATOL, diff


def test_a_multi_rank_checkpoint_exports_alike_in_any_layout(tp2_ep2_run, tp1_export, tmp_path):
    """The TP2 x EP2 checkpoint read by one TP1 process, by 2 ranks in its own layout, and the trainer's own
    end-of-run export from the live model (``train.save_hf``, run_dir/hf/final): the same tensors, bit for bit."""
    r = mrl_export(tp2_ep2_run / "checkpoints" / "step_2", tmp_path / "tp2_ep2", "--tp", 2, "--ep", 2, "--etp", 1)
    assert r.returncode == 0, r.stderr[-4000:]
    assert len(glob.glob(f"{tmp_path}/tp2_ep2/*.safetensors")) == 2  # each rank wrote the tensors it owns
    tp1, tp2_ep2, live = tensors(tp1_export), tensors(tmp_path / "tp2_ep2"), tensors(tp2_ep2_run / "hf" / "final")
    assert set(tp1) == set(tp2_ep2) == set(live)
    assert all(torch.equal(tp1[k], tp2_ep2[k]) and torch.equal(tp1[k], live[k]) for k in tp1)


def test_another_models_checkpoint_is_refused(tp2_ep2_run, ckpt_dir, tmp_path):
    r = mrl_export(tp2_ep2_run, tmp_path / "out", "--hf", ckpt_dir["stress_a"])
    assert r.returncode == 1
    assert "does not match the model of model.hf_path=" in r.stderr, r.stderr[-3000:]
    assert "3 transformer layers in the checkpoint, 4 in the model" in r.stderr
    assert not os.path.exists(tmp_path / "out")


def test_a_lora_run_exports_its_adapter_or_the_merged_model(ckpt_dir, tmp_path_factory, tmp_path):
    from mrl.models.peft import load_peft

    run = train(tmp_path_factory, ckpt_dir["tiny"], "tp1", 1, "--lora")
    r = mrl_export(run, tmp_path / "peft")
    assert r.returncode == 0, r.stderr[-4000:]
    adapter, config = load_peft(str(tmp_path / "peft"))
    live, _ = load_peft(str(run / "hf" / "final"))  # train.save_hf of a LoRA run: the adapter too
    assert (config["r"], config["lora_alpha"]) == (4, 8.0) and set(adapter) == set(live)
    assert all(torch.equal(adapter[k], live[k]) for k in adapter)
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if ".lora_B." in k)  # trained away from B = 0
    r = mrl_export(run, tmp_path / "merged", "--merge")
    assert r.returncode == 0, r.stderr[-4000:]
    diff = (hf_logits(tmp_path / "merged") - torch.load(run / "logits.pt")).abs().max().item()
    assert diff <= ATOL, diff
