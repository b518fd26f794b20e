"""torchrun worker of bench/gpu_loop.py: weight syncs into a live SGLang engine vs a raw broadcast.

    torchrun --nproc-per-node 1 bench/_live_sync_worker.py --hf DIR --dtype bf16 --engine URL@TP \\
        --engine-device cuda:1 --reps 5 --out sync.json

The trainer side is mrl's real one: megatron model (any layout), params in megatron's DDP buffer as in
training, ``FullWeightChannel`` (pause, flush, streamed buckets over NCCL/gloo, version stamp, continue). The
raw baseline broadcasts the same number of bytes as one buffer from trainer rank 0 to a plain torch
process on the engine's device (``--engine-device``), over a group built the same way; sync and raw
repetitions alternate after one warm-up of each. A receiver posts each broadcast only when the trainer is
about to send (a line on its stdin): a receive posted early is a kernel that waits on the engine's GPU,
beside the engine's own receives during the sync. After the syncs: the engine's teacher-forced logprobs
of a probe against the trainer's, and a bitwise check of sampled tensors read back from the engine
(SGLang's ``/weights_checker`` checksums per engine TP rank, against the trainer's export cut the
way each rank holds it: ``bench/_engine_shards.py``; the first and last layer in full, experts
included).

``--transport tensor``: the engine shares the trainer's GPU and takes each bucket as CUDA IPC handles; the
raw baseline is then a device-to-device copy of the same bytes on that GPU. ``--fp8-engine``: a second
engine, serving the block-FP8 export, synced in each repetition right after the bf16 one (FP8 vs bf16
sync seconds on the same host state) and bitwise-checked against the trainer's quantization. Before the
syncs the trainer's weights move by 1% of each tensor's spread, so that the engines' checkpoint weights
are stale and the bitwise checks see the syncs' bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from mrl.config.schema import WeightTransport
from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron import compat
from mrl.megatron.forward import forward_logits, token_logprobs
from mrl.megatron.optim import wrap_ddp
from mrl.megatron.parallel import destroy
from mrl.megatron.weights import gather_hf, local_params, maps_by_name
from _bench_common import engine_call
from mrl.sglang.endpoint import free_port
from _engine_shards import engine_shard, expert_layouts, fp8_checker_view, sampled_names
from _update_stats import STATS_OFF, top_ops
from mrl.weight_sync.group import create_sender_group, destroy_sender_group
from mrl.weight_sync.factory import make_transport
from mrl.weight_sync.executor import BucketExecutor, PushWatch
from mrl.weight_sync.full import FullWeightChannel
from mrl.sglang.endpoint import EngineEndpoint

HERE = os.path.dirname(os.path.abspath(__file__))

RECEIVER = r"""
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world
addr, name, device = sys.argv[1], sys.argv[3], sys.argv[6]
port, nbytes, reps, rank, world = (int(sys.argv[i]) for i in (2, 4, 5, 7, 8))
backend = "nccl" if device.startswith("cuda") else "gloo"
if backend == "nccl":
    torch.cuda.set_device(torch.device(device))
store = PrefixStore(name, TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=300)))
pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), store, group_name=name,
                                  timeout=timedelta(seconds=300))
_world.pg_group_ranks[pg] = {i: i for i in range(world)}
buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
for _ in range(reps):
    sys.stdin.readline()  # posted only when the trainer sends: a pending receive would spin on the engine's GPU
    dist.broadcast(buf, src=0, group=pg)
    if backend == "nccl":
        torch.cuda.synchronize()
