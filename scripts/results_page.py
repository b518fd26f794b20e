"""Write docs/results.md from the benchmark reports' JSON (bench/reports/<topic>/*.json): the goals with the
figure that decides each one, then per topic every report with its date, hardware, commit and headline figures.

    python scripts/results_page.py            # rewrite docs/results.md
    python scripts/results_page.py --check    # exit 1 if docs/results.md is not what the reports give

Standard library only. Reports have several schemas (each bench wrote its own, some were written by hand):
one extractor per bench kind (the JSON's ``bench`` field, or the shape of a report that has none) pulls the
figures that matter; a report no extractor knows is listed with its date and no figures. A topic's
``findings.md`` (bench/reports/<topic>/, written by hand: what the runs show, each figure linking its report)
follows its table: the docs/ pages say how things work and link here for every figure.
tests/unit/test_results_page.py regenerates the page and compares it with the committed one.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = os.path.join(ROOT, "bench", "reports")
PAGE = os.path.join(ROOT, "docs", "results.md")

TOPICS = {  # folder -> (title, what its reports measure)
    "loop": ("The whole loop", "`mrl train` against its own ceilings (`bench/loop_e2e.py`), the GPU loop's pieces "
             "(`bench/gpu_loop.py`), overlap against sync mode (`bench/async_vs_sync.py`)."),
    "rl_step": ("The RL step", "`Policy.rl_step` against plain megatron-core's own training step "
                "(`bench/rl_step_vs_megatron.py`) and against bare forward/backward (`bench/rl_step_vs_bare.py`); "
                "the trainer's host costs (`bench/micro_batches.py`, `bench/gc_pause.py`, "
                "`bench/batch_delivery.py`)."),
    "rollouts": ("Rollouts", "Generation through mrl's client and manager with routes returned and without "
                 "(`bench/gpu_loop.py --sections rollout`, `bench/rollout_throughput.py`), the client's route "
                 "decoding (`bench/routes_decode.py`)."),
    "weight_sync": ("Weight sync", "mrl's sync against a raw broadcast of the same bytes "
                    "(`bench/weight_sync_bench.py`), into a live engine (`bench/gpu_loop.py --sections sync`), "
                    "LoRA adapters against full weights (`bench/lora_sync.py`)."),
    "keep_routing": ("Keep Routing", "Engine vs trainer routing with replay off and on, its train-step overhead "
                     "(`bench/replay_overhead.py`, `bench/routing_mismatch.py`, `bench/gpu_loop.py --sections "
                     "replay`), the mismatch split."),
    "fp8": ("FP8 rollouts", "Block-FP8 engines against bf16 ones on the same workload and Keep Routing against "
            "an FP8 engine (`bench/gpu_loop.py --fp8-engine-gpu`), the block-FP8 quantizer's triton kernel "
            "against its torch path (`tests/gpu/fp8_quant.sh`)."),
    "learning": ("Learning runs", "`mrl train` runs to the end: reward and held-out accuracy, step and sync time."),
    "parity": ("Parity", "HF <-> Megatron logits on GPUs (`tests/gpu/parity.sh`)."),
    "checkpoints": ("Checkpoints", "Host memory and seconds of a trainer checkpoint save per optimizer format "
                    "(`bench/checkpoint_save.py`); `mrl export` of a trainer checkpoint as a whole process, against "
                    "a synced copy of the same bytes (`bench/export_time.py`)."),
    "image": ("Container image", "The CPU image built by `make image` (size, build time, versions) and `mrl train` "
              "inside it (`bench/image_build.py`)."),
}


# -- reading ---------------------------------------------------------------------------------------

def get(d, path, default=None):
    """``d["a"]["b"]`` for ``path="a.b"``; ``default`` where any part is missing."""
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def meta(d: dict, fname: str) -> tuple[str, str, str]:
    """(date, hardware, commit) of a report, each as recorded; the date falls back to the file name's."""
    env = d.get("environment") if isinstance(d.get("environment"), dict) else {}
    date = str(env.get("date") or d.get("date") or fname[:10])[:10]
    hw = env.get("device") or d.get("device") or d.get("hardware") or d.get("machine")
    if not hw and env.get("gpus"):
        hw = f"{len(env['gpus'])}x {env['gpus'][0]}"
    hw = str(hw) if hw else ""
    hw = re.split(r" \(|, |; ", hw)[0].strip() if hw else ""
    if hw == "CPU":  # the benches' own "CPU (gloo)"
        hw = f"CPU, {env.get('cpu_cores') or '?'} cores"
    if not hw:
        m = re.search(r"_(\d+)x(H\d+)", fname)
        hw = f"{m.group(1)}x {m.group(2)}" if m else ("CPU" if "cpu" in fname else "not recorded")
    m = re.search(r"\b[0-9a-f]{7,40}\b", str(env.get("mrl_commit") or d.get("mrl_commit") or d.get("mrl_commit_note")
                                             or ""))
    if not m:  # a report written by hand may name the commit it ran in its note
        m = re.search(r"(?:at commit|, commit|tree of commit) ([0-9a-f]{7,40})\b", str(d.get("note") or ""))
    return date, hw, m.group(m.lastindex or 0)[:7] if m else "not recorded"


def kind(d: dict, fname: str) -> str:
    """Which extractor reads this report."""
    b = d.get("bench")
    if isinstance(b, str) and b:
        if b.startswith("mrl_train"):
            return "mrl_train"
        if b.startswith("gpu_loop rollout"):
            return "routes_wire"
        return b
    if "overlap_over_sync" in d:
        return "async_vs_sync"
    if "rows" in d and "requests" in d and "transport" in d and "summary" in d:
        return "weight_sync_inflight"
    if "rows" in d and "scale" in d:
        return "weight_sync"
    if "parity" in fname:
        return "parity"
    if "reward" in d and "step_seconds" in d:
        return "mrl_train_summary"
    if "sides" in d and "rounds" in d:
        return "default_run"
    if "minibatch" in fname and "runs" in d and "summary" in d:
        return "minibatch"
    if "recipe" in fname and "runs" in d and "summary" in d:
        return "recipe"
    return "unknown"


# -- figures per bench kind ------------------------------------------------------------------------

def k(x: float) -> str:
    return f"{x / 1000:.1f}k"


