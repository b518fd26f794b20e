"""``mrl export`` timed as a whole process, on a trainer checkpoint of a random-weight model, with a bitwise
round-trip check of what it writes.

    python bench/export_time.py --shape qwen3_30b_a3b --layers 12 --out DIR     # GPU: bf16, the 30B-A3B slice
    python bench/export_time.py --cpu --shape tiny --out DIR                     # the same flow on CPU (fp32)

1. A random Qwen3-MoE HF checkpoint of ``--shape`` cut to ``--layers`` (``bench/_random_checkpoint.py``, kept in
   ``--model-dir`` and reused).
2. A short trainer process (torchrun, ``--nproc`` ranks in ``--parallel``; on GPU bf16 weights, bf16 Adam states)
   loads it into ``Policy`` and writes ``RUN/checkpoints/step_0`` with the loop's own save, and ``RUN/config.yaml``
   (``bench/_export_trainer.py``). No training step: the weights go HF -> trainer -> checkpoint -> export unchanged.
   ``--optimizer-state adam`` saves Adam's states as a run's checkpoint holds them; ``none`` leaves them out
   (the model's part of the same save; ``mrl export`` reads only that part); ``auto`` (default) takes adam where
   the trainer's model states fit the GPU by mrl's estimate (``mrl.megatron.memory``) and none otherwise, and
   the report says which and why. The checkpoint is reused by later runs with the same settings.
3. ``--reps`` times ``python -m mrl export CHECKPOINT OUT`` from process start to exit, each into a fresh OUT;
   before each, the checkpoint's pages are dropped from the page cache (``--cache cold``, the default:
   ``posix_fadvise(DONTNEED)``) so it reads from disk as an export of a run's checkpoint written long before
   would. The baseline, in turn with it: a copy of the random HF checkpoint (the same tensors' bytes, same
   cold cache, files synced as the export syncs its own): what the disk alone costs. Every export is then
   compared with the HF checkpoint tensor by tensor, bit for bit (a trainer in fp32 on CPU: with the source
   cast to fp32, exactly), and removed.
4. A dated report ``<date>_export_time_<shape>_l<layers>_<hardware>.json`` under ``--out``: every repetition,
   median and spread, GB exported (1e9 bytes) and GB/s, the trainer's load and save, the environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _bench_common import device_name, dump, slug, spread, topic, torchrun  # noqa: E402
from _random_checkpoint import SHAPES, config, make_checkpoint, tensor_shapes  # noqa: E402

GOAL_S = 120.0
"""Issue 55's goal: ``mrl export`` of the 30B-A3B slice on one GPU host in under 2 minutes."""
HEADROOM_GIB = 5.0
"""GPU memory left beside the model states (CUDA context, kernels' workspaces, allocator slack)."""
INDEX = "model.safetensors.index.json"


# -- the trainer's GPU memory and the disk -----------------------------------------------------------

def states_estimate(hf: str, *, dtype: str, states: str, pcfg, nproc: int) -> dict:
    """GiB on the most loaded trainer GPU (layout ``pcfg`` on ``nproc`` ranks) for ``--optimizer-state`` none
    (the weights, the fp32 grad buffer and the fp32 master copies megatron's optimizer makes at once) and adam
    (all model states of ``mrl.megatron.memory`` plus the zero grads the dummy Adam step allocates), and the
    checkpoint's bytes on disk for each (Adam's moments are written in fp32 whatever they are kept in; the
    master: fp32, or the int16 remainders of bf16 weights)."""
    from mrl.config.schema import DType, ModelConfig
    from mrl.megatron.memory import model_state_bytes
    from mrl.models import get_bridge

    bridge = get_bridge(hf)
    vp = bridge.padded_vocab(ModelConfig().vocab_divisible_by, pcfg.tp)
    est = model_state_bytes(bridge, pcfg, dtype=DType(dtype), optimizer_states_dtype=DType(states), padded_vocab=vp,
                            world_size=nproc)
    opt = est["dense_optimizer"] + est["expert_optimizer"]
    wb = 2 if dtype == "bf16" else 4
    master = 4 * opt if (states == "fp32" and dtype == "bf16") else 0
    none = est["weights_bytes"] + est["grads_bytes"] + master
    adam = est["total_bytes"] + opt * (4 if states == "fp32" else wb)
    params = est["dense_params"] + est["expert_params"]
    disk_master = 2 if (states == "bf16" and dtype == "bf16") else 4
    return {"none_gib": none / 2**30, "adam_gib": adam / 2**30, "params_rank": params,
            "checkpoint_bytes": {"none": params * wb * nproc, "adam": (params * wb + opt * (8 + disk_master)) * nproc}}


