"""A LoRA job end to end (``mrl train +experiment=lora_tiny``, shortened): real SGLang CPU engine started with
the LoRA flags, Megatron trainer with adapters on attention, one adapter version pushed per sync.

Sync mode, so every sampled token was produced by the trainer's current version: the engine's logprobs then
equal the trainer's only if it applied exactly the trainer's adapter (the warm start has moved it far from
the base). Whether the job learns is shown by the report
(bench/reports/learning/2026-11-27_mrl_train_lora_tiny_cpu.json), not here.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time

import psutil

from tests.e2e.test_train_loop import MRL, REPO

STEPS = 3
LAYERS = 3  # the tiny model's
PEFT = "base_model.model.model.layers.{}.self_attn.{}_proj.lora_{}.weight"


def test_lora_job_pushes_adapters_and_ends_cleanly(tmp_path):
    run = tmp_path / "lora"
    proc = subprocess.Popen([MRL, "train", "+experiment=lora_tiny", f"run_dir={run}", "train.mode=sync",
                             f"train.steps={STEPS}", "train.sft_warmup_steps=3", "train.prompts_per_step=4",
                             "train.eval_every=0", "train.save_every=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    tree = _job_tree(proc, run)  # ranks, rollout process, engine and its children, while the job runs
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-5000:]
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, f"processes of the job left running: {[p.pid for p in alive]}"

    steps = [json.loads(x) for x in open(run / "metrics.jsonl")]
    steps = [r for r in steps if "step_seconds" in r]
    assert [r["version"] for r in steps] == [2, 3, 4]  # v1 = the warm start's adapter; +1 per step
    assert all(set(r["staleness_hist"]) == {"0"} for r in steps)
    # the engine sampled with the trainer's own adapter: same logprobs (fp32), same experts
    assert all(r["logprob_diff_replay_on"] < 1e-5 and r["routing_disagreement"] < 0.05 for r in steps), steps
    assert all(r["sync_verify_max_diff"] < 1e-4 for r in steps)  # weight_sync.verify probed the adapter
    # adapters, not weights: no drain, r=8 on q/k/v/o of 3 layers (fp32), retired versions unloaded
    r_, hidden, q, kv = 8, 64, 64, 32
    adapter_bytes = 4 * LAYERS * r_ * ((hidden + q) + (hidden + kv) * 2 + (q + hidden))
    assert all(r["sync_bytes"] == adapter_bytes and r["sync_aborted_requests"] == 0 for r in steps), steps
    assert all(r["rollout/lora_adapters_live"] <= 2 and r["rollout/lora_unload_errors"] == 0 for r in steps)
    # every version reached the engine as an adapter of its own, and the older ones were unloaded
    log = open(run / "engines" / "engine0.log").read()
    loaded = [int(v) for v in re.findall(r"Start load Lora adapter from tensors\. Lora name=policy@v(\d+)", log)]
    unloaded = [int(v) for v in re.findall(r"Start unload Lora adapter\. Lora name=policy@v(\d+)", log)]
    assert loaded == [1, 2, 3, 4] and set(unloaded) <= {1, 2, 3} and len(unloaded) >= 2, (loaded, unloaded)

    _check_checkpoint_holds_adapters_only(run / "checkpoints" / f"step_{STEPS}")
    _check_final_adapter(run / "adapter")


def _job_tree(proc: subprocess.Popen, run) -> list[psutil.Process]:
    """Every descendant of ``mrl train`` once the engine is up and step 1 is logged."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and any('"step_seconds"' in x for x in open(metrics)):
            try:
                return psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                break
        time.sleep(0.5)
    return []


def _check_checkpoint_holds_adapters_only(path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = [k for k in keys if not k.startswith("common_state")]
    weights = [k for k in tensors if not k.startswith("optimizer")]
    assert sorted(weights) == sorted(f"decoder.layers.{i}.self_attention.{m}_lora.{f}" for i in range(LAYERS)
                                     for m in ("linear_qkv", "linear_proj") for f in "AB"), weights
    # the optimizer state as the ranks hold it (train.optimizer_checkpoint=dp_reshardable): buckets of the
    # adapters' master weights and moments, no base weight among them -- as many elements as the adapters,
    # up to megatron's bucket padding
    numel = {k: math.prod(keys[k].size) for k in tensors if hasattr(keys[k], "size")}  # not the pickled objects
    adapters = sum(numel[k] for k in weights)
    for state in ("param", "exp_avg", "exp_avg_sq"):
        held = sum(n for k, n in numel.items() if k.startswith("optimizer.distributed.") and k.endswith(f".{state}"))
        assert adapters <= held < adapters + 1024, (state, held, adapters)
    assert all(k in weights or k.startswith("optimizer.distributed.") for k in tensors), tensors


def _check_final_adapter(path) -> None:
    from mrl.models.peft import load_peft

    tensors, config = load_peft(str(path))
    assert set(tensors) == {PEFT.format(i, m, f) for i in range(LAYERS) for m in "qkvo" for f in "AB"}
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert all(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k)  # trained away from B = 0
