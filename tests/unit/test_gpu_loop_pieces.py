"""The pieces of bench/gpu_loop.py and its rollout section that run only on GPU hosts otherwise: the random
checkpoint writer, the merge of Keep Routing records over ranks, the engine TP shards of the bitwise check,
the rollout kinds and their ratios, what the engines' logs and py-spy say."""

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from mrl.config.schema import TinyPreset
from mrl.models import get_bridge
from mrl.models.checkpoint import HFCheckpoint
from mrl.models.tiny import make_tiny_model
from tests.jobs.replay_check import agreement, logprob_diffs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _engine_shards import engine_shard, expert_layouts  # noqa: E402
from _random_checkpoint import make_checkpoint  # noqa: E402


def _load_all(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def test_sharded_checkpoint_matches_the_tiny_model_and_is_deterministic(tmp_path):
    a = make_checkpoint(str(tmp_path / "a"), "tiny", None, seed=3, shard_gb=0.0001)
    b = make_checkpoint(str(tmp_path / "b"), "tiny", None, seed=3, shard_gb=0.0001)
    c = make_checkpoint(str(tmp_path / "c"), "tiny", None, seed=4, shard_gb=0.0001)
    ref = _load_all(make_tiny_model(str(tmp_path / "ref"), TinyPreset.tiny))
    ta, tb, tc = _load_all(a), _load_all(b), _load_all(c)
    assert len([f for f in os.listdir(a) if f.endswith(".safetensors")]) > 1
    assert {k: tuple(v.shape) for k, v in ta.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    assert all(v.dtype == torch.bfloat16 for v in ta.values())
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["lm_head.weight"], tc["lm_head.weight"])
    ck = HFCheckpoint(a)  # through the index, rows of one tensor
    assert torch.equal(ck.read("model.layers.2.mlp.experts.5.up_proj.weight", rows=(0, 4)).to(torch.bfloat16),
                       ta["model.layers.2.mlp.experts.5.up_proj.weight"][:4])
    assert get_bridge(a).num_experts == 8


def _records(samples, tp, sp, dp, per_mb, mbs, ncol, flip=None):
    """Rank records as replay_check writes them, routers picking the engine's experts except at
    ``flip`` = (sequence, position)."""
    seq_len = max(len(s) for s in samples["sequences"])
    seq_len += (-seq_len) % tp
    reps = []
    for d in range(dp):
        mine = list(range(d * per_mb * mbs, (d + 1) * per_mb * mbs))
        for t in range(tp):
            rows = range(t * seq_len // tp, (t + 1) * seq_len // tp) if sp else range(seq_len)
            calls = []
            for mb in range(mbs):
                for col in range(ncol):
                    ids = []
                    for s in rows:
                        for b in range(per_mb):
                            i = mine[mb * per_mb + b]
                            r = samples["routes"][i]
                            got = list(r[s][col]) if s < len(r) else [0, 1]
                            if (i, s) == flip:
                                got = [got[0], 7 - got[1]]
                            ids.append(got)
                    calls.append((col, ids))
            lps = [[[float(-k) for k in range(seq_len)] for _ in range(per_mb)] for _ in range(mbs)] if t == 0 else []
            reps.append({"tp_rank": t, "tp": tp, "sp": sp, "seq_len": seq_len, "sequences": mine, "per_mb": per_mb,
                         "moe_columns": list(range(ncol)), "forward_calls": calls, "logprobs_replay": lps})
    return reps


def test_agreement_and_logprobs_over_ranks():
    g = torch.Generator().manual_seed(0)
    lens = [7, 5, 8, 6]
    seqs = [list(range(n)) for n in lens]
    routes = [[[sorted(torch.randperm(7, generator=g)[:2].tolist()) for _ in range(2)] for _ in range(n - 1)]
              for n in lens]
    prompt = [3, 2, 4, 3]
    samples = {"sequences": seqs, "routes": routes, "prompt_lens": prompt,
               "engine_logprobs": [[float(-k) for k in range(p - 1, n - 1)] for p, n in zip(prompt, lens)]}
    decisions = sum(n - 1 for n in lens) * 2
    for tp, sp, dp in ((1, False, 1), (1, False, 2), (2, False, 2), (2, True, 1), (2, True, 2)):
        per_mb = len(seqs) // (dp * 2)
        assert agreement(samples, _records(samples, tp, sp, dp, per_mb, 2, 2), "forward_calls") == (decisions,
                                                                                                    decisions)
        flipped = _records(samples, tp, sp, dp, per_mb, 2, 2, flip=(3, 4))
        assert agreement(samples, flipped, "forward_calls") == (decisions - 2, decisions)
        d = logprob_diffs(samples, flipped, "logprobs_replay")
        assert d["max_abs"] == 0.0
    reps = _records(samples, 1, False, 2, 1, 2, 2)
    try:
        logprob_diffs(samples, reps[:1], "logprobs_replay")
    except RuntimeError as e:
        assert "2 of 4 sequences" in str(e)
    else:
        raise AssertionError("a missing rank's sequences went unnoticed")


def test_engine_shards_cover_the_full_tensors():
    g = torch.Generator().manual_seed(1)
    hd, nq, nkv, h, inter, ne = 4, 4, 2, 8, 6, 3
    p = "model.layers.0"
    hf = {f"{p}.self_attn.q_proj.weight": torch.randn(nq * hd, h, generator=g),
          f"{p}.self_attn.k_proj.weight": torch.randn(nkv * hd, h, generator=g),
          f"{p}.self_attn.v_proj.weight": torch.randn(nkv * hd, h, generator=g),
          f"{p}.self_attn.o_proj.weight": torch.randn(h, nq * hd, generator=g)}
    for e in range(ne):
        for n, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            hf[f"{p}.mlp.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g)
    kw = dict(num_experts=ne, kv_heads=nkv, head_dim=hd)
    tp1 = {n: engine_shard(hf, f"{p}.{n}", 1, 0, **kw) for n in ("self_attn.qkv_proj.weight",
                                                                   "mlp.experts.w13_weight", "mlp.experts.w2_weight")}
    q, k, v = (hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(tp1["self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert torch.equal(tp1["mlp.experts.w13_weight"][1, :inter], hf[f"{p}.mlp.experts.1.gate_proj.weight"])
    assert torch.equal(tp1["mlp.experts.w13_weight"][1, inter:], hf[f"{p}.mlp.experts.1.up_proj.weight"])
    # tp2: the ranks' parts put back together are the tp1 tensors
    r = [engine_shard(hf, f"{p}.self_attn.qkv_proj.weight", 2, i, **kw) for i in range(2)]
    assert torch.equal(torch.cat([r[0][:8], r[1][:8], r[0][8:12], r[1][8:12], r[0][12:], r[1][12:]]),
                       tp1["self_attn.qkv_proj.weight"])
    w13 = [engine_shard(hf, f"{p}.mlp.experts.w13_weight", 2, i, **kw) for i in range(2)]
    assert torch.equal(torch.cat([w13[0][:, :3], w13[1][:, :3], w13[0][:, 3:], w13[1][:, 3:]], 1),
                       tp1["mlp.experts.w13_weight"])
    w2 = [engine_shard(hf, f"{p}.mlp.experts.w2_weight", 2, i, **kw) for i in range(2)]
    assert torch.equal(torch.cat(w2, 2), tp1["mlp.experts.w2_weight"])
    o = [engine_shard(hf, f"{p}.self_attn.o_proj.weight", 2, i, **kw) for i in range(2)]
    assert torch.equal(torch.cat(o, 1), hf[f"{p}.self_attn.o_proj.weight"])
    # tp4 with 2 kv heads: each kv head on two ranks
    r = [engine_shard(hf, f"{p}.self_attn.qkv_proj.weight", 4, i, **kw) for i in range(4)]
    assert torch.equal(r[2][4:8], k[4:8]) and torch.equal(r[3][8:], v[4:8]) and torch.equal(r[1][4:8], k[:4])
    pad = [expert_layouts(hf, p, "mlp.experts.w2_weight", 2, i, ne)["padded"] for i in range(2)]
    assert torch.equal(pad[0], tp1["mlp.experts.w2_weight"]) and not pad[1].any()


def test_sync_profile_summaries(tmp_path):
    """--sync-profile's summaries: per-bucket medians over syncs (and per-sync phase totals), and the engine
    log's load lines counted with the reasons a layout was left to load_weights."""
    from _live_sync_worker import _medians
    from _engine_log import engine_load_lines

    from mrl.sglang.wire import REPLAYED_LOAD_MARK

    rows = [[{"bucket": 0, "path": "replayed", "fill_s": f, "issue_s": 1.0}, {"bucket": None, "settle_last_s": 2 * f}]
            for f in (1.0, 3.0, 2.0)]
    m = _medians(rows)
    assert m["syncs"] == 3 and m["per_bucket"][0]["fill_s"] == 2.0 and m["per_bucket"][0]["path"] == "replayed"
    assert m["per_sync_total_s"] == {"fill_s": 2.0, "issue_s": 1.0, "settle_last_s": 4.0}
    (tmp_path / "engine.log").write_text(
        f"x\n{REPLAYED_LOAD_MARK}: 3 copies\n{REPLAYED_LOAD_MARK}: 5 copies\n"
        "mrl: bucket layout loads through load_weights: the load computes on loaded data (aten.mul) at m.py:3\n")
    lines = engine_load_lines(str(tmp_path))
    assert lines["replayed_as_copies"] == 2 and lines["load_weights"] == 1
    assert lines["load_weights_reasons"] == ["the load computes on loaded data (aten.mul) at m.py:3"]


def test_fp8_checker_view_is_what_sglangs_weight_checker_hashes():
    """SGLang's /weights_checker reports a block-FP8 weight dequantized with its scales, and not the scales:
    the bitwise checks of FP8 engines compare that view (comparing e4m3 bytes could never match)."""
    from _engine_shards import fp8_checker_view
    from sglang.srt.utils.weight_checker import _postprocess_tensors

    from mrl.quant.fp8 import quantize_block_fp8

    name = "model.layers.0.mlp.experts.w2_weight"
    w = torch.randn(4, 256, 384, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = zip(*(quantize_block_fp8(e) for e in w))
    q, s = torch.stack(q), torch.stack(s)
    raw = {name: q, name.replace("weight", "weight_scale_inv"): s, "model.norm.weight": torch.ones(8)}
    reported = {n: t for n, compared, t in _postprocess_tensors(raw, set()) if compared}
    assert set(reported) == {name, "model.norm.weight"}  # the scales are left out
    view = fp8_checker_view(q, s)
    assert view.dtype == torch.bfloat16 and torch.equal(reported[name], view)
    assert not torch.equal(view, fp8_checker_view(q, s * 2))  # the scales are in the view
    assert (view.float() - w.float()).abs().max() < 0.1 * w.float().abs().max()


def _section_args(monkeypatch, workload, tmp_path, **args):
    """The rollout section's workload replaced by ``workload`` and its routes payload by a fixed one; the
    section's arguments (256 in flight, 2 repetitions unless ``args`` say otherwise)."""
    import types

    import _rollout_section as rollouts

    async def payload(url, codec, prompt_len, new, vocab):
        return {"bytes_per_token": 128.0, "bytes_per_expert_id": 1}

    monkeypatch.setattr(rollouts, "workload", workload)
    monkeypatch.setattr(rollouts, "routes_payload", payload)
    return types.SimpleNamespace(**({"batches": [256], "prompt_len": 4, "new": 4, "reps": 2, "out": str(tmp_path),
                                     "py_spy": 0, "engine_profile": 0} | args))


def test_rollout_section_drops_a_failing_variant_and_keeps_the_others(tmp_path, monkeypatch):
    """A compared engine (an FP8 kernel variant) failing its requests loses its kind, with the error in the
    report; the routes engine's kinds and a working variant keep their per-repetition ratios."""

    import _rollout_section as rollouts

    served = []

    async def workload(url, codec, batch, prompt_len, new, vocab, seed, timing=None, **kw):
        served.append((url, batch))
        if url == "http://bad" and batch > 8:  # passes its warm-up, fails the first timed request
            raise RuntimeError("engine died: CUDA error in the variant's MoE kernel")
        speed = {"http://routes": 1000.0, "http://good": 1250.0}.get(url, 900.0)
        return [], speed * (0.9 if codec is None else 1.0), 1.0, 0.0

    a = _section_args(monkeypatch, workload, tmp_path, batches=[16, 32], reps=3)
    res = rollouts.rollout_section({"routes": "http://routes", "good": "http://good", "bad": "http://bad"},
                                   object(), 64, a)
    assert res["kinds"] == ["off", "on", "good"]
    assert "engine died" in res["dropped"]["bad"]
    assert all(r["kind"] != "bad" for r in res["runs"])
    s = res["summary"]["batch32"]
    assert s["good_vs_on_median"] == 1.25 and len(s["good_vs_on_per_rep"]) == 3
    assert abs(s["on_vs_off_median"] - 1 / 0.9) < 1e-9
    assert "bad_median" not in s
    assert ("http://bad", 16) in served  # it was tried, then never again after it failed
    assert sum(u == "http://bad" for u, _ in served) == 2  # warm-up + the one failing request


def test_rollout_section_does_not_drop_the_routes_engine(tmp_path, monkeypatch):
    """The routes engine is the baseline of every ratio: its failure fails the section."""
    import types

    import _rollout_section as rollouts
    import pytest

    async def workload(url, codec, batch, prompt_len, new, vocab, seed, timing=None, **kw):
        raise RuntimeError("routes engine down")

    monkeypatch.setattr(rollouts, "workload", workload)
    a = types.SimpleNamespace(batches=[16], prompt_len=4, new=4, reps=1, out=str(tmp_path), py_spy=0,
                              engine_profile=0)
    with pytest.raises(RuntimeError, match="routes engine down"):
        rollouts.rollout_section({"routes": "http://routes", "good": "http://good"}, object(), 64, a)


def test_spy_summary_measures_how_long_the_scheduler_waits_for_the_gpu(tmp_path):
    """py-spy's raw output (collapsed stacks under the process frames, a count per stack) -> the share of
    the scheduler's samples blocked on the GPU's event, per process."""
    import _rollout_section as rollouts

    sched = 'process 10:"python3 -m sglang.launch_server";process 12:"sglang::scheduler";event_loop_overlap (s.py:1)'
    raw = tmp_path / "spy.txt"
    raw.write_text(
        f"{sched};process_batch_result (b.py:9);Event.synchronize (torch/cuda/streams.py:254) 30\n"
        f"{sched};run_batch (s.py:5);sampling_from_probs_torch (sampler.py:656) 50\n"
        f"{sched};recv_requests (s.py:7);Socket.recv_pyobj (zmq/sugar/socket.py:1033) 20\n"
        'process 10:"python3 -m sglang.launch_server";Runner.run (asyncio/runners.py:118) 40\n')
    s = rollouts.spy_summary(str(raw))
    sched_name = next(k for k in s if "scheduler" in k)
    assert s[sched_name]["samples"] == 100
    assert abs(rollouts.scheduler_gpu_wait(s) - 0.30) < 1e-12
    server = next(k for k in s if "scheduler" not in k)
    assert s[server]["waits_on_gpu"] == 0.0 and s[server]["samples"] == 40


def test_an_engine_variant_sets_the_attention_backend_once(tmp_path):
    """A start variant's attention backend replaces mrl's choice instead of adding a second flag; tuned
    fused-MoE tables go to the engine's own field."""
    import types

    import gpu_loop

    a = types.SimpleNamespace(routes_int32=False, load_weights=False, load_stream_off=False, sync_profile=False,
                              cpu=False, out=str(tmp_path), batches=[64, 256], replay_samples=32,
                              max_total_tokens=262144, mem_fraction=0.85, engine_tp=1, engine_env=["Y=0", "X=a=b"])
    e = gpu_loop._engine(a, str(tmp_path), "fi_engine", True, "0",
                         server_args={"attention_backend": "flashinfer", "moe_kernel_configs": str(tmp_path)})
    cmd = e.command()
    assert e.moe_kernel_configs == str(tmp_path) and not any("moe-kernel" in c for c in cmd)  # an env, not a flag
    assert cmd.count("--attention-backend") == 1
    assert cmd[cmd.index("--attention-backend") + 1] == "flashinfer"
    assert e.env["Y"] == "0" and e.env["X"] == "a=b"  # --engine-env: split at the first '='


def test_the_engines_get_the_bench_shim_and_the_baselines_asked_for(tmp_path):
    """Every engine the bench starts has its shim before mrl's on the path (CPU: before CPU mode's pyshim) and
    the environment it reads: the baselines of --routes-int32, --load-weights and --load-stream-off, the update
    figures of --sync-profile."""
    import types

    import gpu_loop

    from mrl.engine.cpu_mode import PYSHIM_DIR
    from mrl.engine.server.patches import SHIM_DIR

    a = types.SimpleNamespace(routes_int32=True, load_weights=False, load_stream_off=True, sync_profile=True,
                              cpu=False, out=str(tmp_path))
    env = gpu_loop.engine_shim_env(a, "/deep_gemm")
    path = env["PYTHONPATH"].split(":")
    assert path[0].endswith("bench/_engine_shim") and path[1:3] == ["/deep_gemm", SHIM_DIR]
    assert env["BENCH_BASELINE"] == "compact_routes,load_stream" and "BENCH_CPU_ENGINE" not in env
    assert env["BENCH_SYNC_STATS_DIR"] == os.path.join(str(tmp_path), "sync_profile")
    a.cpu, a.routes_int32, a.load_stream_off, a.sync_profile = True, False, False, False
    env = gpu_loop.engine_shim_env(a)
    assert env["PYTHONPATH"].split(":")[1] == PYSHIM_DIR and env["BENCH_CPU_ENGINE"] == "1"
    assert "BENCH_BASELINE" not in env and "BENCH_SYNC_STATS_DIR" not in env


def test_engine_profile_sums_kernels_by_what_they_compute(tmp_path):
    """A chrome trace as torch's profiler writes it (gzip): kernel time per category and per step, the GPU's
    busy share of the kernels' span, the top kernels; a CPU trace falls back to its operators."""
    import gzip
    import json

    from _engine_profile import kernel_category, summarize_trace

    assert kernel_category("fused_moe_kernel") == "moe"
    assert kernel_category("_fwd_kernel_stage1 decode_attention") == "attention"
    assert kernel_category("nvjet_tst_128x64_64x6") == "gemm"
    assert kernel_category("top_k_top_p_sampling_from_probs") == "sampling"
    assert kernel_category("rmsnorm_kernel") == "other"
    events = [
        {"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": 0.0, "dur": 400.0},
        {"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": 1000.0, "dur": 400.0},
        {"ph": "X", "cat": "kernel", "name": "decode_attention_fwd", "ts": 500.0, "dur": 200.0},
        {"ph": "X", "cat": "kernel", "name": "rmsnorm_kernel", "ts": 800.0, "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::matmul", "ts": 0.0, "dur": 5000.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10.0},
    ]
    path = tmp_path / "x-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(path), steps=2)
    assert s["events"] == "kernels" and s["count"] == 4
    assert s["ms_per_step"] == {"moe": 0.4, "attention": 0.1, "other": 0.05}
    assert abs(s["share"]["moe"] - 800 / 1100) < 1e-12
    assert abs(s["busy"] - 1100 / 1400) < 1e-12
    assert s["top"][0] == ("fused_moe_kernel", 0.4)
    cpu = tmp_path / "cpu.trace.json"
    cpu.write_text(json.dumps({"traceEvents": events[4:]}))
    c = summarize_trace(str(cpu), steps=1)
    assert c["events"] == "cpu_ops" and c["count"] == 1 and c["ms_per_step"] == {"gemm": 5.0}


# lines of a real SGLang 0.5.14 engine log (the 30B slice at 256 in flight on an H200)
_PREFILL = ("[2026-11-29 16:30:27] Prefill batch, #new-seq: 14, #new-token: 2989, #cached-token: 1531, token usage: "
            "0.00, #running-req: 241, #queue-req: 1, #pending-token: 284, cuda graph: True, input throughput "
            "(token/s): 233516.88")


def _decode(running: int, tps: float, queue: int = 0) -> str:
    return (f"[2026-11-29 16:30:27] Decode batch, #running-req: {running}, #token: 31800, token usage: 0.01, "
            f"cuda graph: True, gen throughput (token/s): {tps:.2f}, #queue-req: {queue}")


def test_full_batch_decode_keeps_only_lines_of_decode_alone(tmp_path):
    """A decode line counts when the line before it was a decode line (no prefill, no idle time before a
    run in its interval), the batch was at least 90% full and nothing waited; lines before the offset are
    another run's."""
    from _engine_log import full_batch_decode, log_size, stats_lines

    log = tmp_path / "engine.log"
    log.write_text("\n".join([_decode(256, 99999.0), _decode(256, 99999.0)]) + "\n")
    start = log_size(str(log))
    with open(log, "a") as f:
        f.write("\n".join([
            "[2026-11-29 16:30:26] INFO: 127.0.0.1 - \"POST /generate HTTP/1.1\" 200 OK",
            _PREFILL,
            _decode(255, 1898.43, queue=1),  # spans the prefills
            _decode(256, 40000.0),           # after a decode line, queue 1 before it: counts
            _PREFILL,
            _decode(256, 30000.0),           # spans a prefill
            _decode(256, 42000.0),
            _decode(256, 44000.0),
            _decode(200, 35000.0),           # the batch is draining
            _decode(256, 43000.0, queue=3),  # requests waiting
        ]) + "\n")
    lines = stats_lines(str(log), start)
    assert [r["kind"] for r in lines] == ["prefill", "decode", "decode", "prefill"] + ["decode"] * 5
    assert lines[0]["running"] == 241 and lines[0]["input_tokens_per_s"] == 233516.88
    assert lines[1] == {"kind": "decode", "running": 255.0, "gen_tokens_per_s": 1898.43, "queue": 1.0}
    full = full_batch_decode(lines, 256)
    assert full == {"tokens_per_s": 42000.0, "lines": 3}
    assert full_batch_decode(stats_lines(str(log)), 256)["lines"] == 4  # from the start: the earlier run's too
    assert full_batch_decode(lines[:3], 256) == {"tokens_per_s": 40000.0, "lines": 1}
    assert full_batch_decode(lines[:2], 256) == {"tokens_per_s": None, "lines": 0}
    assert stats_lines(str(tmp_path / "missing.log")) == [] and log_size(None) == 0


def test_rollout_section_reports_decode_alone_from_the_engines_logs(tmp_path, monkeypatch):
    """Each run reads the decode lines its engine logged during it; the compared kind's decode-alone ratio
    against the routes engine goes in the summary beside the whole-run ratio."""

    import _rollout_section as rollouts

    logs = {"routes": str(tmp_path / "engine.log"), "fp8": str(tmp_path / "fp8_engine.log")}
    decode = {"http://routes": 30000.0, "http://fp8": 39000.0}

    async def workload(url, codec, batch, prompt_len, new, vocab, seed, timing=None, **kw):
        with open(logs["fp8" if "fp8" in url else "routes"], "a") as f:  # the engine logging as it serves
            f.write("\n".join([_PREFILL] + [_decode(batch, decode[url] + seed)] * 3) + "\n")
        return [], {"http://routes": 1000.0, "http://fp8": 1200.0}[url], 1.0, 0.0

    a = _section_args(monkeypatch, workload, tmp_path)
    res = rollouts.rollout_section({"routes": "http://routes", "fp8": "http://fp8"}, object(), 64, a,
                                   logs=logs)
    runs = {(r["kind"], r["rep"]): r for r in res["runs"]}
    assert runs[("fp8", 1)]["engine_decode_tokens_per_s"] == 39001.0 and runs[("fp8", 1)]["engine_decode_lines"] == 2
    assert runs[("on", 0)]["engine_decode_tokens_per_s"] == 30000.0
    s = res["summary"]["batch256"]
    assert s["fp8_vs_on_median"] == 1.2
    assert s["fp8_decode_vs_on_per_rep"] == [1.3, 39001.0 / 30001.0]


def test_rollout_section_pairs_two_compared_kinds(tmp_path, monkeypatch):
    """--pair NUM:DEN: an FP8 engine against the bf16 engine with the same server args, per repetition and
    for decode alone; a pair with a dropped kind gives no ratio."""

    import _rollout_section as rollouts

    urls = {"routes": "http://routes", "fa3": "http://fa3", "fp8fa3": "http://fp8fa3", "bad": "http://bad"}
    logs = {k: str(tmp_path / f"{k}.log") for k in urls}
    speed = {"routes": 1000.0, "fa3": 1100.0, "fp8fa3": 1430.0}

    async def workload(url, codec, batch, prompt_len, new, vocab, seed, timing=None, **kw):
        kind = url.removeprefix("http://")
        if kind == "bad" and batch > 8:
            raise RuntimeError("engine died")
        with open(logs[kind], "a") as f:
            f.write("\n".join([_PREFILL] + [_decode(batch, 30 * speed.get(kind, 1.0))] * 3) + "\n")
        return [], speed.get(kind, 900.0), 1.0, 0.0

    a = _section_args(monkeypatch, workload, tmp_path, pair=["fp8fa3:fa3", "bad:fa3"])
    s = rollouts.rollout_section(urls, object(), 64, a, logs=logs)["summary"]["batch256"]
    assert s["fp8fa3_vs_fa3_median"] == 1.3 and len(s["fp8fa3_vs_fa3_per_rep"]) == 2
    assert abs(s["fp8fa3_decode_vs_fa3_median"] - 1.3) < 1e-12
    assert s["fp8fa3_vs_on_median"] == 1.43 and s["fa3_vs_on_median"] == 1.1
    assert not any(k.startswith("bad_") for k in s)


def test_gpu_loop_refuses_a_pair_of_unknown_kinds():
    import subprocess

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_loop.py")
    r = subprocess.run([sys.executable, bench, "--cpu", "--variant", "fa3np={}", "--pair", "fp8fa3np:fa3np",
                        "--out", "/nonexistent/never"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "--pair 'fp8fa3np:fa3np'" in r.stderr and "'fa3np'" in r.stderr


@pytest.mark.parametrize("samples", ["20", "8"])
def test_gpu_loop_refuses_a_stream_of_partial_groups_or_below_the_batch(samples):
    import subprocess

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_loop.py")
    r = subprocess.run([sys.executable, bench, "--cpu", "--batches", "16", "--samples", samples,
                        "--out", "/nonexistent/never"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"--samples {samples}: give a multiple of 8" in r.stderr, r.stderr


def test_a_compared_engine_slower_to_start_than_the_timeout_is_dropped():
    import gpu_loop

    class Slow:
        stopped = False

        def wait_healthy(self, timeout):
            raise TimeoutError(f"not healthy after {timeout} s")

        def stop(self):
            self.stopped = True

    slow, report = Slow(), {}
    engines = {"routes": object(), "fp8dg": slow}
    assert gpu_loop._start_or_drop(engines, "fp8dg", report, 7.0) is None
    assert "fp8dg" not in engines and slow.stopped
    assert "not healthy after 7.0 s" in report["fp8dg_engine_error"]
    with pytest.raises(TimeoutError):  # without the routes engine the run has nothing to compare with
        gpu_loop._start_or_drop({"routes": Slow()}, "routes", {}, 7.0)


def test_request_timing_splits_a_run_between_client_http_and_engine():
    import _rollout_section as rollouts
    # three requests posted at 0.0-0.2 s of a run that started at 10.0 and ended at 13.0; SGLang's
    # e2e_latency covers each from its arrival at the tokenizer manager to its last token
    calls = [(10.0, 12.5, 2.3), (10.1, 12.6, 2.2), (10.2, 12.8, 2.0)]
    t = rollouts.request_timing(calls, 10.0, 13.0)
    assert t["requests"] == 3 and abs(t["last_post_s"] - 0.2) < 1e-9
    assert abs(t["first_answer_s"] - 2.5) < 1e-9 and abs(t["last_answer_s"] - 2.8) < 1e-9
    assert abs(t["after_last_answer_s"] - 0.2) < 1e-9
    assert t["engine_e2e_max_s"] == 2.3 and abs(t["engine_e2e_median_s"] - 2.2) < 1e-9
    assert abs(t["outside_engine_median_s"] - 0.3) < 1e-9 and abs(t["outside_engine_max_s"] - 0.6) < 1e-9
    # arrivals (answer - e2e): 0.2, 0.4, 0.8 s into the run
    assert abs(t["engine_first_arrival_s"] - 0.2) < 1e-9 and abs(t["engine_arrival_spread_s"] - 0.6) < 1e-9
    # an engine that does not report e2e_latency: the client's side only
    only = rollouts.request_timing([(10.0, 11.0, None)], 10.0, 11.5)
    assert "engine_e2e_median_s" not in only and abs(only["after_last_answer_s"] - 0.5) < 1e-9
    assert rollouts.request_timing([], 0.0, 1.0) == {}


def test_timing_medians_give_each_kind_its_seconds_outside_full_batch_decode():
    import _rollout_section as rollouts
    runs = [{"batch": 256, "kind": "on", "seconds": 4.0, "tokens_per_s": 1000.0, "engine_decode_tokens_per_s": 1250.0,
             "requests": {"requests": 256, "last_post_s": 0.1}},
            {"batch": 256, "kind": "on", "seconds": 5.0, "tokens_per_s": 800.0, "engine_decode_tokens_per_s": 1000.0,
             "requests": {"requests": 256, "last_post_s": 0.3}},
            {"batch": 256, "kind": "fp8", "seconds": 3.0, "tokens_per_s": 1000.0, "engine_decode_tokens_per_s": None,
             "requests": {}}]
    m = rollouts.timing_medians(runs, 256, ["on", "fp8"])
    # 4000 tokens at 1250/s decode = 3.2 s of a 4.0 s run; 4000 at 1000/s = 4.0 s of 5.0 s
    assert abs(m["on"]["outside_full_batch_decode_s"] - 0.9) < 1e-9 and abs(m["on"]["last_post_s"] - 0.2) < 1e-9
    assert m["fp8"] == {}


def test_a_stream_workload_refills_the_batch_and_draws_unequal_lengths():
    """--samples beyond the batch: the run keeps ``batch`` requests in flight and posts the next one when a
    sample finishes (so posts go on after the first answers), each sample's new tokens drawn from the
    spread, the same draws for the same repetition; the whole batch at once posts everything first."""
    import asyncio

    import _rollout_section as rollouts

    from tests.fakes.fake_sglang import FakeSGLang

    with FakeSGLang() as srv:
        def run(samples, seed):
            timing: dict = {}
            out, tps, dt, _ = asyncio.run(rollouts.workload(srv.url, None, 8, 4, 20, 512, seed=seed, timing=timing,
                                                            samples=samples, spread=0.5))
            return [len(s.response_ids) for s in out], timing, tps, dt

        lengths, timing, tps, dt = run(32, seed=3)
        assert len(lengths) == 32 and timing["requests"] == 32
        assert all(10 <= n <= 30 for n in lengths) and len(set(lengths)) > 3
        assert timing["last_post_s"] > timing["first_answer_s"]  # a stream: refilled as samples finished
        assert tps == sum(lengths) / dt
        assert run(32, seed=3)[0] == lengths and run(32, seed=4)[0] != lengths
        _, once, _, _ = run(None, seed=3)
        assert once["requests"] == 8 and once["last_post_s"] < once["first_answer_s"]


def test_rollout_section_without_routes_off_runs(tmp_path, monkeypatch):
    """--skip-off: no routes-off runs and no on/off figures; the compared kinds keep their ratios to on,
    and the section passes --samples and --new-spread to every timed run."""

    import _rollout_section as rollouts

    seen = []

    async def workload(url, codec, batch, prompt_len, new, vocab, seed, timing=None, samples=None, spread=0.0):
        seen.append((url, codec is not None, samples, spread))
        return [], {"http://routes": 1000.0, "http://fp8": 1300.0}[url], 1.0, 0.0

    a = _section_args(monkeypatch, workload, tmp_path, skip_off=True, samples=1024, new_spread=0.5)
    res = rollouts.rollout_section({"routes": "http://routes", "fp8": "http://fp8"}, object(), 64, a)
    assert res["kinds"] == ["on", "fp8"] and res["samples"] == 1024
    assert {r["kind"] for r in res["runs"]} == {"on", "fp8"}
    s = res["summary"]["batch256"]
    assert "on_vs_off_median" not in s and "routes_off_median" not in s
    assert s["fp8_vs_on_median"] == 1.3 and s["routes_on_median"] == 1000.0
    timed = [x for x in seen if x[2] is not None]
    assert len(timed) == 4 and all(x[1] and x[3] == 0.5 for x in timed)  # routes requested in every run
