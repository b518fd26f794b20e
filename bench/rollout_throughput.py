"""Rollout tokens/s with 1 vs 2 SGLang CPU engines (same workload, one run), and routes bytes per token.

    python bench/rollout_throughput.py [--groups 16] [--n 4] [--new 64]

Both engines (TP1 each, CPU mode, tiny model) start once; the workload (GRPO groups, temperature 1,
one request per sample) runs through mrl's RolloutManager first on engine 0 alone, then on both.
Routes: bytes per token as the engine sends them (base64 over all layers, in JSON; uint8 ids from
mrl's engines, ``mrl.engine.server.patches``) vs after mrl's codec (uint8, MoE layers only).
"""

import argparse
import asyncio
import concurrent.futures
import os
import tempfile
import time

from rich.console import Console
from rich.table import Table

from _bench_common import dump

from mrl.models import get_bridge
from mrl.models.tiny import make_tiny_model
from mrl.sglang.client import EngineClient
from mrl.engine.launcher import Engine
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec


async def workload(urls, codec, a):
    mgr = RolloutManager([EngineClient(u) for u in urls], codec=codec, max_inflight_per_engine=8,
                         sampling=SamplingSpec(max_new_tokens=a.new, temperature=1.0, ignore_eos=True))
    t0 = time.perf_counter()
    groups = await asyncio.gather(*(mgr.generate_group([1, 10 + g, 20 + g, 30], n=a.n, group_id=g)
                                    for g in range(a.groups)))
    dt = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    assert mgr.stats.completed == len(samples)
    return sum(len(s.response_ids) for s in samples) / dt, dt


async def wire_bytes(url, codec):
    out = await EngineClient(url).generate([1, 17, 42, 99, 7], {"max_new_tokens": 64, "ignore_eos": True},
                                           rid="bytes", return_routed_experts=True)
    rows = 5 + len(out.output_ids) - 1
    return len(out.routed_experts) / rows, codec.compact_bytes_per_token()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="mrl_rollout_bench_")
    model = make_tiny_model(os.path.join(tmp, "tiny"))
    codec = RoutesCodec.from_bridge(get_bridge(model))
    cores = sorted(os.sched_getaffinity(0))
    # one core each: the comparison is 1 engine on 1 core vs 2 engines on 2 cores
    engines = [Engine(model_path=model, tp=1, log_dir=tmp, name=f"e{i}", cpus=[cores[i % len(cores)]]).start()
               for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda e: e.wait_healthy(600), engines))
        urls = [e.url for e in engines]
        asyncio.run(workload(urls, codec, argparse.Namespace(groups=2, n=2, new=8)))  # warm-up
        one, t1 = asyncio.run(workload(urls[:1], codec, a))
        two, t2 = asyncio.run(workload(urls, codec, a))
        wire, compact = asyncio.run(wire_bytes(urls[0], codec))
    finally:
        for e in engines:
            e.stop()
    t = Table(title=f"rollout: {a.groups} groups x {a.n} samples x {a.new} new tokens, tiny Qwen3-MoE, CPU mode")
    for c in ("engines", "wall s", "tokens/s", "x 1 engine"):
        t.add_column(c)
    t.add_row("1", f"{t1:.1f}", f"{one:.0f}", "1.00")
    t.add_row("2", f"{t2:.1f}", f"{two:.0f}", f"{two / one:.2f}")
    c = Console(width=140)
    c.print(t)
    c.print(f"routes bytes/token: engine wire (base64, all layers) {wire:.1f} -> mrl codec "
            f"(uint8, MoE layers) {compact} ({wire / compact:.1f}x smaller)")
    dump({"bench": "rollout_throughput", "groups": a.groups, "n": a.n, "new_tokens": a.new,
          "engines": {"1": {"seconds": t1, "tokens_per_s": one}, "2": {"seconds": t2, "tokens_per_s": two}},
          "routes_bytes_per_token": {"sglang_wire": wire, "mrl_codec": compact}}, a.json, name="rollout_throughput_cpu")


if __name__ == "__main__":
    main()
