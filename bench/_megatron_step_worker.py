"""torchrun worker of bench/rl_step_vs_megatron.py: the baseline, plain megatron-core with no mrl code on
the timed path (on GPUs none is imported at all).

The model is built from the HF ``config.json`` the mrl side loads (same shape, spec and layout), with
megatron's own random init: throughput does not depend on the weights' values, only on their shapes and on
how evenly tokens spread over experts (near-uniform for both random inits). Each step is what a megatron
user's training step is: ``--micro-batches`` micro-batches of ``--micro-batch-size`` rows of ``--seq``
tokens with ``labels`` (megatron's vocab-parallel cross-entropy) through ``get_forward_backward_func``,
then ``optimizer.step()``, with the fused kernels megatron offers for this model (router fusion included:
the baseline does not replay routes).
Writes every step's wall time (CUDA synchronised, slowest rank) to ``--out``.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from _bench_common import GcTimes, HostLead, allocator_counts, gc_mode, profile_steps, step_worker_args

ap = step_worker_args(argparse.ArgumentParser())
ap.add_argument("--no-router-fusion", action="store_true", help="as mrl runs (replay needs the unfused router)")
ap.add_argument("--ce-fusion", choices=["off", "native", "te"], default="native",
                help="megatron's cross-entropy fusion (cross_entropy_loss_fusion, cross_entropy_fusion_impl): "
                     "native is the one Megatron-LM's argument checks accept")
ap.add_argument("--phases", action="store_true", help="after the timing, two more steps with the schedule "
                "(forward + backward) and the optimizer step each timed between device syncs")
ap.add_argument("--profile", default=None, help="DIR: two more steps under the torch profiler (as the mrl side)")
ap.add_argument("--host-lead", action="store_true", help="after the timing, two more steps with HostLead marks "
                "(as the mrl side: each micro-batch's forward, after backward, the optimizer step)")
ap.add_argument("--out", required=True)
a = ap.parse_args()

cuda = torch.cuda.is_available()
if not cuda:  # CPU debug runs only: megatron-core cannot be imported here without mrl's triton stub
    import mrl.megatron.compat  # noqa: F401
else:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if cuda else "gloo")

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,  # noqa: E402
                                       finalize_model_grads)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep)
model_parallel_cuda_manual_seed(1234)  # on CPU through mrl.megatron.compat

hf = json.load(open(os.path.join(a.hf, "config.json")))
if hf["architectures"] != ["Qwen3MoeForCausalLM"]:
    raise SystemExit(f"the megatron baseline maps Qwen3-MoE configs only, got {hf['architectures']}")
try:
    import transformer_engine.pytorch  # noqa: F401

    te = cuda
except ImportError:
    te = False
dense = set(hf.get("mlp_only_layers") or [])
step = hf.get("decoder_sparse_step", 1)
fused = dict(apply_rope_fusion=te, bias_activation_fusion=te, bias_dropout_fusion=te, masked_softmax_fusion=te,
             moe_permute_fusion=te, moe_router_fusion=te and not a.no_router_fusion, persist_layer_norm=False,
             gradient_accumulation_fusion=False,  # needs apex's CUDA extension (absent)
             cross_entropy_loss_fusion=a.ce_fusion != "off",
             cross_entropy_fusion_impl="te" if a.ce_fusion == "te" else "native")
dtype = torch.bfloat16 if cuda else torch.float32
cfg = TransformerConfig(
    num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
    num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
    kv_channels=hf["head_dim"], qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
    gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
    hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=hf.get("num_experts", hf.get("num_local_experts")),
    moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_topk=hf["num_experts_per_tok"],
    moe_router_pre_softmax=not hf.get("norm_topk_prob", False), moe_router_dtype="fp32",
    moe_layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])],
    moe_token_dispatcher_type="alltoall", moe_grouped_gemm=te, moe_aux_loss_coeff=0.0,
    moe_router_load_balancing_type="none", tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep,
    sequence_parallel=a.tp > 1, params_dtype=dtype, pipeline_dtype=dtype, bf16=cuda, init_method_std=0.02,
    use_cpu_initialization=not cuda, **fused)
vocab = hf["vocab_size"] + (-hf["vocab_size"]) % (128 * a.tp)
model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=te,
                                                                               normalization="RMSNorm"),
                 vocab_size=vocab, max_sequence_length=max(a.seq, hf.get("max_position_embeddings", a.seq)),
                 position_embedding_type="rope",
                 rotary_base=float(hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]),
                 share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False))
model = model.to(torch.device("cuda") if cuda else "cpu")
ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
    grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True))
cfg.finalize_model_grads_func = finalize_model_grads
cfg.no_sync_func = ddp.no_sync
states = torch.bfloat16 if a.optimizer_states == "bf16" else torch.float32
opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, clip_grad=1.0, bf16=cuda, params_dtype=dtype,
                                             use_distributed_optimizer=True,
                                             use_precision_aware_optimizer=states != torch.float32,
                                             exp_avg_dtype=states, exp_avg_sq_dtype=states), [ddp])

dev = torch.device("cuda") if cuda else torch.device("cpu")
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, hf["vocab_size"], (a.micro_batches, a.micro_batch_size, a.seq), generator=gen).to(dev)
           for _ in range(a.warmup + a.reps)]
pos = torch.arange(a.seq, device=dev).expand(a.micro_batch_size, a.seq)


spent: dict = {}
lead = HostLead()  # marks are ignored until lead.start()


def sync_timed(name, fn):
    """``fn()`` between device syncs, its seconds kept under ``name`` (only with --phases)."""
    if not a.phases_on:
        return fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    spent.setdefault(name, []).append(time.perf_counter() - t0)
    return out


def train_step(rows: torch.Tensor) -> None:
    it = iter(enumerate(rows))

    def forward_step(_data, m):
        k, ids = next(it)
        lead.mark(f"forward {k}")
        labels = torch.roll(ids, -1, dims=1)
        out = m(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels)
        lead.mark(f"forward {k} out")

        def loss_func(loss_bs):
            return loss_bs.float().mean(), {}

        return out, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    sync_timed("forward_backward", lambda: get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None] * len(rows)), model=[ddp],
        num_microbatches=len(rows), seq_length=a.seq, micro_batch_size=a.micro_batch_size, forward_only=False))
    lead.mark("backward queued")
    lead.mark("optimizer.step")
    sync_timed("optimizer.step", opt.step)


def timed(fn) -> float:
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


a.phases_on = False
gc_mode(a.gc)
gc_times = GcTimes().start()  # warm-up and timed steps
alloc_before = allocator_counts()
times = [timed(lambda b=b: train_step(b)) for b in batches]
gc_timed = gc_times.snapshot()
alloc_after = allocator_counts()
lead_marks = None
if a.host_lead:
    lead_marks = []
    for b in batches[-2:]:
        lead.start()
        train_step(b)
        lead_marks.append(lead.stop())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, lead_marks)
    lead_marks = every
prof = profile_steps(lambda: [train_step(b) for b in batches[-2:]], 2, a.profile, "megatron_step_profile",
                     dist.get_rank()) if a.profile else None
phase_times = None
if a.phases:
    a.phases_on = True
    phase_times = {"step_s": [timed(lambda b=b: train_step(b)) for b in batches[-2:]], **spent}
    every = [None] * dist.get_world_size()  # phases differ by rank when one waits for another
    dist.all_gather_object(every, phase_times)
    phase_times = every
if dist.get_rank() == 0:
    json.dump({"side": "megatron", "te": te, "fusions": fused, "step_s": times[a.warmup:],
               "warmup_s": times[:a.warmup], "median_s": statistics.median(times[a.warmup:]), "gc": gc_timed,
               "allocator": {"before": alloc_before, "after": alloc_after},
               "tokens_per_step": a.micro_batches * a.micro_batch_size * a.seq * ps.get_data_parallel_world_size(),
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "phases_s": phase_times[0] if phase_times else None, "phases_s_per_rank": phase_times,
               "host_lead_per_rank": lead_marks,
               "profile": prof},
              open(a.out, "w"))
dist.barrier()
dist.destroy_process_group()