def rl_step_vs_megatron(d):
    ctx = ", ".join(f"{n} {d[n]}" for n in ("grouped_gemm", "gc") if d.get(n) not in (None, "auto"))
    if "micro_batches" in d:
        head = f"{d['shape']}, {d['micro_batches']}x{d.get('micro_batch_size', 1)} rows of {d['seq']} tokens"
    else:
        head = f"{d['shape']}, {d['tokens_per_step']} tokens a step"
    head += f", {ctx}" if ctx else ""
    layouts = d.get("layouts") or ({d["layout"]: d} if "layout" in d else {})
    out = [head]
    for name, row in layouts.items():
        m, g = row["mrl"], row["megatron"]
        stat = row.get("mrl_vs_megatron_pairs")
        if stat:  # the fixed statistic: median of per-step ABBA pair ratios
            spread = (f"median of {stat['n_pairs']} ABBA pairs, p25-p75 {stat['p25']:.2f}-{stat['p75']:.2f}; "
                      f"pooled medians {row['mrl_vs_megatron_pooled_medians']:.2f}")
        else:  # older reports: pooled medians, and each process pair's medians
            spread = "pairs " + ", ".join(f"{p:.2f}" for p in row.get("mrl_vs_megatron_per_pair") or [])
        line = (f"**{name}: mrl/megatron {row['mrl_vs_megatron']:.2f}** ({spread}); "
                f"mrl {k(m['tokens_per_s_per_gpu'])} tokens/s/GPU, megatron {k(g['tokens_per_s_per_gpu'])}")
        if m.get("model_tflops_per_gpu", 0) >= 1:  # not on CPU
            line += (f"; model TFLOP/s per GPU mrl {m['model_tflops_per_gpu']:.1f}, "
                     f"megatron {g['model_tflops_per_gpu']:.1f}")
        out.append(line)
    return out


def rl_step_vs_bare(d):
    return [f"{n}: rl_step / bare forward+backward {row['rl_step_vs_bare_fb']:.2f} "
            f"(rl_step {k(row['tokens_per_s']['rl_step'])} tokens/s)" for n, row in d["layouts"].items()]


def loop_e2e(d):
    loop = d.get("loop", {})
    ttfs = d.get("time_to_first_step_s")
    ttfs = f"{ttfs:.0f} s" if ttfs is not None else (
        f"about {d['time_to_first_step_estimate_s']} s (estimated)" if d.get("time_to_first_step_estimate_s") else "-")
    if d.get("loop_vs_ceiling") is None:  # a run whose ceilings were not measured: the loop alone
        out = [f"loop {k(d['loop_tokens_per_s'])} tokens/s ({k(d['loop_tokens_per_s_per_gpu'])} per GPU), "
               f"ceilings not measured"]
    else:
        out = [f"**loop_vs_ceiling {d['loop_vs_ceiling']:.2f}** ({d.get('bound_by')}-bound); loop "
               f"{k(d['loop_tokens_per_s'])} tokens/s ({k(d['loop_tokens_per_s_per_gpu'])} per GPU), trainer "
               f"ceiling {k(d['trainer_ceiling_tokens_per_s'])}, engine ceiling {k(d['engine_ceiling_tokens_per_s'])}"]
    if loop.get("sync_share_of_step") is not None:
        out.append(f"sync {100 * loop['sync_share_of_step']:.1f}% of a step; time to first step {ttfs}")
    if d.get("routes_on_vs_plain") is not None:
        out.append(f"routes on vs a plain engine {d['routes_on_vs_plain']:.3f} (full 48-layer model, batch 256)")
    for c in loop.get("checkpoint_saves") or []:
        out.append(f"checkpoint step_{c['step']}: {c['gib']:.3g} GiB saved in {c['seconds']:.3g} s")
    return out


def _rollout(r):
    out = []
    for b, s in sorted((r.get("summary") or {}).items(), key=lambda kv: int(kv[0][5:])):
        if "on_vs_off_median" in s:
            line = (f"{b}: routes on/off {s['on_vs_off_median']:.2f} ({s['on_vs_off_min']:.2f}-"
                    f"{s['on_vs_off_max']:.2f}), {k(s['routes_on_median'])} / {k(s['routes_off_median'])} tokens/s")
        else:  # a run without routes-off kinds (--skip-off)
            line = f"{b}: routes on {k(s['routes_on_median'])} tokens/s"
        if r.get("samples"):
            line += f" ({r['samples']} samples a run, a stream)"
        elif r.get("new") not in (None, 512):
            line += f" ({r['new']} new tokens a sample)"
        if s.get("routes_on_vs_plain_median") is not None:
            line += f"; on vs plain engine {s['routes_on_vs_plain_median']:.2f}"
        for kind in (x for x in r.get("kinds") or [] if x not in ("off", "on", "plain")):  # other engines, routes on
            if f"{kind}_vs_on_median" in s:
                line += (f"; **{kind} / on {s[f'{kind}_vs_on_median']:.2f}** ({s[f'{kind}_vs_on_min']:.2f}-"
                         f"{s[f'{kind}_vs_on_max']:.2f})")
                if f"{kind}_decode_vs_on_median" in s:
                    line += f", decode alone {s[f'{kind}_decode_vs_on_median']:.2f}"
        for pair in r.get("pairs") or []:  # two compared engines against each other
            num, den = pair.split(":")
            if f"{num}_vs_{den}_median" in s:
                line += f"; **{num} / {den} {s[f'{num}_vs_{den}_median']:.2f}**"
                if f"{num}_decode_vs_{den}_median" in s:
                    line += f", decode alone {s[f'{num}_decode_vs_{den}_median']:.2f}"
        out.append(line)
    if get(r, "payload.bytes_per_token"):
        out.append(f"routes {get(r, 'payload.bytes_per_token'):.0f} base64 bytes/token")
    if r.get("scheduler_waits_on_gpu"):
        out.append("engine scheduler waiting for the GPU (py-spy): " + ", ".join(
            f"{key.partition('_')[2]} {v:.2f}" for key, v in r["scheduler_waits_on_gpu"].items() if v is not None))
    return out


def _sync(s):
    if not isinstance(s, dict) or "sync_median_s" not in s:
        return []
    where = f" (trainer ranks {s['trainer_ranks']}, engine TP {s['engine_tp']})" if "engine_tp" in s else ""
    raw = "a device copy of the bytes (CUDA IPC, one GPU)" if s.get("transport") == "tensor" else "a raw broadcast"
    out = [f"sync {s['sync_median_s']:.3f} s for {s['bytes'] / 1e9:.2f} GB, **{s['sync_vs_raw']:.1f}x {raw}**{where}"]
    f = s.get("fp8")
    if isinstance(f, dict) and "sync_median_s" in f:
        out.append(f"FP8 sync {f['sync_median_s']:.3f} s for {f['bytes'] / 1e9:.2f} GB: **{f['fp8_vs_bf16_sync']:.2f}x "
                   f"the bf16 sync** ({f['fp8_vs_bf16_sync_min']:.2f}-{f['fp8_vs_bf16_sync_max']:.2f})")
    return out


def _replay(r):
    if not isinstance(r, dict) or "route_agreement_replay_on" not in r:
        return []
    return [f"route agreement off {r['route_agreement_replay_off']:.3f}, **on {r['route_agreement_replay_on']:.3f}** "
            f"({r['decisions']} decisions); mean |dlogp| {get(r, 'logprob_diff_replay_off.mean_abs'):.4f} -> "
            f"{get(r, 'logprob_diff_replay_on.mean_abs'):.4f}"]


