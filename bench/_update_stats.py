"""Per-bucket figures of an engine's weight updates, for ``bench/gpu_loop.py --sync-profile``: the engine patches'
``watch`` (``mrl.engine.server.patches.UpdateWatch``), installed by the bench's engine shim
(``bench/_engine_shim``, ``BENCH_SYNC_STATS_DIR``) inside the engines the bench starts.

Each weight update appends one JSON line to ``tp{rank}.jsonl`` in the directory: when the update reached the
model runner (``entered_at``, wall clock) and per bucket the host seconds waiting for a free buffer, receiving
and loading, the load's path and copy counts, and on GPUs the device seconds of the receive and of the load
(CUDA events, read with one host sync after the update's last bucket). A file ``profile_next.tp{rank}`` there
runs that rank's next update under ``torch.profiler`` (trace and top ops written next to it, the file
removed); while a file ``STATS_OFF`` is there, updates run without any of it (the CUDA events and the host sync
before the answer are not free).
"""

from __future__ import annotations

import json
import os
import sys
import time

from mrl.engine.server.patches import UpdateWatch
from mrl.engine.server.replayed_load import bucket_nbytes

STATS_OFF = "stats_off"


class Stats:
    """Per-bucket figures of one update; inert without a directory."""

    def __init__(self, runner, out_dir: str | None):
        self.dir, self.rank = out_dir, int(getattr(runner, "tp_rank", 0) or 0)
        self.cuda = str(getattr(runner, "device", "cpu")).startswith("cuda")
        self.buckets: list[dict] = []
        self.entered_at = time.time()  # wall clock: against the trainer's post, the request's way in

    def start(self, group, dtypes, shapes) -> None:
        """A new bucket's record; ``mark`` closes each of its phases."""
        if self.dir is None:
            return
        self.buckets.append({"group": group, "bytes": bucket_nbytes(dtypes, shapes), "tensors": len(shapes),
                             "_t": 0.0, "_ev": []})
        self.mark(None)

    def mark(self, phase: str | None, stream=None, info: dict | None = None) -> None:
        """Host seconds since the previous mark, as ``{phase}_s``; on CUDA an event too (device seconds), on
        ``stream`` (default: the current one)."""
        if self.dir is None or not self.buckets:
            return
        b = self.buckets[-1]
        now = time.perf_counter()
        if phase is not None:
            b[f"{phase}_s"] = now - b["_t"]
        b["_t"] = now
        b.update(info or {})
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            b["_ev"].append((phase, ev))

    def write(self) -> None:
        if self.dir is None or not self.buckets:
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        for b in self.buckets:
            evs = b.pop("_ev")
            for (_, a), (phase, z) in zip(evs, evs[1:]):
                b[f"gpu_{phase}_s"] = a.elapsed_time(z) / 1e3
            b.pop("_t")
        with open(os.path.join(self.dir, f"tp{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"entered_at": self.entered_at, "buckets": self.buckets}) + "\n")


class UpdateStats(UpdateWatch):
    """The engine patches' ``watch``: each update's ``Stats`` (written at its end) and, when asked for, a
    torch.profiler around it."""

    def __init__(self, out_dir: str):
        self.dir = out_dir
        self.now: Stats | None = None

    def update(self, runner):
        return _Observed(self, runner)

    def bucket(self, key, dtypes, shapes) -> None:
        if self.now is not None:
            self.now.start(key, dtypes, shapes)

    def mark(self, phase, stream=None, **info) -> None:
        if self.now is not None:
            self.now.mark(phase, stream, info)


class _Observed:
    def __init__(self, watch: UpdateStats, runner):
        d = watch.dir
        self.watch, self.stats = watch, Stats(runner, None if os.path.exists(os.path.join(d, STATS_OFF)) else d)
        self.prof = None

    def __enter__(self) -> Stats:
        s = self.watch.now = self.stats
        ask = os.path.join(s.dir, f"profile_next.tp{s.rank}") if s.dir else None
        if ask and os.path.exists(ask):
            os.remove(ask)
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.__enter__()
        return s

    def __exit__(self, *exc) -> None:
        s, self.watch.now = self.stats, None
        try:  # figures for a benchmark: never the reason an update fails
            if self.prof is not None:
                self.prof.__exit__(*exc)
                self.prof.export_chrome_trace(os.path.join(s.dir, f"engine_tp{s.rank}_trace.json"))
                with open(os.path.join(s.dir, f"engine_tp{s.rank}_ops.json"), "w") as f:
                    json.dump(top_ops(self.prof), f)
            s.write()
        except Exception as e:
            print(f"bench: weight update figures not written to {s.dir}: {e}", file=sys.stderr, flush=True)


def top_ops(prof, n: int = 25) -> list[dict]:
    """The profile's ops by self time on the device (else on the host): name, calls, host and device us."""
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) or 0
        rows.append({"op": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total, "self_device_us": dev})
    rows.sort(key=lambda r: (-r["self_device_us"], -r["self_cpu_us"]))
    return rows[:n]