def gpu_memory_gib() -> float:
    """Total memory of the first visible GPU, asked in a child process (no CUDA context left in this one)."""
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
                       capture_output=True, text=True, check=True)
    return int(r.stdout.strip()) / 2**30


def estimator(a):
    """``states_estimate`` of a Qwen3-MoE shape ``kw`` (a dict of ``_random_checkpoint.SHAPES``) with the run's
    dtype, optimizer states and trainer layout, from its config alone."""
    import tempfile

    from mrl.config.load import compose

    pcfg = compose([f"parallel={a.parallel}"]).parallel

    def estimate(kw: dict) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            config(kw).save_pretrained(tmp)
            return states_estimate(tmp, dtype=a.dtype, states=a.optimizer_states, pcfg=pcfg, nproc=a.nproc)
    return estimate


def choose_optimizer_state(a, kw: dict, gpu: bool) -> tuple[str, str, dict | None]:
    """(adam | none, why, the estimate) for ``--optimizer-state`` and the model of shape ``kw``; a SystemExit
    naming the figures where the one asked for cannot fit."""
    if not gpu:
        return ("adam" if a.optimizer_state == "auto" else a.optimizer_state), "CPU run: no GPU memory limit", None
    estimate = estimator(a)
    est = estimate(kw)
    total = gpu_memory_gib()
    room = total - HEADROOM_GIB
    est["gpu_gib"], est["headroom_gib"] = total, HEADROOM_GIB
    too_big = (f"the trainer needs about {est['none_gib']:.1f} GiB a GPU without Adam's states (weights, fp32 grads"
               f"{', fp32 masters' if a.optimizer_states == 'fp32' and a.dtype == 'bf16' else ''}), more than this "
               f"{total:.1f} GiB GPU leaves ({HEADROOM_GIB:g} GiB kept free): fewer --layers, or more --nproc with "
               "--parallel")
    if a.optimizer_state == "none":
        if est["none_gib"] > room:
            raise SystemExit(f"--optimizer-state none: {too_big}")
        return "none", "asked (--optimizer-state none)", est
    if est["adam_gib"] <= room:
        return "adam", f"fits: about {est['adam_gib']:.1f} of {total:.1f} GiB a GPU", est
    n = next((n for n in range(kw["num_hidden_layers"] - 1, 0, -1)
              if estimate(dict(kw, num_hidden_layers=n))["adam_gib"] <= room), 0)
    est["largest_adam_layers"] = n
    why = (f"with Adam's states the trainer needs about {est['adam_gib']:.1f} GiB a GPU, more than this {total:.1f} "
           f"GiB GPU leaves ({HEADROOM_GIB:g} GiB kept free); the largest slice of this shape that fits has {n} "
           "layers")
    if a.optimizer_state == "adam":
        raise SystemExit(f"--optimizer-state adam: {why} (--layers {n}, or --optimizer-state none)")
    if est["none_gib"] > room:
        raise SystemExit(f"--optimizer-state auto: {too_big}")
    return "none", why + "; saved without them", est


def check_disk(out: str, need: int) -> None:
    free = shutil.disk_usage(out).free
    if free < need:
        raise SystemExit(f"--out {out}: {free / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB (the "
                         "HF checkpoint, the trainer checkpoint and one export at a time): point --out or "
                         "--model-dir elsewhere")


# -- files --------------------------------------------------------------------------------------------

