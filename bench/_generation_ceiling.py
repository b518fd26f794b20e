"""Generation ceiling of bench/async_vs_sync.py: the loop's rollout side (the same engine settings,
prompts, budgets, producer, buffer and window) with the trainer taken out -- batches are taken as fast
as they complete, the engine is never paused and no weights are synced. Its tokens/s bound what any
loop on this box can train per second; the overlap run is measured against it. ``tokens_per_s`` counts
response tokens, ``batch_tokens_per_s`` every token of the samples (prompt + response, what the trainer
trains on: bench/loop_e2e.py's unit).

    python bench/_generation_ceiling.py --steps 30 --out ceiling.json OVERRIDE...   # the bench's overrides
"""

import argparse
import json
import os
import time

from mrl.cli import ensure_model
from mrl.config.load import compose
from mrl.models import get_bridge
from mrl.engine.launcher import engines_from_config
from mrl.rollout.service import RolloutService
from mrl.routing.codec import RoutesCodec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    a, overrides = ap.parse_known_args()
    cfg = compose(overrides)
    hf = ensure_model(cfg)
    bridge = get_bridge(hf)
    engines = engines_from_config(cfg.engine, hf, log_dir=os.path.join(cfg.run_dir, "engines"))
    svc = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_healthy()
        svc = RolloutService.start(cfg, hf, [e.url for e in engines], RoutesCodec.from_bridge(bridge),
                                   {"eos": bridge.hf_config.eos_token_id, "buffered": [], "prompt_index": 0})
        t = cfg.train
        svc.start_producing(t.max_inflight_groups)
        svc.take(t.prompts_per_step, 0, timeout=600)  # the first batch fills the pipeline (as the bench skips step 1)
        t0, tokens, batch_tokens, per_batch = time.perf_counter(), 0, 0, []
        for _ in range(a.steps - 1):
            samples = [s for g in svc.take(t.prompts_per_step, 0, timeout=t.batch_timeout_s) for s in g.samples]
            tokens += sum(len(s.response_ids) for s in samples)
            batch_tokens += sum(len(s.tokens) for s in samples)
            per_batch.append(time.perf_counter() - t0 - sum(per_batch))
        seconds = time.perf_counter() - t0
    finally:
        if svc is not None:
            svc.stop()
        for e in engines:
            e.stop()
    with open(a.out, "w") as f:
        json.dump({"mode": "generation only", "steps_timed": a.steps - 1, "seconds": seconds, "tokens": tokens,
                   "tokens_per_s": tokens / seconds,
                   "batch_tokens": batch_tokens, "batch_tokens_per_s": batch_tokens / seconds,
                   "batch_seconds": per_batch}, f)


if __name__ == "__main__":
    main()