def gpu_loop(d):
    if d.get("section") == "sync" and "sync" in d:  # batched vs per-bucket requests, written by hand
        return [f"{d['bytes'] / 1e9:.2f} GB: sync {d['sync']['median']:.3f} s, **{d['sync_vs_raw']:.1f}x raw** "
                f"(all buckets in one request); {d['per_bucket_sync']['median']:.3f} s, "
                f"{d['per_bucket_sync_vs_raw']:.1f}x with one request per bucket"]
    runs = d.get("runs")
    if isinstance(runs, dict) and runs and all(get(v, "bench") == "gpu_loop" for v in runs.values()):
        return [x for run in runs.values() for x in gpu_loop(run)]  # several runs in one report
    out = []
    if "model" in d and "layers" in d:
        out.append(f"{d['model']}, {d['layers']} layers")
    out += _rollout(d.get("rollout") or {}) + _replay(d.get("replay")) + _sync(d.get("sync"))
    out += [f"FP8 engine: {x}" for x in _replay(d.get("replay_fp8"))]
    starts = {k[:-len("engine_start_s")].rstrip("_") or "default": v for k, v in d.items()
              if k.endswith("engine_start_s")}
    if d.get("variant") == "engine_start":
        cold = d["cold_start_default_engine"]
        out.append("engine start, warm caches: " + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(starts.items()))
                   + f"; cold (fresh host) {cold['start_s']:.0f} s, of which prefill graphs "
                   f"{cold['prefill_graph_capture_s']:.0f} s")
    if "sync_vs_raw_load_weights" in d:  # the session's summary
        out.append(f"sync/raw: replayed load {d['sync_vs_raw']:.1f}x, SGLang's per-tensor load "
                   f"{d['sync_vs_raw_load_weights']:.1f}x, TP2 -> TP2 {d['sync_vs_raw_reshard_tp2_to_tp2']:.1f}x")
    for name in ("rollout", "replay", "sync"):
        if isinstance(d.get(name), dict) and "error" in d[name]:
            out.append(f"{name}: failed ({d[name]['error'][:80]})")
    return out


def moe_kernel_tune(d):
    out = []
    for dtype, table in sorted((get(d, "tuning.tables") or {}).items()):
        rows = sorted(table["timings"].items(), key=lambda kv: int(kv[0]))
        out.append(f"{dtype} fused MoE a layer: " + ", ".join(
            f"{m} tokens {t['best_s'] * 1e6:.0f} us (SGLang's choice {t['sglang_over_tuned']:.2f}x)" for m, t in rows))
    for m in ("64", "256", "1024"):
        if f"fp8_vs_bf16_moe_kernel_{m}" in d:
            out.append(f"**FP8 kernel / bf16 at {m} tokens {d[f'fp8_vs_bf16_moe_kernel_{m}']:.2f}x**")
    return out


def logprob_kernel(d):
    m, peak = d["median_s"], d["peak_gib_over_logits"]
    return [f"{'x'.join(map(str, d['shape']))} bf16 logits, forward + backward: **TE fused {m['fused'] * 1e3:.2f} ms, "
            f"fp32 path {m['fp32'] * 1e3:.2f} ms ({d['fp32_vs_fused_time']:.1f}x)**",
            f"memory over the logits: fused {peak['fused']:.3f} GiB, fp32 {peak['fp32']:.1f} GiB",
            f"max |logprob diff| {d['lp_max_abs_diff']:.1e}, max |grad diff| {d['grad_max_abs_diff']:.1e}"]


def fp8_quant(d):
    cases = d.get("cases", {})
    equal = sum(c["codes_equal"] and c["scales_equal"] for c in cases.values())
    big = max(cases.values(), key=lambda c: c["bytes_in"], default=None)
    out = [f"triton kernel vs torch path: **{equal}/{len(cases)} shapes bit-equal** (codes and scales)"]
    if big:
        out.append(f"largest ({big['shape']}): triton {big['triton_s'] * 1e3:.2f} ms, "
                   f"torch {big['torch_s'] * 1e3:.2f} ms")
    return out


def fp8_sync_check(d):
    bit = d.get("bitwise", {})
    return [f"FP8 sync ({d['sync']['transport']}): **{sum(bit.values())}/{len(bit)} engine tensors equal** the "
            f"trainer's quantization as the weight checker reports them; probe logprobs "
            f"{'within' if d.get('probe_ok') else '**outside**'} tolerance (max diff "
            f"{d['probe_max_abs_diff_vs_dequantized']:.3f} against the dequantized weights)"]


def fused_replay_check(d):
    res = d.get("results", {})
    worst = max((r["probs_max_abs"] for r in res.values()), default=float("nan"))
    return [f"TE's fused router in replay vs megatron's replay path: **{sum(r['ok'] for r in res.values())}/"
            f"{len(res)} cases equal** within tolerance (probabilities max diff {worst:.1e}, gradients "
            f"{max((max(r['grad_input_max_abs'], r['grad_weight_max_abs']) for r in res.values()), default=0):.1e})"]


def checkpoint_save(d):
    out = []
    for fmt, s in d["summary"].items():
        lo, hi = s["peak_extra_gib_min_max"]
        out.append(f"{fmt}: **+{s['peak_extra_gib']:.2f} GiB** host memory during the save ({lo:.2f}-{hi:.2f}; "
                   f"{s['peak_extra_gib'] * 2**30 / d['params_per_rank']:.1f} bytes per parameter of a rank), "
                   f"{s['save_s']:.1f} s" + (f" waited for, complete after {s['written_s']:.1f} s"
                                             if fmt.endswith("_async") else "")
                   + f", {s['checkpoint_gib']:.2f} GiB on disk")
    return out


def export_time(d):
    w, t = d["export_wall_s"], d["trainer"]
    out = [f"`mrl export` of {d['model']['shape']} ({d['model']['layers']} layers, {d['export_gb']:.3g} GB): "
           f"**{w['median']:.1f} s** wall, process start to exit (median of {len(d['reps'])}, {w['min']:.1f}-"
           f"{w['max']:.1f}; {d['export_gb_per_s_median']:.3g} GB/s; {d['cache']} page cache)"]
    if d.get("export_vs_copy_median"):
        out.append(f"{d['export_vs_copy_median']:.2f}x a synced copy of the same bytes "
                   f"({d['copy_baseline_s']['median']:.1f} s)")
    same = "bit for bit" if d["round_trip_bitwise"] else "**differs**"
    out.append(f"round trip HF -> trainer checkpoint -> export: {same}; checkpoint "
               f"{t['checkpoint_bytes'] / 1e9:.3g} GB, Adam's states: {t['optimizer_state']}")
    return out


