"""bench/loop_e2e.py's workload: prompts of exactly the drawn token counts, per-sample budgets in range and
long-tailed, and the overrides it gives ``mrl train`` compose into the config the bench describes."""

import argparse
import json
import os
import random
import sys

from tokenizers import Tokenizer

from mrl.config.load import compose
from mrl.models.tiny import build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import loop_e2e  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    base = dict(samples=8, prompt_len=[40, 60], response_median=30.0, response_sigma=0.9, max_response=200,
                min_response=4, cpu=True, prompts=4, inflight=4, engine_batch=32, micro_batch_size=4, pack_len=4096,
                trainer_procs=1, set=[])
    return argparse.Namespace(**(base | kw))


def test_prompts_have_their_drawn_lengths_and_budgets(tmp_path):
    tok = build_tokenizer(512)
    tok.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    a = _args()
    path = str(tmp_path / "p.jsonl")
    summary = loop_e2e.write_prompts(path, tok, a, rows=40)
    rows = [json.loads(x) for x in open(path)]
    rng = random.Random(0)  # the same draws, in the same order, as write_prompts
    for row in rows:
        plen = rng.randint(*a.prompt_len)
        budgets = loop_e2e.response_budgets(rng, a.samples, a.response_median, a.response_sigma, a.max_response,
                                            a.min_response)
        loop_e2e.prompt_text(rng, tok, plen)
        assert len(tok.encode(row["prompt"]).ids) == plen and row["max_new_tokens"] == budgets
    flat = [b for r in rows for b in r["max_new_tokens"]]
    assert min(flat) >= a.min_response and max(flat) <= a.max_response
    assert summary["response_budget_p90"] > 2 * summary["response_budget_p50"]  # long-tailed
    assert summary["rows"] == 40


def test_gpu_overrides_compose(tmp_path):
    a = _args(cpu=False, trainer_procs=2, set=["parallel=ep2", "engine.tp=2"])
    cfg = compose(loop_e2e.overrides(a, "/m", "/p.jsonl", str(tmp_path / "run"), steps=22))
    assert (cfg.engine.cpu_mode, cfg.engine.base_gpu_id, cfg.engine.tp, cfg.parallel.ep) == (False, 2, 2, 2)
    assert (cfg.train.steps, cfg.train.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (22, 4, 8)
    assert cfg.rollout.ignore_eos and cfg.train.mode.value == "overlap" and cfg.weight_sync.every_n_steps == 1


def test_summary_counts_only_timed_steps_and_times_the_first_step_from_the_start():
    phases = dict(wait_seconds=0.5, train_seconds=3.0, drain_seconds=0.1, sync_seconds=0.4,
                  **{"sync/push_seconds": 0.3, "sync/pause_seconds": 0.05})
    rows = [{"step": 1, "batch_tokens": 1000, "step_seconds": 30.0, "startup/policy_ready_s": 60.0, **phases}]
    rows += [{"step": i, "batch_tokens": 2000 * i, "step_seconds": float(i), **phases} for i in (2, 3, 4)]
    logged = {"1": 100.0, "2": 102.0, "3": 105.0, "4": 109.0}
    s = loop_e2e.summarize(rows, logged, warmup=1)
    assert s["timed_steps"] == 3 and s["tokens"] == 2000 * 9 and s["seconds"] == 9.0
    assert s["tokens_per_s"] == 2000.0 and s["tokens_per_s_per_step_median"] == 2000.0
    assert s["time_to_first_step_s"] == 100.0 and s["first_step"]["step_seconds"] == 30.0
    assert s["start_phases_s"] == {"policy_ready": 60.0}
    assert s["busy_window_s"] == [100.0, 109.0]  # from the start of step 2 to the end of step 4
    assert s["phase_median_s"]["step_seconds"] == 3.0 and s["sync_share_of_step"] == 0.4 / 3.0
    assert [r["logged_at_s"] for r in s["steps"]] == [100.0, 102.0, 105.0, 109.0]
    assert s["sync_phase_median_s"] == {"check_seconds": 0.0, "pause_seconds": 0.05, "push_seconds": 0.3,
                                        "finish_seconds": 0.0, "barrier_seconds": 0.0}
    assert s["steps"][1]["sync/push_seconds"] == 0.3


def test_the_full_depth_model_is_written_tensor_by_tensor(tmp_path):
    """--model of bench/_random_checkpoint.py's shapes (qwen3_30b_a3b at full depth for the 8-GPU loop) goes
    through its sharded writer, not a model in memory: config, index and shards as the bridge reads them. The
    CPU-sized shape of the same path stands in for the 61 GB one."""
    import subprocess

    import _bench_common
    from mrl.models import get_bridge

    hf = str(tmp_path / "model")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(loop_e2e.__file__), "_bench_common.py"),
                    "make-model", hf, "--preset", "cpu_wide"], check=True, capture_output=True, timeout=300)
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) >= 1 and not os.path.exists(os.path.join(hf, "model.safetensors"))
    bridge = get_bridge(hf)
    assert bridge.hf_config.num_experts == 64 and bridge.num_layers == 2
    assert "qwen3_30b_a3b" in _bench_common.RANDOM_SHAPES
    # the full depth's preset composes into the 8-GPU layout the loop bench asks of mrl train
    a = _args(cpu=False, trainer_procs=4, set=["parallel=ep4", "engine.count=2", "engine.tp=2"])
    cfg = compose(loop_e2e.overrides(a, hf, str(tmp_path / "p.jsonl"), str(tmp_path / "run"), 3))
    assert cfg.engine.base_gpu_id == 4 and cfg.engine.tp == 2 and cfg.parallel.ep == 4