print("raw receiver done", flush=True)
"""




class BucketTimings(PushWatch):
    """Host seconds per bucket step of every push (the executor's ``watch``): ``pushes`` holds a list of rows
    per push, one per bucket step and a last one for the settling after them; on the controller that last row
    also holds ``posted_at``, when the bucket requests left (wall clock, for the engine's side of the same sync)."""

    def __init__(self):
        self.pushes: list[list[dict]] = []
        self.row: dict = {}
        self.t = time.perf_counter()
        self.posted_at = 0.0

    def begin(self) -> None:
        self.pushes.append([])
        self.row, self.t = {}, time.perf_counter()

    def bucket(self, step) -> None:
        self.row = ({"bucket": step.bucket.index, "sender": step.bucket.sender, "in_place": step.in_place,
                     "gathers": len(step.gathers), "bytes": 0 if step.flat is None else step.flat.numel()}
                    if step is not None else {"bucket": None})
        self.pushes[-1].append(self.row)
        self.t = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.row[f"{phase}_s"] = now - self.t
        self.t = now
        if phase == "engine_answers":
            self.row["posted_at"] = self.posted_at

    def posted(self) -> None:
        self.posted_at = time.time()


@contextlib.contextmanager
def one_request_per_bucket(executor: BucketExecutor):
    """The comparison of ``--compare-per-bucket``: the engines' announcement that they take every bucket of a
    sync in one request is hidden from the executor's clients meanwhile, so each bucket goes in a request."""
    kept = [(c, set(c.batched_groups)) for c in executor.clients]
    for c, _ in kept:
        c.batched_groups.clear()
    try:
        yield
    finally:
        for c, groups in kept:
            c.batched_groups |= groups


def _probe_logprobs(url: str, probe: list[int]) -> list[float]:
    async def fn(c):
        out = await c.generate(probe, {"max_new_tokens": 1, "temperature": 0.0}, rid=f"probe-{time.time_ns()}",
                               logprob_start_len=0)
        return out.input_logprobs[1:]
    return engine_call(url, fn)


def _checksums(url: str) -> list[dict[str, str]]:
    async def fn(c):
        return await c.weight_checksums()
    return engine_call(url, fn)


def _export_sampled(model, layout, bridge, padded_vocab: int) -> dict[str, torch.Tensor] | None:
    """The trainer's HF tensors of the layers the bitwise check samples (the first and the last) and
    of the embeddings, final norm and head, on rank 0: the whole model would be gathered as pickled
    objects through one collective, too large at the 30B shapes."""
    keep = {0, bridge.num_layers - 1}
    maps = maps_by_name(bridge, padded_vocab)
    items = []
    for lp in local_params(model, layout):
        if bridge.tied_embeddings and lp.global_name == "output_layer.weight":
            continue  # the embedding's copy
        layer = re.search(r"layers\.(\d+)\.", lp.global_name)
        if layer is None or int(layer.group(1)) in keep:
            items.append((lp, maps[lp.global_name]))
    return gather_hf(items, layout, 0)


def _bitwise(url: str, hf: dict[str, torch.Tensor], bridge, dtype: torch.dtype, devices: list[str],
             tp: int, fp8: bool = False) -> dict:
    """Sampled engine tensors (experts included), rank by rank, against the trainer's export cut the way
    the engine holds it: SGLang's own hash of each on both sides. ``{name: {tp_rank: bool | reason}}``
    (experts: the layout that matched, ``"tp"`` or ``"padded"``, or False) plus ``all_equal`` over every
    compared tensor. ``fp8``: the engine serves block FP8; the export is quantized as the FP8 sync does
    (``quantize_checkpoint``) and each FP8 weight compared as SGLang's checker reports it, dequantized
    with its scales (``fp8_checker_view``)."""
    from sglang.srt.managers.mm_utils import tensor_hash  # the engine's own hash function

    from mrl.weight_sync.fp8 import quantize_checkpoint

    scales = {}
    if fp8:
        hf = quantize_checkpoint(hf, dtype)
        scales = {k.removesuffix("_scale_inv"): v for k, v in hf.items() if k.endswith("_scale_inv")}
    sums = _checksums(url)
    if len(sums) != tp:
        return {"error": f"{len(sums)} checksum ranks from an engine of tp={tp}"}
    kw = dict(num_experts=bridge.num_experts, kv_heads=bridge.num_query_groups,
              head_dim=getattr(bridge.hf_config, "head_dim", None)
              or bridge.hf_config.hidden_size // bridge.hf_config.num_attention_heads)
    out: dict = {}
    compared = equal = 0
    for name in sampled_names(bridge.num_layers):
        out[name] = {}
        for r in range(tp):
            if name not in sums[r]:
                out[name][r] = "absent from the engine"
                continue
            m = re.match(r"(model\.layers\.\d+)\.(mlp\.experts\.w(13|2)_weight)$", name)

            def cut(src):  # every candidate layout exact: the engine holds one of them byte for byte, or fails
                if m:
                    return expert_layouts(src, m.group(1), m.group(2), tp, r, kw["num_experts"])
                return {"tp": engine_shard(src, name, tp, r, **kw)}

            cands = cut(hf)
            if cands["tp"] is None:
                out[name][r] = "not derivable (vocabulary padding)"
                continue
            # SGLang hashes GPU tensors with a triton kernel and CPU ones with sha256: hash where the engine
            # rank does (any GPU gives the same hash; this rank's own, so the kernel runs on its device)
            dev = compat.DEVICE if devices[r].startswith("cuda") else "cpu"
            if cands["tp"].dtype == torch.float8_e4m3fn:
                s = cut(scales)
                cands = {k: fp8_checker_view(t.to(dev), s[k].to(dev)) for k, t in cands.items()}
            else:
                cands = {k: t.to(dtype).to(dev) for k, t in cands.items()}
            hit = [k for k, t in cands.items() if f"{tensor_hash(t.contiguous()):016x}" == sums[r][name]]
            out[name][r] = hit[0] if m and hit else bool(hit)  # experts: which layout matched
            compared += 1
            equal += bool(hit)
    out["compared"], out["equal"] = compared, equal
    out["all_equal"] = compared > 0 and compared == equal
    return out


def _medians(rows: list[list[dict]]) -> dict:
    """Per-bucket rows of several syncs (one list per sync, same steps in the same order) -> per step the
    median of every figure, and per sync the sum of each phase (median over syncs)."""
    if not rows:
        return {}
    steps = []
    for i in range(min(len(r) for r in rows)):
        same = [r[i] for r in rows]
        keys = [k for k in same[0] if isinstance(same[0][k], (int, float)) and not isinstance(same[0][k], bool)
                and not k.endswith("_at")]  # wall-clock stamps: paired per sync (_request_latency), not pooled
        steps.append({k: v for k, v in same[0].items() if k not in keys} |
                     {k: statistics.median(x.get(k, 0.0) for x in same) for k in keys})
    phases = sorted({k for r in rows for x in r for k in x if k.endswith("_s")})
    totals = {k: statistics.median(sum(x.get(k, 0.0) for x in r) for r in rows) for k in phases}
    return {"syncs": len(rows), "per_sync_total_s": totals, "per_bucket": steps}


def _request_latency(trainer: list[list[dict]], engine: list[dict]) -> dict:
    """Per measured sync, seconds from the trainer's post of the bucket request to the engine's model runner
    entering the update (same host, one wall clock): the request's way through SGLang's HTTP server,
    tokenizer manager and scheduler, during which the trainer's first broadcast waits."""
    posted = [rows[-1].get("posted_at") for rows in trainer if rows]
    lat = [e["entered_at"] - p for p, e in zip(posted, engine) if p and "entered_at" in e]
    if not lat or len(posted) != len(engine):  # unpaired (a per-bucket A/B run): nothing to say
        return {}
    return {"median": statistics.median(lat), "min": min(lat), "max": max(lat), "per_sync": lat}


def _profiled_sync(a, layout, executor, run_sync, engine_tp: int) -> dict | None:
    """Every rank: the instrumented syncs' per-bucket host seconds, then one more sync under torch.profiler
    (engine ranks too, asked through ``profile_next.tp{rank}`` files). Rank 0 returns the summary."""
    os.makedirs(a.profile_dir, exist_ok=True)
    me = layout.world_rank
    if me == 0:
        for r in range(engine_tp):
            open(os.path.join(a.profile_dir, f"profile_next.tp{r}"), "w").close()
    measured = executor.watch.pushes if isinstance(executor.watch, BucketTimings) else []
    executor.watch = BucketTimings()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if compat.HAS_CUDA else [])
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        seconds, push = run_sync()
    prof.export_chrome_trace(os.path.join(a.profile_dir, f"trainer_rank{me}_trace.json"))
    mine = {"rank": me, "measured": _medians(measured), "profiled_sync": {"sync_s": seconds, "push_s": push,
            "per_bucket": executor.watch.pushes[0] if executor.watch.pushes else []}, "top_ops": top_ops(prof)}
    executor.watch = PushWatch()
    box = [None] * layout.world_size
    dist.all_gather_object(box, mine)
    if me != 0:
        return None
    engine = {}
    for r in range(engine_tp):
        path = os.path.join(a.profile_dir, f"tp{r}.jsonl")
        if not os.path.exists(path):
            engine[f"tp{r}"] = {"error": f"no {path}: was the engine started with "
                                         f"BENCH_SYNC_STATS_DIR={a.profile_dir}?"}
            continue
        lines = [json.loads(x) for x in open(path)]
        batched = [x for x in lines if len(x["buckets"]) > 1] or lines  # per-bucket A/B requests: a bucket a line
        ops = os.path.join(a.profile_dir, f"engine_tp{r}_ops.json")
        engine[f"tp{r}"] = {"measured": _medians([x["buckets"] for x in batched[1:-1]]),
                            "profiled_update": batched[-1]["buckets"],
                            "request_latency_s": _request_latency(measured, batched[1:-1]),
                            "top_ops": json.load(open(ops)) if os.path.exists(ops) else None}
    return {"dir": a.profile_dir, "trainer": box, "engine": engine}


def main() -> int:
    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    ap.add_argument("--engine", required=True, help="url@tp")
    ap.add_argument("--engine-device", required=True,
                    help="the engine's devices (comma-separated, one per engine TP rank), for the raw receivers")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare-per-bucket", action="store_true",
                    help="each repetition also syncs with one update request per bucket (the engine takes a "
                         "sync's buckets in one request otherwise)")
    ap.add_argument("--profile-dir", default=None,
                    help="per-bucket host seconds on every trainer rank for every measured sync (and the engine's, "
                         "when it was started with BENCH_SYNC_STATS_DIR set to this directory), then one more sync "
                         "under torch.profiler on every trainer rank and engine TP rank; traces here, a summary "
                         "in the report")
    ap.add_argument("--transport", default="distributed", choices=["distributed", "tensor"],
                    help="tensor: CUDA IPC into an engine on the trainer's GPU (the raw baseline is then one "
                         "device-to-device copy of the same bytes on that GPU)")
    ap.add_argument("--fp8-engine", default=None,
                    help="url@tp of an engine serving the block-FP8 export: each repetition also syncs into it "
                         "(weights quantized on the trainer's GPU: weight_sync's FP8 path), bitwise-checked too")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    m = load_model(a)
    layout, bridge = m.layout, m.bridge
    model = wrap_ddp(m.model, m.cfg)  # params live in megatron's DDP buffer, as in training
    url, _, tp = a.engine.partition("@")
    sync_dtype = {"bf16": "bfloat16", "fp32": "float32"}[a.dtype]

    def channel(engine: str, fp8: bool = False):
        e_url, _, e_tp = engine.partition("@")
        engines = [EngineEndpoint(e_url, int(e_tp or 1))]
        transport, disk = make_transport(WeightTransport(a.transport), model=model, layout=layout, bridge=bridge,
                                         padded_vocab=m.padded_vocab, engines=engines,
                                         bucket_bytes=int(a.bucket_mb * (1 << 20)), export_dir=None,
                                         config_src=a.hf, dtype=sync_dtype, fp8=fp8)
        syncer = FullWeightChannel(transport, disk, layout, engines)
        syncer.connect()
        return transport, syncer

    gen = torch.Generator(device=compat.DEVICE).manual_seed(0)  # same seed on every rank: replicas stay equal
    with torch.no_grad():  # a training step's worth of change: the engines' checkpoint weights go stale
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.add_((noise * 0.01 * p.float().std()).to(p.dtype))
    transport, syncer = channel(a.engine)
    fp8_transport, fp8_syncer = channel(a.fp8_engine, fp8=True) if a.fp8_engine else (None, None)
    nbytes = transport.executor.plan.nbytes
    rank0 = layout.world_rank == 0
    ipc = a.transport == "tensor"

    raw_pg = receivers = None
    if rank0 and ipc:  # the engine's GPU is the trainer's: the floor is copying the bytes once on it
        raw_buf = torch.empty(min(nbytes, 1 << 30), dtype=torch.uint8, device=compat.DEVICE)  # in chunks
        raw_dst = torch.empty_like(raw_buf)
    elif rank0:
        port = free_port()
        name = f"raw-{os.getpid()}"
        # one receiver per engine rank: the bytes every engine GPU receives in a sync
        devices = a.engine_device.split(",")
        receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), name, str(nbytes),
                                       str(a.reps + 1), d, str(i + 1), str(len(devices) + 1)],
                                      stdin=subprocess.PIPE, text=True)
                     for i, d in enumerate(devices)]
        raw_pg = create_sender_group(master_address="127.0.0.1", master_port=port, world_size=len(devices) + 1,
                                     group_name=name, backend=compat.BACKEND)
        raw_buf = torch.empty(nbytes, dtype=torch.uint8, device=compat.DEVICE)

    def raw() -> float:
        dist.barrier()
        t = time.perf_counter()
        if rank0 and ipc:
            for at in range(0, nbytes, raw_buf.numel()):
                n = min(raw_buf.numel(), nbytes - at)
                raw_dst[:n].copy_(raw_buf[:n])
            torch.cuda.synchronize()
        elif rank0:
            for r in receivers:  # the receivers post their broadcast now, not during the sync before
                r.stdin.write("\n")
                r.stdin.flush()
            dist.broadcast(raw_buf, src=0, group=raw_pg)
            if compat.HAS_CUDA:
                torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t

    batched: list[str] = []
    phases: list[dict[str, float]] = []  # the sequence's phases (FullWeightChannel), per batched sync

    def sync(v: int, per_bucket: bool = False) -> tuple[float, float]:
        with one_request_per_bucket(transport.executor) if per_bucket else contextlib.nullcontext():
            dist.barrier()
            t = time.perf_counter()
            rep = syncer.sync(str(v))
            dist.barrier()
            seconds = time.perf_counter() - t
        if not per_bucket:
            batched[:] = rep.stamped_with_push
            phases.append(rep.phase_seconds)
        return seconds, rep.push_seconds

    fp8_s, fp8_push_s, fp8_bytes = [], [], []

    def sync_fp8(v: int) -> None:
        dist.barrier()
        t = time.perf_counter()
        rep = fp8_syncer.sync(str(v))
        dist.barrier()
        fp8_s.append(time.perf_counter() - t)
        fp8_push_s.append(rep.push_seconds)
        fp8_bytes.append(rep.bytes_sent)
        if rep.failed_engines:
            raise RuntimeError(f"FP8 sync {v} failed on {rep.failed_engines}")

    sync(1), raw()  # warm-up: the first NCCL broadcast on a group builds its communicator
    if fp8_syncer:
        sync_fp8(1)
        fp8_s.clear(), fp8_push_s.clear()
    if a.compare_per_bucket:
        sync(1, per_bucket=True)
    phases.clear()
    stats_off = os.path.join(a.profile_dir, STATS_OFF) if a.profile_dir else None
    if stats_off and rank0:  # the timed syncs run as a user's do; the instrumented ones come after them
        os.makedirs(a.profile_dir, exist_ok=True)
        open(stats_off, "w").close()
    sync_s, push_s, raw_s, pb_sync_s, pb_push_s = [], [], [], [], []
    for v in range(2, a.reps + 2):
        if a.compare_per_bucket:  # alternating: one request per bucket, all buckets in one, raw
            s, p = sync(v, per_bucket=True)
            pb_sync_s.append(s)
            pb_push_s.append(p)
        s, p = sync(v)
        sync_s.append(s)
        push_s.append(p)
        if fp8_syncer:  # bf16 and FP8 syncs alternate: the same host and GPU state for both
            sync_fp8(v)
        raw_s.append(raw())
    if rank0 and not ipc:
        for r in receivers:
            r.wait(timeout=120)
        destroy_sender_group(raw_pg)
    timed_phases = list(phases)
    profile = instrumented_s = None
    if a.profile_dir:  # after the timed syncs: neither the figures' cost nor the profiler's is in them
        if rank0:
            os.remove(stats_off)
        dist.barrier()
        transport.executor.watch = BucketTimings()
        instrumented_s = [sync(v)[0] for v in range(a.reps + 2, 2 * a.reps + 2)]
        profile = _profiled_sync(a, layout, transport.executor, lambda: sync(2 * a.reps + 2), int(tp or 1))

    # the engine follows the trainer: teacher-forced probe logprobs, and sampled tensors read back
    probe = torch.randint(3, bridge.vocab_size, (1, 64), generator=torch.Generator().manual_seed(7))
    logits = forward_logits(model.eval(), layout, probe.to(compat.DEVICE))
    mine = None
    if logits is not None:  # the last pipeline stage
        mine = token_logprobs(logits, probe.to(compat.DEVICE), bridge.vocab_size)[0].tolist()
    box = [None] * layout.world_size
    dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)
    hf = _export_sampled(model, layout, bridge, m.padded_vocab) or {}
    syncer.close()
    if fp8_syncer:
        fp8_syncer.close()
    if rank0:
        engine_lp = _probe_logprobs(url, probe[0].tolist())
        try:
            bitwise = _bitwise(url, hf, bridge, getattr(torch, sync_dtype), a.engine_device.split(","), int(tp or 1))
        except Exception as e:  # the figures above stay useful without it
            bitwise = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        fp8 = None
        if fp8_syncer:
            f_url, _, f_tp = a.fp8_engine.partition("@")
            try:
                f_bitwise = _bitwise(f_url, hf, bridge, getattr(torch, sync_dtype), a.engine_device.split(","),
                                     int(f_tp or 1), fp8=True)
            except Exception as e:
                f_bitwise = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            f_lp = _probe_logprobs(f_url, probe[0].tolist())
            per_rep = [f / b for f, b in zip(fp8_s, sync_s)]
            fp8 = {"bytes": fp8_bytes[-1], "sync_s": fp8_s, "push_s": fp8_push_s,
                   "sync_median_s": statistics.median(fp8_s), "fp8_vs_bf16_sync_per_rep": per_rep,
                   "fp8_vs_bf16_sync": statistics.median(per_rep), "fp8_vs_bf16_sync_min": min(per_rep),
                   "fp8_vs_bf16_sync_max": max(per_rep),
                   "sync_vs_raw": statistics.median(fp8_s) / statistics.median(raw_s),
                   "probe_max_abs_logprob_diff_vs_bf16_trainer": max(abs(x - y) for x, y in zip(f_lp, mine)),
                   "bitwise_sampled_tensors": f_bitwise}
        ratio = [s / r for s, r in zip(sync_s, raw_s)]
        report = {
            "bytes": nbytes, "sync_dtype": sync_dtype, "buckets": len(transport.executor.plan.buckets),
            "sync_s": sync_s, "push_s": push_s, "raw_s": raw_s, "sync_vs_raw_per_rep": ratio,
            "sync_median_s": statistics.median(sync_s), "raw_median_s": statistics.median(raw_s),
            "sync_vs_raw": statistics.median(sync_s) / statistics.median(raw_s),
            "push_vs_raw": statistics.median(push_s) / statistics.median(raw_s),
            "engine_tp": int(tp or 1), "trainer_ranks": layout.world_size,
            "sync_gb_per_s": nbytes / statistics.median(sync_s) / 1e9,
            "probe_max_abs_logprob_diff": max(abs(x - y) for x, y in zip(engine_lp, mine)),
            "probe_mean_abs_logprob_diff": sum(abs(x - y) for x, y in zip(engine_lp, mine)) / len(mine),
            "bitwise_sampled_tensors": bitwise,
            "host": socket.gethostname(),
            "batched_request_engines": batched,
            "sync_phases_s": timed_phases,
            "sync_phases_median_s": {k: statistics.median(p[k] for p in timed_phases) for k in timed_phases[0]}
            if timed_phases else {},
        }
        if profile is not None:
            report["profile"] = profile
            report["instrumented_sync_s"] = instrumented_s  # with the engine's per-bucket figures on
        if fp8 is not None:
            report["fp8"] = fp8
        report["transport"] = a.transport
        if pb_sync_s:
            report |= {"per_bucket_sync_s": pb_sync_s, "per_bucket_push_s": pb_push_s,
                       "per_bucket_sync_vs_raw": statistics.median(pb_sync_s) / statistics.median(raw_s),
                       "per_bucket_push_vs_raw": statistics.median(pb_push_s) / statistics.median(raw_s),
                       "batched_vs_per_bucket_per_rep": [b / p for b, p in zip(sync_s, pb_sync_s)]}
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}), flush=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
