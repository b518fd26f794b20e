"""The whole RL loop as a user runs it (``mrl train``), measured end to end against its own ceilings.

    python bench/loop_e2e.py --out DIR                                   # GPU: trainer GPU 0, engine GPU 1
    python bench/loop_e2e.py --out DIR --gpus 0,1,2,3 --trainer-gpus 2 \\
        --set parallel=ep2 engine.tp=2                           # trainer EP2 + one TP2 engine
    python bench/loop_e2e.py --cpu --out DIR                             # the same flow on CPU, tiny model

The workload is shaped like a reasoning RL job: ``--prompts`` prompts x ``--samples`` samples a step,
prompts of ``--prompt-len`` tokens (uniform), per-sample response budgets drawn from a log-normal
(median ``--response-median``, sigma ``--response-sigma``) capped at ``--max-response`` tokens, each
sample stopping exactly at its budget (``rollout.ignore_eos``: a random-init model produces the lengths
as drawn). GRPO, overlap mode, weights synced into the engines over NCCL after every step.

Three measurements on the same workload, in one run:

- ``loop``: ``mrl train`` itself (a subprocess, no bench-only loop), ``--warmup + --steps`` steps;
  per-step phases from its ``metrics.jsonl`` (waiting for samples, train, drain/pause, sync), each
  GPU's busy fraction sampled through NVML over the timed steps, and ``time_to_first_step_s`` from the
  command's start to the first step's log line.
- ``engine ceiling``: the loop's rollout side alone (``_generation_ceiling.py``: the same config,
  engines, prompts, budgets, concurrency and routes returned; no trainer, no pause, no sync).
- ``trainer ceiling``: ``Policy.rl_step`` alone (``_loop_trainer_ceiling.py``, the same config and
  layout) on batches of exactly the workload's shapes, routes recorded from the model's own routing.

The two ceilings run side by side, each on its own GPUs. Every figure is in the same unit, the tokens
of the step's samples (prompt + response) per second, so ``loop_vs_ceiling`` = loop / min(engine,
trainer): overlap mode at its best trains as fast as the slower side alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bench_common import environment  # noqa: E402
from _engine_log import engine_timeline  # noqa: E402
from mrl.startup import LAUNCHED_AT  # noqa: E402


# -- workload --------------------------------------------------------------------------------------
def response_budgets(rng: random.Random, n: int, median: float, sigma: float, cap: int, floor: int) -> list[int]:
    return [max(floor, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def prompt_text(rng: random.Random, tok, target: int) -> str:
    """Random lowercase words until the tokenizer gives ``target`` tokens (trimmed to it exactly)."""
    words: list[str] = []
    while True:
        words += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                  for _ in range(max(8, target // 2))]
        ids = tok.encode(" ".join(words)).ids
        if len(ids) >= target:
            text = tok.decode(ids[:target])
            if len(tok.encode(text).ids) == target:
                return text
            words = words[:len(words) // 2]  # a cut inside a merge: try another draw


def write_prompts(path: str, tok, a, rows: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    budgets, plens = [], []
    with open(path, "w") as f:
        for i in range(rows):
            plen = rng.randint(*a.prompt_len)
            row = response_budgets(rng, a.samples, a.response_median, a.response_sigma, a.max_response,
                                   a.min_response)
            budgets += row
            plens.append(plen)
            f.write(json.dumps({"id": f"p{i}", "prompt": prompt_text(rng, tok, plen), "answer": "x",
                                "max_new_tokens": row}) + "\n")
    q = statistics.quantiles(budgets, n=100)
    return {"rows": rows, "prompt_len_mean": statistics.mean(plens), "response_budget_mean": statistics.mean(budgets),
            "response_budget_p50": q[49], "response_budget_p90": q[89], "response_budget_p99": q[98],
            "response_budget_max": max(budgets),
            "samples_at_cap_fraction": sum(b == a.max_response for b in budgets) / len(budgets)}


# -- the run's config ------------------------------------------------------------------------------
def overrides(a, hf: str, prompts: str, run_dir: str, steps: int) -> list[str]:
    """``mrl train`` overrides of the loop; the ceilings compose the same ones."""
    # engines after the trainer's GPUs, also for the engine ceiling (a process that is no trainer rank)
    args = [] if a.cpu else ["engine=gpu", f"engine.base_gpu_id={a.trainer_procs}", "model.dtype=bf16",
                             "train.optimizer_states_dtype=bf16",
                             f"train.micro_batch_size={a.micro_batch_size}", f"train.pack_max_len={a.pack_len}"]
    args += [f"model.hf_path={hf}", "model.make_tiny_if_missing=false", "data=jsonl", f"data.path={prompts}",
            f"train.steps={steps}", f"train.prompts_per_step={a.prompts}", f"rollout.n_samples_per_prompt={a.samples}",
            "train.mode=overlap", "weight_sync.every_n_steps=1", "rollout.ignore_eos=true", "train.eval_every=0",
            "train.sft_warmup_steps=0", "train.routing_metrics_every=0", f"train.max_inflight_groups={a.inflight}",
            f"engine.max_running_requests={a.engine_batch}", "train.save_hf=false", f"run_dir={run_dir}"]
    if a.cpu:
        args += ["+engine.server_args.max_total_tokens=16384"]
    return args + list(a.set)


def _gpu_env(a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = a.gpus
    return env


# -- GPU busy fractions ----------------------------------------------------------------------------
class BusySampler:
    """NVML utilization (the share of the last sample period a kernel ran) of each visible GPU, sampled
    every ``period`` s with a wall-clock stamp, so any window of the run can be averaged afterwards."""

    def __init__(self, gpus: list[int], period: float = 0.2):
        self.gpus, self.period, self.samples = gpus, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(g) for g in self.gpus]
        while not self._stop.wait(self.period):
            self.samples.append((time.time(), [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for h in handles]))
        pynvml.nvmlShutdown()

    def __enter__(self):
        if self.gpus:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        rows = [u for t, u in self.samples if t0 <= t <= t1]
        return {str(g): statistics.mean(r[i] for r in rows) for i, g in enumerate(self.gpus)} if rows else {}


# -- the loop --------------------------------------------------------------------------------------
def run_loop(a, hf: str, prompts: str, run_dir: str) -> dict:
    """``mrl train`` as a user runs it; the wall time of each step's log line is taken as it appears."""
    steps = a.warmup + a.steps
    metrics = os.path.join(run_dir, "metrics.jsonl")
    log = open(os.path.join(a.out, "loop.log"), "w")
    seen: dict[int, float] = {}
    visible = [int(g) for g in a.gpus.split(",")] if not a.cpu else []  # NVML counts physical GPUs
    t_start = time.time()
    with BusySampler(visible) as sampler:
        proc = subprocess.Popen([sys.executable, "-m", "mrl", "train", *overrides(a, hf, prompts, run_dir, steps)],
                                cwd=REPO, env=_gpu_env(a),
                                stdout=log, stderr=subprocess.STDOUT)
        pos = 0
        while proc.poll() is None or os.path.exists(metrics) and os.path.getsize(metrics) > pos:
            if os.path.exists(metrics):
                with open(metrics) as f:
                    f.seek(pos)
                    chunk = f.read()
                    complete = chunk[:chunk.rfind("\n") + 1]
                    pos += len(complete.encode())
                now = time.time()
                for line in complete.splitlines():
                    row = json.loads(line)
                    if "step_seconds" in row:
                        seen.setdefault(row["step"], now)
            if proc.poll() is not None and not (os.path.exists(metrics) and os.path.getsize(metrics) > pos):
                break
            time.sleep(0.1)
        rc = proc.wait()
    log.close()
    rows = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    steps_rows = [r for r in rows if "step_seconds" in r]
    out = {"exit_code": rc, "logged_at_s": {str(k): t - t_start for k, t in seen.items()}}
    if rc:  # the steps that ran are kept and summarised; the run counts as failed
        out["error_tail"] = open(os.path.join(a.out, "loop.log"), errors="replace").read().splitlines()[-30:]
    out["checkpoint_saves"] = checkpoint_saves(open(os.path.join(a.out, "loop.log"), errors="replace").read())
    log_dir = os.path.join(run_dir, "engines")
    if os.path.isdir(log_dir):  # the engines' own logs outlive the run directory (the start phases' stamps)
        shutil.copytree(log_dir, os.path.join(a.out, "engine_logs"), dirs_exist_ok=True)
    out["engine_log_timeline"] = engine_timeline(log_dir)
    if len(steps_rows) <= a.warmup:
        return out | {"steps": steps_rows}
    out |= summarize(steps_rows, out["logged_at_s"], a.warmup)
    t0, t1 = out["busy_window_s"]
    out["gpu_busy_fraction"] = sampler.busy(t_start + t0, t_start + t1)
    out["busy_series"] = [(round(t - t_start, 2), u) for t, u in sampler.samples]
    return out