def recipe(d):
    """``bench/recipe_run.py``: per run, held-out pass@1 after the warm start and at the end, pass@k, reward."""
    out = []
    for r in d["runs"]:
        first, last = r["pass_at_k"][0], r["pass_at_k"][-1]
        ks = sorted((k for k in last if k.startswith("pass_at_") and k != "pass_at_1"), key=lambda k: int(k[8:]))
        more = "".join(f", {k.replace('_at_', '@')} {first[k]:.2f} -> {last[k]:.2f}" for k in ks)
        greedy = r.get("heldout_greedy_pass_at_1_start")
        out.append(f"+experiment={d['recipe']} {r['variant']} seed {r['seed']}: held-out pass@1 "
                   f"{r['heldout_pass_at_1_start']:.2f} -> **{r['heldout_pass_at_1_end']:.2f}** (warm start -> "
                   f"step {last['step']}){more}"
                   + (f", greedy {greedy:.2f} -> {r['heldout_greedy_pass_at_1_end']:.2f}" if greedy is not None else "")
                   + f"; reward {r['reward_first10']:.2f} -> {r['reward_last10']:.2f} (first/last 10 steps); "
                   f"{r['wall_seconds'] / 60:.1f} min, step {r['median_step_seconds']:.2f} s")
    return out


def opd_learning(d):
    """``bench/opd_run.py``: steps to the GRPO run's final held-out pass@1, OPD against GRPO, per seed."""
    t = d["teacher"]
    teacher = (f"teacher: held-out pass@1 {t['heldout_pass_at_1_end']:.2f} after {t['rl_steps']} RL steps"
               if "heldout_pass_at_1_end" in t else f"teacher {t['hf_path']}")
    opd, grpo = d["opd_steps_to_target"], d["grpo_steps_to_target"]
    out = [f"+experiment={d['recipe']}, {d['steps']} RL steps, seeds {', '.join(map(str, d['seeds']))}; {teacher}; "
           f"OPD overrides {' '.join(d['opd_overrides'])}",
           f"**steps to the GRPO run's final held-out pass@1: OPD {'never' if opd is None else f'{opd:g}'}, GRPO "
           f"{'never' if grpo is None else f'{grpo:g}'}** (target {d['target_heldout_pass_at_1']:.3f}, median over "
           f"seeds)"]
    for name, s in d["summary"].items():
        per_seed = zip(s["seeds"], s["heldout_pass_at_1_start"], s["heldout_pass_at_1_end"], s["steps_to_target"])
        runs = ", ".join(f"s{seed} {a:.2f} -> {b:.2f} ({'never' if n is None else f'step {n}'})"
                         for seed, a, b, n in per_seed)
        out.append(f"{name}: held-out pass@1 {runs}; step {statistics.median(s['median_step_seconds']):.2f} s")
    return out


def opd_cost(d):
    """``bench/opd_cost.py``: the teacher's prefill against the student's rollouts, the loop with OPD over without."""
    out = []
    if "engines" in d:
        e, sh = d["engines"]["summary"], d["engines"]["shape"]
        med = {k: v["median"] for k, v in e.items()}
        out.append(f"one teacher engine scores **{med['teacher_scored_over_rollout']:.1f}x** the tokens/s one "
                   f"student engine samples ({med['teacher_scored_tokens_per_s']:.0f} vs "
                   f"{med['rollout_tokens_per_s']:.0f}; prefill {med['teacher_prefill_tokens_per_s']:.0f} tokens/s), "
                   f"{sh['prompts']}x{sh['n']} samples of {sh['new_tokens']} tokens, "
                   f"{len(d['engines']['rounds'])} rounds")
    if "loop" in d:
        lp = d["loop"]
        out.append(f"loop trained tokens/s with scoring=opd / without: **{lp['loop_with_scoring_vs_without']:.2f}** "
                   f"(median of {lp['n_pairs']} paired window ratios, p25-p75 {lp['ratios']['p25']:.2f}-"
                   f"{lp['ratios']['p75']:.2f}; {lp['tokens_per_s']['with_opd']['median']:.0f} vs "
                   f"{lp['tokens_per_s']['without']['median']:.0f} tokens/s)")
    return out


def minibatch(d):
    """``bench/recipe_run.py --target``: per setting, the steps (and loop seconds) until the training reward's
    trailing mean reaches the target, and the trainer's clip fractions over every step."""
    t = d["target"]
    out = [f"target: reward's trailing mean over {t['window_steps']} steps >= {t['reward_trailing_mean']:g}"]
    for name, s in d["summary"].items():
        steps = ", ".join("-" if x is None else str(x) for x in s["steps_to_target"])
        med, sec = s["steps_to_target_median"], s["seconds_to_target_median"]
        hi, lo = s["clip_frac_high_pooled"], s["clip_frac_low_pooled"]
        out.append(f"{name} ({', '.join(d['runs'][[r['variant'] for r in d['runs']].index(name)]['overrides'])}): "
                   f"steps to target {steps} (median **{'not reached' if med is None else f'{med:g}'}**"
                   + ("" if sec is None else f", {sec:.0f} s") + f"); clip_frac_high median {hi['median']:.3g}, "
                   f"mean {hi['mean']:.3g}, low mean {lo['mean']:.3g} ({100 * (lo['nonzero_steps'] or 0):.0f}% of "
                   f"steps clip low); held-out {statistics.median(s['heldout_pass_at_1_start']):.2f} -> "
                   f"{statistics.median(s['heldout_pass_at_1_end']):.2f} (medians)")
    return out


def learn_compare(d):
    out = []
    for run, r in d["summary"].items():
        kl = (r.get("mismatch/numerics_kl") or {}).get("median")
        sync = (r.get("sync_seconds") or {}).get("median")
        out.append(f"{run}: reward {r['reward_first10_mean']:.2f} -> **{r['reward_last10_mean']:.2f}** (first/last 10 "
                   f"steps), held out {r['eval_accuracy_first']} -> {r['eval_accuracy_final']}"
                   + (f", numerics KL {kl:.1e}" if kl is not None else "") + (f", sync {sync:.3f} s" if sync else ""))
    return out


def trainer_start(d):
    st = d["trainer_start_s"]
    return [f"trainer ready {st['policy_ready']:.0f} s after its start (imports {st['trainer_imported']:.0f} s), "
            f"first rl_step {d['first_rl_step_s']:.1f} s, then {d['steady_rl_step_median_s']:.1f} s; "
            f"{k(d['trainer_ceiling_tokens_per_s'])} tokens/s"]


def routes_wire(d):
    s = d.get("summary", {})
    return [f"int32 ids: batch 256 routes on/off {s['int32_batch256_on_vs_off_median']:.2f}, batch 64 "
            f"{s['int32_batch64_on_vs_off_median']:.2f}"]


def routes_decode(d):
    return [f"{shape}: {s['before_mrl_uint8_ms']:.2f} -> **{s['after_mrl_uint8_ms']:.2f} ms** per reply "
            f"(SGLang's own int32 reader {s['sglang_int32_ms']:.2f} ms)" for shape, s in d["summary"].items()]


def rollout_throughput(d):
    return [f"{key}: {v}" for key, v in d.items() if key.endswith("tokens_per_s") and isinstance(v, (int, float))]


