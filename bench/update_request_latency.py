"""How long a batched weight-update request takes through a real SGLang server, by the size of its body.

    python bench/update_request_latency.py --json OUT.json [--names 1 100 1000 4700] [--reps 16]

Before an engine posts its first receive of a sync, the request that announces the sync's buckets travels
through SGLang's HTTP server, tokenizer manager and scheduler to the model runner. Every tensor of the sync
has its name, dtype and shape in it (4,700 for the Qwen3-30B-A3B 12-layer slice) unless the engine kept
them from an earlier sync (``mrl.engine.server.patches.KEEPS_LAYOUTS_MARK``): then the request names their key.
Both are timed here as the whole round trip of a request the model runner refuses without receiving
(a group it does not have; a key it does not hold), so no trainer is needed: the way in and the answer
out, the same path an accepted request takes before its receives. A CPU engine serves them (the tiny
model); kinds alternate within each repetition. Figures: per kind the median round trip and its
p25-p75, and the median of the per-repetition differences against the kept key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _bench_common import environment  # noqa: E402


def body(n: int | None) -> bytes:
    """A batched request with ``n`` expert tensors of the slice's shape, or (None) one naming a kept key."""
    from mrl.sglang.wire import BATCHED_BUCKETS_FORMAT

    if n is None:
        lists, spec = dict(names=[], dtypes=[], shapes=[]), {"key": "0123456789abcdef"}
    else:
        names = [f"model.layers.{i // 384}.mlp.experts.{(i // 3) % 128}.{('gate', 'up', 'down')[i % 3]}_proj.weight"
                 for i in range(n)]
        lists = dict(names=names, dtypes=["bfloat16"] * n, shapes=[[768, 2048]] * n)
        spec = [["no-such-group", n]]
    return json.dumps(dict(**lists, group_name="no-such-group", flush_cache=False, weight_version="1",
                           load_format=BATCHED_BUCKETS_FORMAT + json.dumps(spec))).encode()


async def _round_trip(client, payload: bytes) -> float:
    from mrl.sglang.pipeline import post_pipelined

    t = time.perf_counter()
    (status, raw), = await post_pipelined(client.url, "/update_weights_from_distributed", [payload], timeout=60,
                                          connect_timeout=10, headers=client.auth_headers(admin=True))
    dt = time.perf_counter() - t
    if status != 400 or b"Failed to update parameter online" not in raw:  # refused in the model runner, as meant
        raise RuntimeError(f"unexpected answer {status}: {raw[:300]!r}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--names", type=int, nargs="+", default=[1, 100, 1000, 4700])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    from mrl.engine.launcher import Engine
    from mrl.models.tiny import make_tiny_model
    from mrl.sglang.client import EngineClient

    kinds = {"kept_key": body(None)} | {f"names_{n}": body(n) for n in a.names}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_model(os.path.join(tmp, "tiny"))
        with Engine(model_path=ckpt, cpu_mode=True, tp=1, log_dir=os.path.join(tmp, "logs"), name="latency") as e:
            e.wait_healthy(timeout=900)
            client = EngineClient(e.endpoint)

            async def run():
                for rep in range(a.warmup + a.reps):
                    for k, payload in kinds.items():
                        dt = await _round_trip(client, payload)
                        if rep >= a.warmup:
                            times[k].append(dt)
            asyncio.run(run())
    out = {"bench": "update_request_latency", "environment": environment(), "reps": a.reps, "warmup": a.warmup,
           "statistic": "median round trip per kind; median of per-repetition differences against kept_key",
           "body_bytes": {k: len(v) for k, v in kinds.items()}, "round_trip_s": times, "summary": {}}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        diff = [t - base for t, base in zip(ts, times["kept_key"])]
        out["summary"][k] = {"median_s": statistics.median(ts), "p25_s": q[0], "p75_s": q[2],
                             "minus_kept_key_median_s": statistics.median(diff)}
        print(f"{k}: {len(kinds[k])} bytes, {1e3 * statistics.median(ts):.2f} ms (p25-p75 {1e3 * q[0]:.2f}-"
              f"{1e3 * q[2]:.2f}), {1e3 * statistics.median(diff):+.2f} ms against the kept key", flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