_SAVED = re.compile(r"^\[mrl\] checkpoint step_(\d+) saved: ([\d.e+-]+) GiB in ([\d.e+-]+) s", re.M)
_STAGED = re.compile(r"^\[mrl\] checkpoint step_(\d+): shards staged in ([\d.e+-]+) s", re.M)
_COMPLETE = re.compile(r"^\[mrl\] checkpoint step_(\d+) complete: ([\d.e+-]+) GiB, ([\d.e+-]+) s after", re.M)


def checkpoint_saves(log: str) -> list[dict]:
    """The checkpoints ``mrl train`` reported saving (its console lines): step, GiB on disk, seconds until
    complete; an asynchronous save (``train.async_save``) also the seconds the loop waited for it (``staged_s``)."""
    saves = [{"step": int(m[1]), "gib": float(m[2]), "seconds": float(m[3])} for m in _SAVED.finditer(log)]
    staged = {int(m[1]): float(m[2]) for m in _STAGED.finditer(log)}
    saves += [{"step": int(m[1]), "gib": float(m[2]), "seconds": float(m[3]), "staged_s": staged.get(int(m[1]))}
              for m in _COMPLETE.finditer(log)]
    return sorted(saves, key=lambda c: c["step"])


PHASES = ("wait_seconds", "train_seconds", "drain_seconds", "sync_seconds", "step_seconds")
SYNC_PHASES = tuple(f"sync/{k}_seconds" for k in ("check", "pause", "push", "finish", "barrier"))
KEEP = ("step", "batch_tokens", "response_len", "version", "sync_bytes", "dropped_stale", "buffered",
        "staleness_hist", "mismatch/numerics_kl", "mismatch/stale_kl", *PHASES, *SYNC_PHASES)