def ws_ratio(r) -> float:
    """sync / raw of a weight_sync_bench row: the median of the per-repetition ratios (each sync is followed by
    its raw broadcast), or the ratio of the medians where the repetitions are not kept."""
    if r.get("all_sync_s") and r.get("all_raw_s"):
        return statistics.median(s / w for s, w in zip(r["all_sync_s"], r["all_raw_s"]))
    return r["sync_median_s"] / r["raw_median_s"]


def weight_sync(d):
    out = [f"{d.get('model')}, receivers: {d.get('receivers')}"]
    for r in d["rows"]:
        out.append(f"{r['layout']} ({r['bucket_mb']:.0f} MiB buckets): **{ws_ratio(r):.2f}x raw** "
                   f"({r['sync_median_s']:.3f} s)")
    return out


def lora_sync(d):
    s, r = d["summary"], d["ratios"]
    return [f"full weights {s['full_distributed']['seconds']['median']:.3f} s, rank-8 adapter "
            f"{s['adapter_r8_tensors']['seconds']['median']:.3f} s "
            f"({r['adapter_r8_tensors']['seconds_full_distributed_over_adapter']:.1f}x faster, "
            f"{r['adapter_r8_tensors']['bytes_full_over_adapter']:.0f}x fewer bytes)"]


def replay_overhead(d):
    return [f"{n}: replay on/off {row['ratio_median']:.2f}" for n, row in d["layouts"].items()]


def routing_mismatch(d):
    out = []
    for dt, r in d["results"].items():
        out.append(f"{dt}: decisions differing from transformers' {100 * r['no_replay']['decisions_differ']:.1f}% "
                   f"natural, {100 * r['replay']['decisions_differ']:.1f}% replayed")
    return out


def async_vs_sync(d):
    pr = d.get("overlap_over_sync_per_round") or {}
    spread = f" (per round {pr['min']:.2f}-{pr['max']:.2f})" if "min" in pr else ""
    return [f"**overlap/sync {d['overlap_over_sync']:.2f}x**{spread}; overlap {k(d['overlap_tokens_per_s'])} "
            f"trained tokens/s, sync {k(d['sync_tokens_per_s'])}"]


def micro_batches(d):
    return [f"micro-batch building {d['before_median_ms']:.1f} -> **{d['after_median_ms']:.1f} ms** per rank and step"]


def gc_pause(d):
    return [f"full collection of a trainer rank's heap {d['unfrozen']['median_ms']:.0f} ms unfrozen, "
            f"{1000 * d['frozen']['median_ms']:.1f} us frozen"]


def batch_delivery(d):
    s = d["step_seconds"]
    return [f"{d['shape']['samples']} samples to {d['world']} ranks: scatter {s['scatter']['median']:.2f} s against "
            f"broadcast_object {s['broadcast_object']['median']:.2f} s "
            f"(**{d['ratio_scatter_vs_broadcast']['median']:.2f}x**)"]


def image_build(d):
    b, out = d["build"], []
    base = f"base {b['base_seconds']} s + " if b.get("base_seconds") is not None else ""
    out.append(f"**{d['size_gib']:.1f} GiB**, built in {base}{b['build_seconds']} s (Python {b['python']}, "
               f"torch {d['versions_in_image']['torch']}, sglang {d['versions_in_image']['sglang']})")
    if t := d.get("train_in_image"):
        out.append(f"`mrl train` inside, {len(t['reward_per_step'])} steps in {t['wall_seconds']:.0f} s: reward "
                   f"{t['reward_first5_mean']:.2f} -> **{t['reward_last5_mean']:.2f}** (first/last 5 steps)")
    return out


def weight_sync_inflight(d):
    """``bench/weight_sync_inflight.py``: the generation pause per sync by pause mode, and the version tags."""
    s = d["summary"]
    modes = [m for m in ("abort", "retract", "in_place") if m in s]
    errors = {m: sum(r.get("version_errors", 0) for r in d["rows"] if r.get("mode") == m) for m in modes}
    return [f"{m}: generation pause **{s[m]['generation_pause_ms']['median']:.0f} ms** (p25-p75 "
            f"{s[m]['generation_pause_ms']['p25']:.0f}-{s[m]['generation_pause_ms']['p75']:.0f}), push "
            f"{s[m]['phase_ms']['push']:.0f} ms, tokens with a wrong version tag {errors[m]}" for m in modes]


def old_logprob_pass(d):
    a = d["args"]
    return [f"pi_old's forward over {a['mini_batches'] - 1} of {a['mini_batches']} mini-batches: "
            f"**{100 * d['old_logprob_pass_vs_step']:.0f}%** of the RL step without it (median of {a['pairs']} pairs, "
            f"p25-p75 {100 * d['ratio_p25']:.0f}-{100 * d['ratio_p75']:.0f}%)"] + (
        [f"the same pass in micro-batches of {a['old_micro_batch_size']} (training's: {a['micro_batch_size']}): "
         f"**{100 * d['old_logprob_pass_vs_step_own']:.0f}%** (p25-p75 {100 * d['ratio_own_p25']:.0f}-"
         f"{100 * d['ratio_own_p75']:.0f}%)"] if d.get("old_logprob_pass_vs_step_own") is not None else [])


def _first_last(d, a, b, label):
    if d.get(a) is None or d.get(b) is None:
        return []
    return [f"{label} {d[a]:.2f} -> **{d[b]:.2f}**"]


def mrl_train(d):
    out = _first_last(d, "reward_first10_mean", "reward_last10_mean", "reward (first / last 10 steps)")
    acc = get(d, "eval/accuracy") or get(d, "summary.eval/accuracy") or {}
    if d.get("eval_accuracy_first") is not None:
        out += _first_last(d, "eval_accuracy_first", "eval_accuracy_final", "held-out accuracy")
    elif isinstance(acc, dict) and "first" in acc and acc["first"] == acc["first"]:  # NaN: no eval
        out.append(f"held-out accuracy {acc['first']:.2f} -> {acc['last']:.2f}")
    step = d.get("step_seconds_median") or (d.get("step_seconds_median_p25_p75") or [None])[0]
    if step:
        out.append(f"step {step:.2f} s (median)")
    if d.get("sync_seconds_median"):
        out.append(f"sync {d['sync_seconds_median']:.3f} s (median)")
    return out


def mrl_train_summary(d):
    return [f"reward {d['reward']['first']:.2f} -> {d['reward']['last']:.2f} (first / last step), step "
            f"{d['step_seconds']['last']:.2f} s"]


def default_run(d):
    """``bench/default_run_ab.py``: per side, the whole run's wall time and the median step with its phases."""
    out = []
    for side in d["sides"]:
        summary, runs = d["summary"][side], [r[side] for r in d["rounds"] if side in r]
        ph = {k.removesuffix("_seconds"): statistics.median(r["phases"][k]["median"] for r in runs
                                                             if k in r["phases"])
              for k in runs[0]["phases"] if k not in ("step_seconds", "rest")}
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        w, st = summary["wall_seconds"], summary["median_step"]
        out.append(f"{side} ({' '.join(runs[0]['overrides']) or 'the default run'}), {len(runs)} runs: wall "
                   f"**{w['median']:.0f} s** ({w['p25']:.0f}-{w['p75']:.0f}), step **{st['median']:.2f} s** "
                   f"(phases, s: {top}); reward last 10 steps "
                   f"{statistics.median(r['reward_last10'] for r in runs):.2f}")
    if "B_over_A" in d["summary"]:
        ratio = d["summary"]["B_over_A"]
        out.append(f"B / A: wall {ratio['wall']['median']:.2f}, step {ratio['median_step']['median']:.2f} (median "
                   "of the rounds' ratios)")
    return out