def weight_map(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file of the checkpoint directory ``path``."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def tensor_bytes(path: str) -> int:
    with open(os.path.join(path, INDEX)) as f:
        return int(json.load(f)["metadata"]["total_size"])


def evict(path: str) -> None:
    """Drop the files under ``path`` from the page cache (written back first): the next read goes to disk."""
    os.sync()
    for root, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def same_bits(x, y) -> bool:
    """``x`` and ``y`` hold the same bits (``y`` cast to ``x``'s dtype first: the exact widening a trainer in a
    wider dtype than its source did)."""
    import torch

    if x.shape != y.shape:
        return False
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    it = getattr(torch, _INT[x.element_size()])
    return torch.equal(x.contiguous().view(it), y.contiguous().view(it))


def compare(src: str, out: str) -> dict:
    """The export ``out`` against the HF checkpoint ``src``, tensor by tensor (one at a time from each file):
    names, shapes and bits; ``equal`` when every one matches."""
    from safetensors import safe_open

    want, got = weight_map(src), weight_map(out)
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    handles: dict[str, object] = {}

    def tensor(root, files, name):
        path = os.path.join(root, files[name])
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    bad, dtypes, n, nbytes = [], set(), 0, 0
    for name in sorted(set(got) & set(want), key=lambda k: (got[k], k)):
        x, y = tensor(out, got, name), tensor(src, want, name)
        dtypes.add(f"{str(y.dtype).removeprefix('torch.')}->{str(x.dtype).removeprefix('torch.')}")
        if not same_bits(x, y):
            bad.append(name)
        n += 1
        nbytes += x.numel() * x.element_size()
    return {"equal": not (missing or unexpected or bad), "tensors": n, "bytes": nbytes, "dtypes": sorted(dtypes),
            "missing": missing[:10], "unexpected": unexpected[:10], "mismatched": bad[:10],
            "counts": {"missing": len(missing), "unexpected": len(unexpected), "mismatched": len(bad)}}


# -- the timed runs -----------------------------------------------------------------------------------

def run_export(ckpt: str, dst: str, log: str, extra: list[str], timeout: float) -> dict:
    """``python -m mrl export ckpt dst``: wall seconds from its start to its exit, split where its output says:
    ``launcher_s`` until the launcher has checked its arguments and starts the ranks, ``ranks_s`` from then
    until the export reports its model written, of which ``writing_s`` (the export's own figure: from the
    weights loaded to the directory published; the rest is the ranks' start, the model's build and its
    load from the checkpoint), and ``exit_s`` to the process's exit. The output goes to ``log``, each line
    with its second."""
    import threading

    from mrl.process import kill_tree

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mrl", "export", ckpt, dst, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)

    def read():
        with open(log, "w") as f:
            for line in proc.stdout:
                t = time.perf_counter() - t0
                for key, prefix in (("exporting", "[mrl] exporting "), ("wrote", "[mrl] wrote the ")):
                    if line.startswith(prefix):
                        marks.setdefault(key, t)
                f.write(f"{t:8.2f} {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise SystemExit(f"mrl export timed out after {timeout:g} s (--timeout); its output: {log}")
    wall = time.perf_counter() - t0
    reader.join()
    text = open(log).read()
    if rc:
        raise SystemExit(f"mrl export failed ({rc}):\n{text[-4000:]}")
    m = re.search(r"\[mrl\] wrote the model of .* in ([0-9.e+-]+) s", text)
    row = {"wall_s": wall, "writing_s": float(m.group(1)) if m else None}
    if "exporting" in marks and "wrote" in marks:
        row.update(launcher_s=marks["exporting"], ranks_s=marks["wrote"] - marks["exporting"],
                   exit_s=wall - marks["wrote"])
    return row


def copy_baseline(src: str, dst: str) -> float:
    """Seconds to copy the HF checkpoint ``src`` to ``dst`` with every file synced, as an export publishes."""
    t0 = time.perf_counter()
    os.makedirs(dst)
    for n in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    for n in os.listdir(dst):
        fd = os.open(os.path.join(dst, n), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def train(a, hf: str, run: str, state: str) -> dict:
    """The trainer checkpoint ``run/checkpoints/step_0`` (reused when a complete one with these settings is
    there) and the trainer's record."""
    from mrl.process import LOOP_STATE_FILE

    record = os.path.join(run, "trainer.json")
    if os.path.isfile(os.path.join(run, "checkpoints", "step_0", LOOP_STATE_FILE)) and os.path.isfile(record):
        with open(record) as f:
            return dict(json.load(f), reused=True)
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    print(f"[bench] trainer: {hf} -> {run}/checkpoints/step_0 (optimizer state: {state})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    torchrun(a.nproc, "_export_trainer.py", ["--hf", hf, "--run-dir", run, "--dtype", a.dtype, "--optimizer-states",
                                             a.optimizer_states, "--optimizer-state", state, "--parallel", a.parallel,
                                             "--out", record], timeout=a.timeout)
    with open(record) as f:
        rec = json.load(f)
    rec["process_s"] = time.perf_counter() - t0
    with open(record, "w") as f:
        json.dump(rec, f)
    return dict(rec, reused=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="qwen3_30b_a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    ap.add_argument("--out", required=True, help="the run's files and its report")
    ap.add_argument("--model-dir", default=None, help="keep the HF checkpoint here (default: --out)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="the HF checkpoint's shard size")
    ap.add_argument("--cpu", action="store_true", help="trainer and export on the CPU (fp32) even with CUDA present")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="model.dtype (default: bf16 GPU, fp32 CPU)")
    ap.add_argument("--optimizer-states", choices=["bf16", "fp32"], default=None,
                    help="train.optimizer_states_dtype (default: bf16 on GPU, needs Transformer Engine; fp32 CPU)")
    ap.add_argument("--optimizer-state", choices=["auto", "adam", "none"], default="auto",
                    help="Adam's states in the checkpoint (auto: where they fit the GPU)")
    ap.add_argument("--nproc", type=int, default=1, help="trainer ranks")
    ap.add_argument("--parallel", default="tp1", help="the trainer's conf/parallel preset")
    ap.add_argument("--export-args", default="", help="more arguments of mrl export, e.g. '--ep 2'")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", choices=["cold", "warm"], default="cold",
                    help="cold: the checkpoint and the HF source out of the page cache before each run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the copy baseline")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the trainer and for each export")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error("--reps: at least 1")
    if a.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    gpu = torch.cuda.is_available()
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    a.optimizer_states = a.optimizer_states or ("bf16" if gpu else "fp32")
    if gpu and a.optimizer_states == "bf16" and importlib.util.find_spec("transformer_engine") is None:
        raise SystemExit("--optimizer-states bf16 (the default on a GPU) needs Transformer Engine's FusedAdam, which "
                         "is not on the path (scripts/gpu: source STACK/env.sh te), or --optimizer-states fp32")
    layers = a.layers or SHAPES[a.shape]["num_hidden_layers"]
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    hf = os.path.join(os.path.abspath(a.model_dir or out), f"model_{a.shape}_l{layers}")
    kw = dict(SHAPES[a.shape], num_hidden_layers=layers)
    state, why, est = choose_optimizer_state(a, kw, gpu)
    print(f"[bench] optimizer state in the checkpoint: {state} ({why})", file=sys.stderr, flush=True)
    topic("export_time")  # a name without a report folder fails now, not after the run
    run = os.path.join(out, f"run_{a.shape}_l{layers}_{a.dtype}_{a.optimizer_states}_{state}_{a.parallel}_{a.nproc}")
    if est is not None:  # the HF checkpoint (unless kept), the trainer's (unless kept) and one export
        from mrl.process import LOOP_STATE_FILE

        hf_bytes = 2 * sum(math.prod(shape) for _, shape in tensor_shapes(kw))
        need = (0 if os.path.isfile(os.path.join(hf, "config.json")) else hf_bytes) + 2 * hf_bytes
        if not os.path.isfile(os.path.join(run, "checkpoints", "step_0", LOOP_STATE_FILE)):
            need += est["checkpoint_bytes"][state]
        check_disk(out, int(need * 1.05))

    t0 = time.perf_counter()
    hf_reused = os.path.isfile(os.path.join(hf, "config.json"))
    make_checkpoint(hf, a.shape, layers, shard_gb=a.shard_gb)
    make_s = time.perf_counter() - t0
    trainer = train(a, hf, run, state)
    ckpt = os.path.join(run, "checkpoints", "step_0")
    extra = shlex.split(a.export_args) + (["--cpu"] if a.cpu else [])
    size = tensor_bytes(hf)

    rows = []
    for i in range(a.reps):
        dst, base = os.path.join(out, f"export_{i}"), os.path.join(out, f"copy_{i}")
        for d in (dst, dst + ".partial", base):
            shutil.rmtree(d, ignore_errors=True)
        row = {"rep": i}
        # the baseline and the export take turns at going first
        for side in (("copy", "export") if i % 2 == 0 else ("export", "copy")):
            if side == "copy" and a.no_baseline:
                continue
            if a.cache == "cold":
                evict(ckpt if side == "export" else hf)
            if side == "copy":
                row["copy_s"] = copy_baseline(hf, base)
                shutil.rmtree(base)
            else:
                row.update(run_export(ckpt, dst, os.path.join(out, f"export_{i}.log"), extra, a.timeout))
        row["bytes"] = tensor_bytes(dst)
        row["gb_per_s"] = row["bytes"] / 1e9 / row["wall_s"]
        t1 = time.perf_counter()
        row["check"] = compare(hf, dst)
        row["check_s"] = time.perf_counter() - t1
        shutil.rmtree(dst)
        rows.append(row)
        nan = float("nan")
        print(f"[bench] rep {i}: mrl export {row['wall_s']:.1f} s ({row['gb_per_s']:.2f} GB/s; launcher "
              f"{row.get('launcher_s', nan):.1f} s, ranks {row.get('ranks_s', nan):.1f} s of which writing "
              f"{row['writing_s'] or nan:.1f} s, exit {row.get('exit_s', nan):.1f} s), copy "
              f"{row.get('copy_s', nan):.1f} s, round trip {'bit for bit' if row['check']['equal'] else 'DIFFERS'}",
              file=sys.stderr, flush=True)

    walls = [r["wall_s"] for r in rows]
    wall = spread(walls)
    result = {
        "bench": "export_time", "args": vars(a),
        "model": {"shape": a.shape, "layers": layers, "hf_path": hf, "hf_tensor_bytes": size,
                  "hf_gb": size / 1e9, "made_s": make_s, "reused": hf_reused},
        "trainer": dict(trainer, optimizer_state=state, optimizer_state_why=why, estimate=est),
        "cache": a.cache,
        "reps": rows,
        "export_wall_s": wall,
        "export_gb": rows[0]["bytes"] / 1e9,
        "export_gb_per_s_median": rows[0]["bytes"] / 1e9 / wall["median"],
        "copy_baseline_s": spread([r["copy_s"] for r in rows]) if not a.no_baseline else None,
        # the median of each repetition's export / copy: a drift of the disk between repetitions hits both
        "export_vs_copy_median": (statistics.median(r["wall_s"] / r["copy_s"] for r in rows)
                                  if not a.no_baseline else None),
        "round_trip_bitwise": all(r["check"]["equal"] for r in rows),
        "goal": {"what": "mrl export of the 30B-A3B slice on one GPU host under 2 minutes (issue 55)", "max_s": GOAL_S,
                 "met": wall["median"] <= GOAL_S if a.shape == "qwen3_30b_a3b" and gpu else None},
    }
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    name = f"{a.shape}_l{layers}_{state}_{slug(device_name())}"
    dump(result, os.path.join(out, f"{date}_export_time_{name}.json"), name=f"export_time_{name}")
    if not result["round_trip_bitwise"]:
        raise SystemExit("the export differs from the checkpoint it started from: see the report's reps[].check")


if __name__ == "__main__":
    main()