def summarize(steps_rows: list[dict], logged_at_s: dict[str, float], warmup: int) -> dict:
    """The loop's figures from its metrics rows and the seconds (from the command's start) at which each
    step's row appeared: trained tokens/s over the timed steps, phases, the first step's arrival."""
    timed = steps_rows[warmup:]
    seconds = sum(r["step_seconds"] for r in timed)
    tokens = sum(r["batch_tokens"] for r in timed)
    t0 = logged_at_s[str(timed[0]["step"])] - timed[0]["step_seconds"]
    first = steps_rows[0]
    return {"steps": [{k: r.get(k) for k in KEEP} | {"logged_at_s": logged_at_s.get(str(r["step"]), float("nan"))}
                      for r in steps_rows],
            "warmup_steps": warmup, "timed_steps": len(timed), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_step_median": statistics.median(r["batch_tokens"] / r["step_seconds"] for r in timed),
            "phase_median_s": {k: statistics.median(r.get(k, 0.0) for r in timed) for k in PHASES},
            "phase_p25_p75_s": {k: _quartiles([r.get(k, 0.0) for r in timed]) for k in PHASES},
            "sync_share_of_step": statistics.median(r.get("sync_seconds", 0.0) / r["step_seconds"] for r in timed),
            "sync_phase_median_s": {k.split("/")[1]: statistics.median(r.get(k) or 0.0 for r in timed)
                                    for k in SYNC_PHASES},
            "time_to_first_step_s": logged_at_s[str(first["step"])],
            "first_step": {k: first.get(k) for k in PHASES},
            # seconds from the command's start to each start phase, as mrl's rank 0 saw them (mrl/startup.py)
            "start_phases_s": {k.split("/", 1)[1][:-2]: v for k, v in first.items() if k.startswith("startup/")},
            "busy_window_s": [t0, logged_at_s[str(timed[-1]["step"])]]}


def _quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else []
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