def lookup_learning(d):
    runs = {n: r for n, r in d["runs"].items() if r.get("success_last10_mean") is not None}
    return [f"{n}: episode success {r['success_first10_mean']:.2f} -> **{r['success_last10_mean']:.2f}** "
            f"(first / last 10 steps), {r['wall_s'] / 60:.0f} min" for n, r in runs.items()]


def parity(d):
    cases = [v for v in d.values() if isinstance(v, dict) and "pass" in v]
    return [f"{sum(bool(v['pass']) for v in cases)} of {len(cases)} cases pass; HF round trip bit-exact in "
            f"{sum(bool(v.get('roundtrip_bit_exact')) for v in cases)}"]


def preflight_timing(d):
    def span(x):
        was = f"; {x['median_at_branch_start']:.2f} s at branch start" if "median_at_branch_start" in x else ""
        median = f" (median {x['median']:.2f} s{was})" if "median" in x else ""
        return f"{min(x['runs']):.2f}-{max(x['runs']):.2f} s{median}"
    return [f"`mrl check`, whole command: bridge-level failure {span(d['bridge_level_failure_s'])}, cheap failure "
            f"{span(d['cheap_failure_s'])}, passing {span(d['passing_check_s'])}"]


def mismatch_split(d):
    out = []
    for run, r in d["runs"].items():
        num, st = r["numerics"], r["staleness"]
        out.append(f"{run}: numerics KL {num['kl_median']:.1e} ({num['tokens']} tokens), staleness KL "
                   f"{st['kl_median']:.1e} ({st['tokens']} tokens, lags {'/'.join(st['tokens_by_lag'])})")
    return out


def update_request_latency(d):
    s = d["summary"]
    return [f"{k}: {d['body_bytes'][k] / 1000:.1f} kB, round trip {1e3 * v['median_s']:.2f} ms "
            f"(p25-p75 {1e3 * v['p25_s']:.2f}-{1e3 * v['p75_s']:.2f})" for k, v in s.items()]


def sync_profile(d):
    if "result" in d:  # one run, summarized at the top
        r, ph = d["result"], d["result"]["sync_phases_median_s"]
        lo, hi = r["sync_vs_raw_p25_p75"]
        return [f"**sync/raw {r['sync_vs_raw']:.2f}** (p25-p75 {lo:.2f}-{hi:.2f}): "
                f"sync {1e3 * r['sync_median_s']:.0f} ms, raw {1e3 * r['raw_median_s']:.0f} ms; "
                f"pause {1e3 * ph['pause']:.1f}, push {1e3 * ph['push']:.1f}, finish {1e3 * ph['finish']:.1f} ms; "
                f"request to runner {1e3 * r['request_latency_median_s']:.1f} ms"]
    out = []
    for name, r in d["runs"].items():
        measured = [u["engine_gpu_receive_s"] for u in r["engine_per_update"] if u["kind"] == "measured"]
        al = r["profiled_sync_alignment"]
        lo, hi = r["sync_vs_raw_p25_p75"]
        out.append(f"{name}: **sync/raw {r['sync_vs_raw_median_of_ratios']:.2f}** (p25-p75 {lo:.2f}-"
                   f"{hi:.2f}), engine receives {1e3 * statistics.median(measured):.0f} ms a "
                   f"sync; profiled sync: {1e3 * al['trainer_broadcasts_after_engine_joined_s']:.0f} ms from the "
                   f"engine's first receive to the last (raw {1e3 * r['raw_median_s']:.0f} ms)")
    return out


EXTRACTORS = {
    "rl_step_vs_megatron": rl_step_vs_megatron, "rl_step_vs_bare": rl_step_vs_bare, "loop_e2e": loop_e2e,
    "gpu_loop": gpu_loop, "routes_wire": routes_wire, "routes_decode": routes_decode,
    "rollout_throughput": rollout_throughput, "weight_sync": weight_sync, "lora_sync_cpu": lora_sync,
    "replay_overhead": replay_overhead, "routing_mismatch": routing_mismatch, "async_vs_sync": async_vs_sync,
    "micro_batches": micro_batches, "gc_pause": gc_pause, "batch_delivery": batch_delivery,
    "old_logprob_pass": old_logprob_pass, "weight_sync_inflight": weight_sync_inflight,
    "mrl_train": mrl_train, "gpu_loop_learn": mrl_train, "mrl_train_summary": mrl_train_summary,
    "lookup_learning": lookup_learning, "default_run": default_run, "parity": parity,
    "gpu_mismatch_split": mismatch_split,
    "preflight_timing": preflight_timing, "fp8_quant": fp8_quant, "loop_e2e_trainer_start": trainer_start,
    "learn_compare": learn_compare, "gpu_fp8_learning": learn_compare, "fp8_sync_check": fp8_sync_check,
    "fused_replay_check": fused_replay_check, "checkpoint_save": checkpoint_save, "moe_kernel_tune": moe_kernel_tune,
    "logprob_kernel": logprob_kernel, "gpu_loop_sync_profile": sync_profile,
    "update_request_latency": update_request_latency, "export_time": export_time, "recipe": recipe,
    "opd_learning": opd_learning, "opd_cost": opd_cost,
    "minibatch": minibatch,
    "image_build_cpu": image_build,
}


# -- goals: the figure that decides each, read from its report -------------------------------------

def _rl(path, layout):
    return lambda d: get(d, f"layouts.{layout}.mrl_vs_megatron")


def _tflops(path):
    return lambda d: get(d, "layouts.tp1.mrl.model_tflops_per_gpu")


def _paired(row):
    """The median of per-repetition ratios where the report has it (the ratio of medians before)."""
    return row.get("ratio_paired_median", row["ratio_median"])


def _ws_max(d):
    return max(ws_ratio(r) for r in d["rows"] if "+" not in r["layout"])


def _ws_cpu_tp1(d):
    return min(ws_ratio(r) for r in d["rows"] if r["layout"] == "tp1")


def _opd_steps(*reports):
    """OPD's steps to target over GRPO's, medians over the seeds of every report (runs of the same command);
    never reaching the target counts as infinitely many steps."""
    inf = float("inf")
    arm = {a: statistics.median([inf if x is None else x
                                 for r in reports for x in r["summary"][a]["steps_to_target"]])
           for a in ("opd", "grpo")}
    return arm["opd"] / arm["grpo"]


