"""Loaded by the engines ``bench/gpu_loop.py`` starts: their ``PYTHONPATH`` puts this folder before mrl's engine
shim (``mrl/engine/server/shim``, or CPU mode's pyshim), which this file shadows and runs first, so mrl's
patches are registered as in any engine. Then, from the environment, what only a benchmark asks of an engine:

- ``BENCH_SYNC_STATS_DIR``: per-bucket figures of every weight update (``bench/_update_stats.py``, installed as
  the engine patches' ``watch``);
- ``BENCH_BASELINE``: comma-separated mrl patches left out, for the baselines they are measured against:
  ``compact_routes`` (SGLang's own int32 routes), ``replayed_load`` (every bucket through the model's
  ``load_weights``, one request per bucket), ``load_stream`` (a batched update's copies on the receiving stream,
  after each receive);
- ``BENCH_CPU_ENGINE=1``: ``torch.cuda.synchronize`` does nothing. SGLang's ``/weights_checker`` calls it around
  its hashing, which fails in a forked CPU-mode scheduler ("Cannot re-initialize CUDA"); with no GPU there is
  nothing to wait for, so the bench's bitwise check of a sync runs on CPU with the same code as on GPUs.
"""
import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINES = ("compact_routes", "replayed_load", "load_stream")


def _run_shadowed() -> None:
    # off the path first: mrl's GPU shim runs the sitecustomize it shadows in turn, which must not be this one
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(os.path.dirname(HERE), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leave_out(patches, baseline: set[str]) -> None:
    by_target = {patches.ROUTES_MODULE: "compact_routes", patches.RUNNER_MODULE: "replayed_load"}
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not (isinstance(f, patches.PatchOnImport) and by_target.get(f.target) in baseline)]
    if "load_stream" in baseline:
        patches.load_stream = lambda runner: None


_run_shadowed()
if os.environ.get("BENCH_CPU_ENGINE") == "1":
    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None
_baseline = {b for b in os.environ.get("BENCH_BASELINE", "").split(",") if b}
if _baseline - set(BASELINES):
    print(f"bench: unknown BENCH_BASELINE {sorted(_baseline - set(BASELINES))} (known: {BASELINES})",
          file=sys.stderr, flush=True)
if _baseline or os.environ.get("BENCH_SYNC_STATS_DIR"):
    from mrl.engine.server import patches

    _leave_out(patches, _baseline)
    if os.environ.get("BENCH_SYNC_STATS_DIR"):
        patches.watch = _bench_module("_update_stats").UpdateStats(os.environ["BENCH_SYNC_STATS_DIR"])