# -- the ceilings ----------------------------------------------------------------------------------
def run_ceilings(a, hf: str, prompts: str, tmp: str, engine: bool = True) -> tuple[dict | None, dict]:
    """Engine alone and trainer alone, side by side (each on the GPUs it has in the loop); ``engine``
    False: the trainer alone."""
    engine_dir, trainer_dir = os.path.join(tmp, "engine_ceiling"), os.path.join(tmp, "trainer_ceiling")
    engine_out, trainer_out = os.path.join(a.out, "engine_ceiling.json"), os.path.join(a.out, "trainer_ceiling.json")
    steps = a.warmup + a.steps
    env = _gpu_env(a)
    eng = subprocess.Popen([sys.executable, os.path.join(HERE, "_generation_ceiling.py"), "--steps",
                            str(a.ceiling_batches + 1), "--out", engine_out,
                            *overrides(a, hf, prompts, engine_dir, steps)], cwd=REPO, env=env,
                           stdout=open(os.path.join(a.out, "engine_ceiling.log"), "w"),
                           stderr=subprocess.STDOUT) if engine else None
    nproc = a.trainer_procs
    trn = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                            os.path.join(HERE, "_loop_trainer_ceiling.py"), "--prompts", prompts,
                            "--batches", str(a.ceiling_batches), "--warmup", "1", "--out", trainer_out,
                            *(["--profile-startup"] if a.profile_startup else []), "--",
                            *overrides(a, hf, prompts, trainer_dir, steps)], cwd=REPO,
                           env=env | {LAUNCHED_AT: repr(time.time())},
                           stdout=open(os.path.join(a.out, "trainer_ceiling.log"), "w"), stderr=subprocess.STDOUT)
    for name, p in (("engine", eng), ("trainer", trn)):
        if p is not None and p.wait(timeout=3600):
            raise RuntimeError(f"{name} ceiling exited {p.returncode}; see {a.out}/{name}_ceiling.log")
    return json.load(open(engine_out)) if engine else None, json.load(open(trainer_out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="CPU engine and trainer, tiny model, a small workload")
    ap.add_argument("--model", default="qwen3_30b_a3b_l12", help="a make_model preset (GPU)")
    ap.add_argument("--gpus", default="0,1",
                    help="physical GPUs the run gets (CUDA_VISIBLE_DEVICES; trainer ranks first, then the engines)")
    ap.add_argument("--trainer-procs", type=int, default=1, help="trainer ranks (the layout's world size)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[256, 512])
    ap.add_argument("--response-median", type=float, default=400.0)
    ap.add_argument("--response-sigma", type=float, default=0.9)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--min-response", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=32,
                    help="train.max_inflight_groups (one batch ahead: more would let the timed steps train on groups "
                    "buffered before them)")
    ap.add_argument("--engine-batch", type=int, default=256, help="engine.max_running_requests")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="train.micro_batch_size (packed rows)")
    ap.add_argument("--pack-len", type=int, default=4096, help="train.pack_max_len")
    ap.add_argument("--ceiling-batches", type=int, default=4, help="timed batches of each ceiling")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--trainer-ceiling-only", action="store_true",
                    help="no loop, no engine: the trainer ceiling alone, with its start phases (one GPU is enough)")
    ap.add_argument("--profile-startup", action="store_true",
                    help="trainer ceiling: cProfile of the model's build and of its first rl_step in the report")
    ap.add_argument("--set", nargs="*", default=[], help="more mrl train overrides (both loop and ceilings)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories under --out")
    a = ap.parse_args()
    if a.cpu:  # a workload the 2-core box runs in minutes; the flow is the GPU one
        for k, v in dict(model="tiny", prompts=4, samples=4, prompt_len=[16, 48], response_median=12.0,
                         max_response=64, min_response=2, inflight=4, engine_batch=16, steps=8, warmup=2,
                         ceiling_batches=4).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    os.makedirs(a.out, exist_ok=True)
    tmp = os.path.join(a.out, "work")
    os.makedirs(tmp, exist_ok=True)
    t = time.perf_counter()
    hf = os.path.join(a.out if a.keep else tmp, f"model_{a.model}")
    # in a process of its own: on GPUs it builds the model on the trainer's first GPU, whose memory the
    # trainer needs back whole
    subprocess.run([sys.executable, os.path.join(HERE, "_bench_common.py"), "make-model", hf, "--preset", a.model],
                   check=True, env=_gpu_env(a), stdout=subprocess.DEVNULL)
    from tokenizers import Tokenizer

    if not os.path.exists(os.path.join(hf, "tokenizer.json")):  # random checkpoints of a preset shape: any
        from mrl.models.tiny import build_tokenizer                # small tokenizer encodes the prompts

        build_tokenizer(512).save(os.path.join(hf, "tokenizer.json"))
    model_s = time.perf_counter() - t
    tok = Tokenizer.from_file(os.path.join(hf, "tokenizer.json"))
    prompts = os.path.join(tmp, "prompts.jsonl")
    rows = (a.warmup + a.steps + 4) * a.prompts + 2 * a.inflight
    report = {"bench": "loop_e2e", "environment": environment(), "args": vars(a), "model_seconds": model_s,
              "workload": write_prompts(prompts, tok, a, rows),
              "overrides": overrides(a, hf, prompts, "RUN_DIR", a.warmup + a.steps)}
    out_json = os.path.join(a.out, "loop_e2e.json")
    if a.trainer_ceiling_only:
        _, report["trainer_ceiling"] = run_ceilings(a, hf, prompts, tmp, engine=False)
        tc = report["trainer_ceiling"]
        print(f"[loop_e2e] trainer ceiling {tc['tokens_per_s']:.0f} tokens/s; start: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in tc["startup_s"].items())
              + (f", warm-up pass {tc['warm_pass_s']:.1f} s" if tc.get("warm_pass_s") is not None else "")
              + f", first rl_step {tc['warmup_s'][0]:.1f} s", flush=True)
        json.dump(report, open(out_json, "w"), indent=1)
        return 0
    loop = run_loop(a, hf, prompts, os.path.join(tmp, "loop"))
    report["loop"] = loop
    json.dump(report, open(out_json, "w"), indent=1)
    if loop["exit_code"]:
        print(f"[loop_e2e] mrl train exited {loop['exit_code']} after {len(loop['steps'])} steps; see "
              f"{os.path.join(a.out, 'loop.log')} (the steps are in {out_json})", flush=True)
        if loop.get("timed_steps", 0) < a.steps:  # a run that ended at its last step still has its ceilings
            return 1
    print(f"[loop_e2e] loop: {loop['tokens_per_s']:.0f} tokens/s over {loop['timed_steps']} steps, first step at "
          f"{loop['time_to_first_step_s']:.1f} s, phases {json.dumps(loop['phase_median_s'])}, "
          f"busy {loop['gpu_busy_fraction']}", flush=True)
    if not a.skip_ceilings:
        engine, trainer = run_ceilings(a, hf, prompts, tmp)
        report["engine_ceiling"], report["trainer_ceiling"] = engine, trainer
        ceiling = min(engine["batch_tokens_per_s"], trainer["tokens_per_s"])
        n_gpus = len(a.gpus.split(",")) if not a.cpu else 1
        report |= {"engine_ceiling_tokens_per_s": engine["batch_tokens_per_s"],
                   "trainer_ceiling_tokens_per_s": trainer["tokens_per_s"],
                   "loop_tokens_per_s": loop["tokens_per_s"],
                   "loop_tokens_per_s_per_gpu": loop["tokens_per_s"] / n_gpus,
                   "loop_vs_ceiling": loop["tokens_per_s"] / ceiling,
                   "bound_by": "engine" if engine["batch_tokens_per_s"] < trainer["tokens_per_s"] else "trainer",
                   "time_to_first_step_s": loop["time_to_first_step_s"],
                   "sync_share_of_step": loop["sync_share_of_step"]}
        print(f"[loop_e2e] engine ceiling {engine['batch_tokens_per_s']:.0f}, trainer ceiling "
              f"{trainer['tokens_per_s']:.0f} tokens/s: loop_vs_ceiling {report['loop_vs_ceiling']:.3f} "
              f"({report['bound_by']}-bound)", flush=True)
    json.dump(report, open(out_json, "w"), indent=1)
    plot_timeline(report, os.path.join(a.out, "loop_e2e_timeline.png"))
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if loop["exit_code"] else 0