def _mb_steps_ratio(d):
    """Median steps to 90% with 4 mini-batches over that with 1 (a run that never got there: beyond all)."""
    by = {k: statistics.median([float("inf") if x is None else x for x in v])
          for k, v in d["steps_to_90_by_minibatches"].items()}
    return by["4"] / by["1"]


_KR = "keep_routing/2026-11-29_gpu_replay_overhead_2xH200_16reps_paired.json"
_R9 = "rl_step/2026-11-29_gpu_rl_step_vs_megatron_qwen3_30b_a3b_l12_2xH200_"
_R1 = "rl_step/2026-11-29_gpu_rl_step_vs_megatron_qwen3_30b_a3b_l12_1xH200_tp1_mbs2_fused_logprob_profile.json"
GOALS = [  # (goal, comparison, threshold, report or tuple of reports, value(*reports), what the figure is)
    ("pi_old's forward pass / the RL step it precedes, 30B-A3B slice, 1 GPU", "<=", 0.25,
     "rl_step/2026-12-07_old_logprob_pass_qwen3_30b_a3b_l3_1xH100.json", lambda d: d["old_logprob_pass_vs_step"],
     "1x H100, 3-layer slice (no TE in the stack: local spec, fp32 Adam), 4 mini-batches of 8 x 2048 tokens, "
     "median of 8 pairs (p25-p75 0.25-0.41)"),
    ("generation pause per sync with pause_mode=in_place (ms)", "<=", 10,
     "weight_sync/2026-12-07_weight_sync_inflight_qwen3_30b_a3b_l12_1xH100.json",
     lambda d: d["summary"]["in_place"]["generation_pause_ms"]["median"],
     "1x H100, 30B slice 12 layers, engine beside the trainer (CUDA IPC), 32 streamed requests, 8 reps; abort 352 "
     "ms, retract 268 ms; the push is inside the pause in every mode; in_place's 288 tokens tagged with the old "
     "version were one per request per sync, the forward pass launched before the pause (docs/weight_sync.md)"),
    ("whole loop / its own ceiling", ">=", 0.9, "loop/2026-11-28_gpu_loop_e2e_qwen3_30b_a3b_l12_4xH200.json",
     lambda d: d["loop_vs_ceiling"], "2x H200, Qwen3-30B-A3B 12-layer slice"),
    ("seconds from launch to the first RL step", "<=", 180,
     "loop/2026-11-29_gpu_loop_e2e_first_step_cold_qwen3_30b_a3b_l12_2xH200.json",
     lambda d: d["time_to_first_step_s"], "2x H200, 30B slice, fresh host (cold caches); 112 s warm"),
    ("RL step / megatron-core's own step, 1 GPU", ">=", 0.95,
     _R1, _rl(None, "tp1"),
     "1x H200, 30B slice, micro-batches of 2, median of 8 ABBA pairs, quiet host (before fused logprobs, micro-batches "
     "of 4: 0.80 and 0.90)"),
    ("RL step / megatron-core's own step, EP2", ">=", 0.9, _R9 + "ep2_mbs4_fused_logprob_quiet_profile.json",
     _rl(None, "ep2"), "2x H200, 30B slice, median of 8 ABBA pairs, quiet host (fused logprobs off: 0.94; on a "
     "host with load 8.6: 0.81)"),
    ("RL step / megatron-core's own step, TP2", ">=", 0.9, _R9 + "tp2_mbs4_fused_replay_8pairs.json",
     _rl(None, "tp2"), "2x H200, 30B slice, median of 8 ABBA pairs"),
    ("model TFLOP/s per GPU, RL step", ">=", 140,
     _R1, _tflops(None), "1x H200, 30B slice at 4k tokens, quiet host (before fused logprobs: 176.5, 195.5)"),
    ("weight sync / raw broadcast, every layout", "<=", 1.2,
     "weight_sync/2026-11-26_gpu_weight_sync_4xH200_inplace_fullbucket.json", _ws_max,
     "4x H200, 1.67 GiB bf16, worst layout"),
    ("weight sync / raw broadcast, CPU TP1", "<=", 1.2, "weight_sync/2026-11-28_cpu_weight_sync_2core_cpu_large.json",
     _ws_cpu_tp1, "2-core CPU, 186 MiB fp32, best bucket size"),
    ("sync into a live engine / raw broadcast", "<=", 1.5,
     "weight_sync/2026-11-29_gpu_loop_sync_fixed_baseline_qwen3_30b_a3b_l12_2xH200.json",
     lambda d: d["result"]["sync_vs_raw"], "2x H200, 16.2 GB bf16 (30B slice), TP1 -> TP1, median of 8 ratios"),
    ("rollouts with routes / without, batch 256", ">=", 0.95,
     "fp8/2026-11-29_gpu_loop_fp8_fa3_deepgemm_qwen3_30b_a3b_l12_2xH200.json",
     lambda d: get(d, "runs.deepgemm.rollout.summary.batch256.on_vs_off_median"),
     "1x H200 engine, 30B slice, same engine, 8 repetitions (spread 0.77-1.05); the other run that evening 0.99, "
     "runs before 0.93-0.96"),
    ("FP8 rollouts / bf16, batch 256", ">=", 1.3,
     "fp8/2026-11-29_gpu_loop_fp8_fa3_deepgemm_qwen3_30b_a3b_l12_2xH200.json", lambda d: d["fp8_vs_bf16_rollout"],
     "1x H200 a run, 30B slice, FA3 on both, DeepGEMM on FP8, whole runs, 8 repetitions; decode alone 1.30; "
     "triton (mrl's default) 1.18 and 1.23; 24 layers (triton): 1.23; 2,048 new tokens: 1.21 (decode alone 1.24); "
     "a stream of 1,024 samples: 0.97"),
    ("rollouts with routes / a plain engine, batch 256", ">=", 0.95,
     "loop/2026-11-28_gpu_loop_e2e_qwen3_30b_a3b_l12_4xH200.json", lambda d: d["routes_on_vs_plain"],
     "2x H200, full 48-layer Qwen3-30B-A3B"),
    ("Keep Routing step overhead, TP2+SP", "<=", 1.02, _KR,
     lambda d: _paired(d["layouts"]["tp2"]), "2x H200, 490M MoE, median of 16 paired on/off ratios (p25-p75 "
     "0.90-1.09); 1.05 on 2026-11-26 as a ratio of medians"),
    ("Keep Routing step overhead, EP2", "<=", 1.02, _KR,
     lambda d: _paired(d["layouts"]["ep2"]), "2x H200, 490M MoE, median of 16 paired on/off ratios (p25-p75 "
     "0.85-1.14); 0.99 on 2026-11-26 as a ratio of medians"),
    ("overlap / sync mode, long-tailed task", ">=", 3.0, "loop/2026-11-28_async_vs_sync_cpu.json",
     lambda d: d["overlap_over_sync"], "2-core CPU, real SGLang CPU engine"),
    ("countdown recipe: held-out pass@1 lift over the warm start, CPU", ">=", 0.30,
     "learning/2026-12-07_mrl_train_recipe_countdown_cpu2core.json",
     lambda d: d["summary"]["default"]["lift_median"],
     "2-core CPU, tiny model, sampled pass@1 (8 samples on 87 held-out problems), median over 3 seeds"),
    ("OPD: steps to the GRPO run's final held-out pass@1 / GRPO's steps, CPU", "<=", 0.5,
     ("learning/2026-12-07_mrl_train_opd_countdown_lr1e-3_cpu2core.json",
      "learning/2026-12-08_mrl_train_opd_countdown_lr1e-3_seed5_cpu2core.json"), _opd_steps,
     "2-core CPU, countdown, tiny model, teacher from the recipe (held-out pass@1 0.56; 0.52 retrained for seed 5), "
     "200 steps, seeds 2 and 3, then 5, OPD at lr 1e-3 (+experiment=countdown_opd), "
     "GRPO at the recipe's 3e-4; OPD 100, 80, never against GRPO 180, 200, 200 (seed 5's distillation ran to the "
     "length limit and fell to pass@1 0.001 for 80 steps before it recovered); evaluations every 20 steps"),
    ("scoring keeps pace: loop trained tokens/s with a teacher pool of equal size / without, CPU", ">=", 0.9,
     ("loop/2026-12-07_opd_cost_cpu2core.json", "loop/2026-12-08_opd_cost_quiet_cpu2core.json"),
     lambda loaded, quiet: quiet["loop_with_scoring_vs_without"],
     "2-core CPU, default run, median of paired window ratios: 0.91 with the box to itself (16 pairs, p25-p75 "
     "0.77-1.05; the value), 1.11 under a load of 30-45 from other jobs (8 pairs, p25-p75 0.91-1.27)"),
    ("default task: steps to 90% reward with 4 mini-batches / with 1, CPU", "<=", 1.0,
     "learning/2026-12-07_mrl_train_minibatch_default_cpu2core.json", _mb_steps_ratio,
     "2-core CPU, algo=dapo, 128 samples a step in both (steps are samples), medians over 2 seeds; trailing "
     "5-step mean of the training reward"),
    ("seconds for mrl export of the 30B-A3B slice, one GPU host", "<=", 120,
     "checkpoints/2026-12-07_export_time_qwen3_30b_a3b_l8_none_1xH100.json",
     lambda d: d["export_wall_s"]["median"], "1x H100, 8-layer slice (11.2 GB), process start to exit, cold cache"),
]


