"""torchrun worker of bench/fwd_bwd_layouts.py: time fwd+bwd of the model in one layout."""

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from mrl.jobs.common import add_layout_args, load_model
from mrl.megatron.parallel import destroy
from megatron.core.pipeline_parallel import get_forward_backward_func

ap = argparse.ArgumentParser()
add_layout_args(ap)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--out", required=True)
a = ap.parse_args()

m = load_model(a)
layout, bridge, model = m.layout, m.bridge, m.model
# every DP rank gets its own micro-batch of the global batch: global tokens per step are fixed
dp = layout.world_size // (a.tp * a.pp)
mb = max(1, a.batch // dp)
ids = torch.randint(0, bridge.vocab_size, (mb, a.seq + 1), generator=torch.Generator().manual_seed(layout.dp.rank))
pos = torch.arange(a.seq).unsqueeze(0).expand(mb, a.seq)


def forward_step(_it, m):
    out = m(input_ids=ids[:, :-1], position_ids=pos, attention_mask=None, labels=ids[:, 1:])
    return out, lambda t: (t.float().mean(), {})


times = []
for i in range(a.steps + 2):
    dist.barrier()
    t0 = time.perf_counter()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=a.seq, micro_batch_size=mb, forward_only=False)
    dist.barrier()
    if i >= 2:  # warm-up: first steps trace the compiled router function
        times.append(time.perf_counter() - t0)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
peaks = [None] * layout.world_size
dist.all_gather_object(peaks, rss)
if layout.world_rank == 0:
    json.dump({"min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times),
               "step_ms": [1e3 * t for t in times], "peak_rss_mb_max_rank": max(peaks), "peak_rss_mb_sum": sum(peaks),
               "tokens_per_step": a.batch * a.seq if dp > 1 else mb * a.seq}, open(a.out, "w"))
destroy()