def plot_timeline(report: dict, path: str) -> None:
    """Per step: seconds waiting for samples, training, pausing (drain) and syncing, stacked; GPU busy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["loop"]["steps"]
    xs = [s["step"] for s in steps]
    fig, axes = plt.subplots(1, 2 if report["loop"]["busy_series"] else 1, figsize=(11, 3.6), squeeze=False)
    ax = axes[0][0]
    bottom = [0.0] * len(xs)
    for key, label in (("wait_seconds", "waiting for samples"), ("train_seconds", "train"),
                       ("drain_seconds", "pause (drain)"), ("sync_seconds", "sync")):
        ys = [s.get(key) or 0.0 for s in steps]
        ax.bar(xs, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.bar(xs, [max(0.0, s["step_seconds"] - b) for s, b in zip(steps, bottom)], bottom=bottom, color="lightgrey",
           label="other (verify, logging)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("loop step by phase", fontsize=9)
    ax.legend(fontsize=7)
    if report["loop"]["busy_series"]:
        ax = axes[0][1]
        ts = [t for t, _ in report["loop"]["busy_series"]]
        for i in range(len(report["loop"]["busy_series"][0][1])):
            ax.plot(ts, [u[i] for _, u in report["loop"]["busy_series"]], lw=0.6,
                    label=f"GPU {report['args']['gpus'].split(',')[i]}")
        w = report["loop"]["busy_window_s"]
        ax.axvspan(w[0], w[1], color="grey", alpha=0.15, label="timed steps")
        ax.set_xlabel("seconds since mrl train started")
        ax.set_ylabel("NVML utilization")
        ax.set_title("GPU busy", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