def goals_table(load) -> list[str]:
    lines = ["| goal | measured | result | on | date | report |", "|---|---|---|---|---|---|"]
    for goal, op, thr, rels, value, where in GOALS:
        rels = rels if isinstance(rels, tuple) else (rels,)
        ds = [load(rel) for rel in rels]
        v = value(*ds)
        met = v >= thr if op == ">=" else v <= thr
        date = max(meta(d, os.path.basename(rel))[0] for d, rel in zip(ds, rels))
        fmt = f"{v:.1f}" if thr >= 10 else f"{v:.2f}"
        links = "<br>".join(f"[{os.path.basename(rel)[:-5]}](../bench/reports/{rel})" for rel in rels)
        lines.append(f"| {goal} {op} {thr:g} | {fmt} | {'met' if met else '**not met**'} | {where} | {date} | "
                     f"{links} |")
    return lines


# -- the page --------------------------------------------------------------------------------------

def render() -> str:
    cache = {}

    def load(rel):
        if rel not in cache:
            with open(os.path.join(REPORTS, rel)) as f:
                cache[rel] = json.load(f)
        return cache[rel]

    out = ["# Results", "",
           "Generated by `scripts/results_page.py` from the reports in `bench/reports/<topic>/` (do not edit: "
           "run the script; `tests/unit/test_results_page.py` fails when this page and the reports disagree). "
           "Every figure links its report, which holds every repetition, the hardware and the versions. "
           "\"not recorded\": the report does not name its commit.", "",
           "## Goals", "",
           "Each goal with the figure that decides it (medians over repetitions; spread in the report).", "",
           *goals_table(load), ""]
    folders = sorted(f for f in os.listdir(REPORTS) if os.path.isdir(os.path.join(REPORTS, f)))
    unknown = [f for f in folders if f not in TOPICS]
    if unknown:
        raise SystemExit(f"results_page.py: report folders without a title in TOPICS: {unknown}")
    for topic in TOPICS:
        if topic not in folders:
            continue
        title, what = TOPICS[topic]
        out += [f"## {title}", "", f"{what} Reports in `bench/reports/{topic}/`, newest first.", "",
                "| date | hardware | commit | figures | report |", "|---|---|---|---|---|"]
        files = sorted((f for f in os.listdir(os.path.join(REPORTS, topic)) if f.endswith(".json")),
                       key=lambda f: (f[:10], f), reverse=True)
        for f in files:
            d = load(f"{topic}/{f}")
            date, hw, commit = meta(d, f) if isinstance(d, dict) else (f[:10], "not recorded", "not recorded")
            fn = EXTRACTORS.get(kind(d, f)) if isinstance(d, dict) else None
            figures = "<br>".join(x.replace("|", "\\|") for x in fn(d)) if fn else "(no extractor: see the report)"
            out.append(f"| {date} | {hw} | {commit} | {figures} | [{f[:-5]}](../bench/reports/{topic}/{f}) |")
        others = sorted(f for f in os.listdir(os.path.join(REPORTS, topic))
                        if not f.endswith(".json") and f != FINDINGS)
        if others:
            out += ["", "Other files: " + ", ".join(f"[{f}](../bench/reports/{topic}/{f})" for f in others) + "."]
        out += findings(topic)
        out.append("")
    return "\n".join(out)


FINDINGS = "findings.md"
_LINK = re.compile(r"(\[[^\]]*\]\()([^)\s]+)(\))")


def findings(topic: str) -> list[str]:
    """The topic's ``findings.md`` (what the runs show, written by hand, each figure linking its report) under
    a heading of its own, its relative links rewritten from the report folder to docs/."""
    path = os.path.join(REPORTS, topic, FINDINGS)
    if not os.path.exists(path):
        return []
    folder, docs = os.path.dirname(path), os.path.dirname(PAGE)

    def relink(m):
        target = m.group(2)
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        file, _, anchor = target.partition("#")
        rel = os.path.relpath(os.path.normpath(os.path.join(folder, file)), docs).replace(os.sep, "/")
        return m.group(1) + rel + ("#" + anchor if anchor else "") + m.group(3)

    with open(path) as f:
        text = f.read().strip()
    return ["", f"### {TOPICS[topic][0]}: what the runs show", "",
            f"From [{FINDINGS}](../bench/reports/{topic}/{FINDINGS}): every figure links its report.", "",
            _LINK.sub(relink, text)]


def main() -> int:
    page = render()
    if "--check" in sys.argv[1:]:
        with open(PAGE) as f:
            if f.read() != page:
                print("docs/results.md is stale: run python scripts/results_page.py", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(page)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
