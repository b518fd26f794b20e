"""Launch configurations for SGLang's triton fused-MoE kernel, tuned on the GPU that serves the model.

SGLang picks the kernel's tile sizes from a table per (experts, intermediate size, dtype, block shape, GPU
name) in a folder per triton version, and when the running triton has no table it takes another version's
table or its built-in default, and tiles tuned under one triton version need not be the best under
another. ``mrl tune-moe`` times the kernel for the model's expert shapes over a search space on this GPU,
under this triton, against SGLang's own choice, and writes the best configuration per token count in
SGLang's own file format and folder layout; ``engine.moe_kernel_configs`` points the engines at such a folder
(``merged_config_dir``: SGLang's own tables stay visible for every shape the folder does not cover).

    mrl tune-moe HF_DIR OUT [--dtype bf16|fp8] [--tp N] [--tokens 1 8 ... ] [--space full|quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
from typing import Callable, Iterable

FP8_BLOCK = (128, 128)
# token counts a table covers: SGLang uses the entry nearest to a batch's token count
TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)

# tile sizes that make sense for MoE GEMMs on Hopper; the quick space is the decode-relevant subset
_SPACE = {
    "full": dict(BLOCK_SIZE_M=(16, 32, 64, 128), BLOCK_SIZE_N=(32, 64, 128, 256), BLOCK_SIZE_K=(64, 128, 256),
                 GROUP_SIZE_M=(1, 16, 32, 64), num_warps=(4, 8), num_stages=(2, 3, 4, 5)),
    "quick": dict(BLOCK_SIZE_M=(16, 32, 64), BLOCK_SIZE_N=(64, 128, 256), BLOCK_SIZE_K=(64, 128),
                  GROUP_SIZE_M=(1, 16), num_warps=(4, 8), num_stages=(3, 4)),
}


def search_space(space: str = "full", block_shape: tuple[int, int] | None = None,
                 grid: dict[str, tuple[int, ...]] | None = None) -> list[dict]:
    """Every configuration of ``space`` (``grid``: values that replace the space's for some keys); with
    block-wise FP8 weights only tiles that lie within one scale block (SGLang's kernel reads one scale per
    tile: BLOCK_SIZE_N and BLOCK_SIZE_K must divide the block)."""
    if space not in _SPACE:
        raise ValueError(f"search space {space!r}: expected one of {sorted(_SPACE)}")
    unknown = sorted(set(grid or {}) - set(_SPACE[space]))
    if unknown:
        raise ValueError(f"--grid {unknown}: the kernel's parameters are {list(_SPACE[space])}")
    axes = dict(_SPACE[space]) | dict(grid or {})
    keys = list(axes)
    out = []
    for values in itertools.product(*(axes[k] for k in keys)):
        c = dict(zip(keys, values))
        if block_shape is not None and (block_shape[0] % c["BLOCK_SIZE_N"] or block_shape[1] % c["BLOCK_SIZE_K"]):
            continue
        out.append(c)
    return out


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """One engine rank's expert GEMMs: ``experts`` x (``hidden`` -> 2 x ``intermediate``) and back."""
    experts: int
    intermediate: int  # per tensor-parallel rank: the N of SGLang's table names
    hidden: int
    top_k: int

    @classmethod
    def from_hf(cls, hf_dir: str, tp: int = 1) -> "MoeShape":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(hf_dir)
        experts = next((getattr(c, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if getattr(c, k, None)), None)
        inter = getattr(c, "moe_intermediate_size", None)
        if not experts or not inter:
            raise ValueError(f"{hf_dir}: no routed experts in config.json (num_experts / moe_intermediate_size)")
        if inter % tp:
            raise ValueError(f"{hf_dir}: moe_intermediate_size {inter} is not divisible by tp {tp}")
        return cls(experts=int(experts), intermediate=inter // tp, hidden=c.hidden_size,
                   top_k=int(c.num_experts_per_tok))


def table_name(shape: MoeShape, fp8: bool) -> str:
    """The file SGLang looks up for ``shape`` on this GPU: its own ``get_config_file_name``."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import get_config_file_name

    return get_config_file_name(shape.experts, shape.intermediate, "fp8_w8a8" if fp8 else None,
                                list(FP8_BLOCK) if fp8 else None)


def tune(tokens: Iterable[int], configs: list[dict], time_fn: Callable[[int, dict], float],
         log: Callable[[str], None] = lambda s: None) -> tuple[dict[int, dict], dict]:
    """For each token count, the configuration with the lowest ``time_fn(tokens, config)`` (seconds; a
    configuration the kernel rejects raises and is skipped). Returns the table and every timing."""
    if not configs:
        raise ValueError("empty search space")
    table, timings = {}, {}
    for m in tokens:
        best, best_t, tried = None, float("inf"), {}
        for c in configs:
            key = json.dumps(c, sort_keys=True)
            try:
                t = time_fn(m, c)
            except Exception as e:  # e.g. out of shared memory for this tile size
                tried[key] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            tried[key] = t
            if t < best_t:
                best, best_t = c, t
        if best is None:
            raise RuntimeError(f"no configuration ran at {m} tokens: {next(iter(tried.values()))}")
        table[m], timings[m] = best, {"best_s": best_t, "tried": tried}
        log(f"[tune-moe] {m} tokens: {best_t * 1e6:.1f} us with {best}")
    return table, timings


def sglang_config_root() -> str:
    """The folder that holds SGLang's own tables (``configs/triton_X_Y_Z/``), found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed: no fused-MoE tables to merge with")
    root = os.path.join(list(spec.submodule_search_locations)[0], "srt", "layers", "moe", "moe_runner",
                        "triton_utils")
    if not os.path.isdir(os.path.join(root, "configs")):
        raise RuntimeError(f"{root}/configs: SGLang's fused-MoE tables are not where this mrl expects them")
    return root


def merged_config_dir(tuned: str, dst: str, sglang_root: str | None = None) -> str:
    """A folder for ``SGLANG_MOE_CONFIG_DIR``: links to SGLang's own tables, and to the tables under
    ``tuned`` (the same layout, ``configs/triton_X_Y_Z/*.json``) where both have a file of the same name.
    SGLang reads only this folder once the variable is set, so its own tables must be in it too."""
    tuned_configs = os.path.join(tuned, "configs")
    if not os.path.isdir(tuned_configs):
        raise ValueError(f"engine.moe_kernel_configs={tuned}: no configs/ folder in it (write one with "
                         "`mrl tune-moe`)")
    sources = [os.path.join(sglang_root or sglang_config_root(), "configs"), tuned_configs]
    for src in sources:  # later sources win
        for version in sorted(os.listdir(src)):
            if not version.startswith("triton_") or not os.path.isdir(os.path.join(src, version)):
                continue
            os.makedirs(os.path.join(dst, "configs", version), exist_ok=True)
            for name in os.listdir(os.path.join(src, version)):
                if name.endswith(".json"):
                    link = os.path.join(dst, "configs", version, name)
                    if os.path.lexists(link):
                        os.remove(link)
                    os.symlink(os.path.abspath(os.path.join(src, version, name)), link)
    return dst


def write_table(out: str, triton_version: str, name: str, table: dict[int, dict]) -> str:
    path = os.path.join(out, "configs", "triton_" + triton_version.replace(".", "_"), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({str(m): table[m] for m in sorted(table)}, f, indent=1)
    return path


# -- on the GPU --------------------------------------------------------------------------------------

def _server_args_defaults():
    """SGLang's kernels read a few server arguments (deterministic mode, fused all-reduce): its defaults,
    without ServerArgs' start-up checks (no model to look at here)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
        else:
            setattr(args, f.name, None)
    set_global_server_args_for_scheduler(args)


def gpu_timer(shape: MoeShape, fp8: bool, graph_calls: int = 10, reps: int = 5) -> Callable[[int, dict], float]:
    """``time_fn`` for ``tune``: SGLang's ``fused_experts`` (both GEMMs, the activation, the combine) on
    random weights and uniformly random routing, ``graph_calls`` calls captured in one CUDA graph so that
    the host's launch cost does not hide small kernels; median over ``reps`` replays, per call."""
    import torch
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts, override_config
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from mrl.quant.fp8 import quantize_block_fp8

    _server_args_defaults()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, n, k = shape.experts, shape.intermediate, shape.hidden
    w1 = torch.randn(e, 2 * n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    w2 = torch.randn(e, k, n, device=dev, dtype=torch.bfloat16) / n ** 0.5
    kw = {}
    if fp8:
        q1, q2 = (quantize_block_fp8(w, FP8_BLOCK) for w in (w1, w2))
        w1, w2 = q1[0], q2[0]
        kw = dict(use_fp8_w8a8=True, w1_scale=q1[1], w2_scale=q2[1], block_shape=list(FP8_BLOCK))
    runner = MoeRunnerConfig(num_experts=e, num_local_experts=e, hidden_size=k, intermediate_size_per_partition=n,
                             top_k=shape.top_k, inplace=False)

    def time_fn(m: int, config: dict) -> float:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        logits = torch.randn(m, e, device=dev, dtype=torch.float32)
        weights, ids = torch.topk(torch.softmax(logits, -1), shape.top_k, dim=-1)
        topk = StandardTopKOutput(weights, ids.to(torch.int32), logits)
        with override_config(config):
            fused_experts(x, w1, w2, topk, runner, **kw)  # compiles this tile configuration
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(graph_calls):
                    fused_experts(x, w1, w2, topk, runner, **kw)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / graph_calls)
        del graph
        return statistics.median(times)

    return time_fn


def against_sglang(table: dict[int, dict], timings: dict, time_fn: Callable[[int, dict], float],
                   baseline: Callable[[int], dict], log: Callable[[str], None] = lambda s: None) -> None:
    """Times SGLang's own choice at each token count of ``table`` the same way (``sglang_s``, and
    ``sglang_over_tuned``: how much slower it is); where it beats every searched configuration it is
    the one the table keeps."""
    for m in table:
        c = baseline(m)
        t = time_fn(m, c)
        timings[m] |= {"sglang_config": c, "sglang_s": t}
        if t < timings[m]["best_s"]:
            table[m], timings[m]["best_s"] = c, t
        timings[m]["sglang_over_tuned"] = t / timings[m]["best_s"]
        log(f"[tune-moe] {m} tokens: SGLang's choice {t * 1e6:.1f} us ({timings[m]['sglang_over_tuned']:.2f}x "
            "the tuned one)")


def sglang_choice(shape: MoeShape, fp8: bool) -> Callable[[int], dict]:
    """The configuration SGLang runs today at a token count (its table for this GPU and triton, another
    triton version's, or its default): the baseline each tuned entry is compared with."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import try_get_optimal_moe_config

    w1 = (shape.experts, 2 * shape.intermediate, shape.hidden)
    w2 = (shape.experts, shape.hidden, shape.intermediate)
    return lambda m: dict(try_get_optimal_moe_config(w1, w2, shape.top_k, "fp8_w8a8" if fp8 else None, m,
                                                     block_shape=list(FP8_BLOCK) if fp8 else None))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mrl tune-moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="the model's Hugging Face checkpoint (only config.json is read)")
    ap.add_argument("out", help="folder to write the tables into (engine.moe_kernel_configs)")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], nargs="+", default=["bf16", "fp8"],
                    help="expert weights: bf16, block-FP8 (engine.quantization=fp8), or both")
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel size (splits the experts' N)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    ap.add_argument("--space", choices=sorted(_SPACE), default="quick")
    ap.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                    help="replace the space's values of a parameter, e.g. BLOCK_SIZE_M=16,32 num_stages=3")
    a = ap.parse_args(argv)
    try:
        grid = {k: tuple(int(v) for v in vs.split(",")) for k, _, vs in (g.partition("=") for g in a.grid)}
    except ValueError:
        ap.error(f"--grid {a.grid}: expected KEY=V1,V2 with integer values")
    import torch
    import triton

    if not torch.cuda.is_available():
        ap.error("tuning times the kernel on a GPU: none is visible")
    shape = MoeShape.from_hf(a.hf_dir, a.tp)
    device = torch.cuda.get_device_name()
    summary = {"shape": dataclasses.asdict(shape), "device": device, "triton": triton.__version__,
               "space": a.space, "grid": grid, "tokens": a.tokens, "tables": {}}
    for dtype in a.dtype:
        fp8 = dtype == "fp8"
        try:
            configs = search_space(a.space, FP8_BLOCK if fp8 else None, grid)
        except ValueError as e:
            ap.error(str(e))
        t = time.perf_counter()
        print(f"[tune-moe] {dtype}: {len(configs)} configurations x {len(a.tokens)} token counts on {device}",
              flush=True)
        time_fn, baseline = gpu_timer(shape, fp8), sglang_choice(shape, fp8)
        table, timings = tune(a.tokens, configs, time_fn, log=lambda s: print(s, flush=True))
        against_sglang(table, timings, time_fn, baseline, log=lambda s: print(s, flush=True))
        path = write_table(a.out, triton.__version__, table_name(shape, fp8), table)
        summary["tables"][dtype] = {"path": path, "seconds": time.perf_counter() - t, "timings": timings}
        print(f"[tune-moe] {dtype}: wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
        with open(os.path.join(a.out, "tuning.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
