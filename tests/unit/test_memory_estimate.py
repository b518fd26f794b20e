"""``mrl.megatron.memory``: the trainer's model states per rank, before a run.

Here: the Qwen3-30B-A3B figures (parameters counted independently of the bridge, the bytes of each
category), megatron's own buffer layout code against the padding rule, a one-rank TP1 model built on CPU
(fp32 and bf16) with mrl's DDP and distributed optimizer against the estimate, the preset that quotes the
figures, and ``mrl check``'s line. Two processes (TP2, EP2, PP2 with tied embeddings, GLM-4.5, DeepSeek-V3):
tests/distributed/test_memory_estimate.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

from mrl.config.schema import DType, ParallelConfig
from tests.conftest import REPO, one_rank_gloo_world

# Qwen3-30B-A3B's config.json (the keys its bridge reads, as the hub's file holds them)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, head_dim=128, hidden_act="silu",
    hidden_size=2048, initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960,
    max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True,
    num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
    output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0,
    router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, use_sliding_window=False, vocab_size=151936)
PRESET = os.path.join(REPO, "conf", "experiment", "qwen3_30b_a3b_8gpu.yaml")


def _bridge_30b():
    from mrl.models.bridge import JsonConfig
    from mrl.models.qwen3_moe import Qwen3MoeBridge

    return Qwen3MoeBridge(JsonConfig(QWEN3_30B_A3B))


def _estimate_30b(ep: int, states: str) -> dict:
    from mrl.megatron.memory import model_state_bytes

    b = _bridge_30b()
    return model_state_bytes(b, ParallelConfig(tp=1, ep=ep, world_size=ep), dtype=DType.bf16,
                             optimizer_states_dtype=DType(states), padded_vocab=b.padded_vocab(128, 1))


def test_every_rank_together_holds_the_whole_model():
    """Dense params (whole on every TP1 rank) + one rank's experts x EP = the model, counted here by hand."""
    c = QWEN3_30B_A3B
    h, layers, e, v = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    attention = h * (q + 2 * kv) + q * h + 2 * c["head_dim"] + 2 * h  # qkv, o, q/k norms, the two layer norms
    experts = e * 3 * h * c["moe_intermediate_size"]
    total = 2 * v * h + h + layers * (attention + e * h + experts)  # embedding, head, final norm; router per layer
    assert total == 30_532_122_624  # Qwen3-30B-A3B's 30.5B
    for ep in (1, 2, 4, 8):
        est = _estimate_30b(ep, "fp32")
        assert est["dense_params"] + ep * est["expert_params"] == total
        assert est["expert_params"] == layers * experts // ep


@pytest.mark.parametrize("ep,states,gib", [(4, "fp32", (16.4, 32.7, 85.3, 134.4)),
                                           (4, "bf16", (16.4, 32.7, 42.7, 91.8)),
                                           (8, "fp32", (9.6, 19.2, 42.7, 71.5)),
                                           (8, "bf16", (9.6, 19.2, 21.3, 50.2))])
def test_qwen3_30b_a3b_figures(ep, states, gib):
    """bf16 weights and fp32 grads over the whole (unpadded: every size is a multiple of 64) buffers; the
    optimizer's 12 (fp32 states) or 6 (bf16 states) bytes over its shards: dense params over DP = EP ranks,
    experts over expert-DP 1. The figures docs/memory.md and the preset quote."""
    est = _estimate_30b(ep, states)
    dense, expert = est["dense_params"], est["expert_params"]
    assert (est["dense_buffer"], est["expert_buffer"]) == (dense, expert)
    assert (est["dp"], est["edp"]) == (ep, 1)
    assert est["weights_bytes"] == 2 * (dense + expert) and est["grads_bytes"] == 4 * (dense + expert)
    assert est["optimizer_bytes"] == (12 if states == "fp32" else 6) * (dense // ep + expert)
    got = tuple(round(est[f"{k}_gib"], 1) for k in ("weights", "grads", "optimizer", "total"))
    assert got == gib
    doc = open(os.path.join(REPO, "docs", "memory.md")).read()
    assert f"| EP{ep} | {states} | {gib[0]} | {gib[1]} | {gib[2]} | **{gib[3]}** |" in doc


def test_optimizer_bytes_per_element():
    """Adam's moments, plus the master weights where the optimizer keeps its own (docs/memory.md)."""
    from mrl.megatron.memory import optimizer_bytes_per_element as per

    assert per(DType.fp32, DType.fp32) == 8  # fp32 params are their own master
    assert per(DType.bf16, DType.fp32) == 12  # fp32 master + 2 fp32 moments
    assert per(DType.bf16, DType.bf16) == 6  # 16-bit remainders of the fp32 master + 2 bf16 moments
    assert per(DType.fp32, DType.bf16) == 8  # FusedAdam's own fp32 master copy + 2 bf16 moments


def test_buffer_padding_is_megatrons_layout():
    """``ddp_buffer_numel`` against megatron's own layout function, for random sizes in a random order, DP
    sizes 1-8, with and without a tied embedding's bucket of its own."""
    import torch

    from mrl.megatron import compat  # noqa: F401  (before megatron)
    from mrl.megatron.memory import ddp_buffer_numel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    rng = random.Random(0)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True)
    for trial in range(40):
        sizes = [1, 63, 64, 65, 127, 500, 4096, rng.randint(1, 10_000)]
        numels = [rng.choice(sizes) for _ in range(rng.randint(1, 30))]
        dp = rng.randint(1, 8)
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        own = []
        if trial % 2:  # the tied embedding under PP: first (last stage's head) or last (first stage's embedding)
            shared = torch.nn.Parameter(torch.empty(rng.randint(1, 5000)))
            shared.shared_embedding = True
            params = [shared, *params] if trial % 4 == 1 else [*params, shared]
            own = [shared.numel()]
        else:
            rng.shuffle(params)
        layout = DistributedOptimizer._compute_per_buffer_param_layout(params, None, dp, cfg)
        assert layout.bucket_indices[-1][1] == ddp_buffer_numel(numels, dp, own), (numels, dp, own)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_rank_model_on_cpu_is_the_estimate(ckpt_dir, dtype):
    """TP1 on one rank: megatron's model, DDP buffers and distributed optimizer (fp32 states) as built; every
    figure equal to the estimate (one DP rank: the optimizer's count is exact too)."""
    from tests.jobs.memory_states import check_case

    with one_rank_gloo_world():
        row = check_case(ckpt_dir["tiny"], "tp=1", dtype)
    got, est = row["got"], row["est"]
    keys = ("dense_params", "expert_params", "dense_buffer", "expert_buffer", "weights_bytes", "grads_bytes",
            "dense_optimizer", "expert_optimizer", "optimizer_bytes")
    assert {k: got[k] for k in keys} == {k: est[k] for k in keys}
    assert got["dense_buffer"] > got["dense_params"] + got["expert_params"]  # padding there, and counted
    assert got["grad_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_rank_lora_model_on_cpu_is_the_estimate(ckpt_dir, dtype):
    """LoRA on attention and every expert, TP1 on one rank: the frozen base outside DDP, the adapters alone in
    its buffers and the optimizer (fp32 states), every figure equal to ``lora_state_bytes``."""
    from mrl.config.schema import LoraConfig
    from tests.jobs.memory_states import check_lora_case

    with one_rank_gloo_world():
        row = check_lora_case(ckpt_dir["tiny"], "tp=1", dtype, LoraConfig(rank=4, targets=["attention", "experts"]))
    got, est = row["got"], row["est"]
    keys = ("base_params", "adapter_params", "adapter_buffer", "base_bytes", "adapters_bytes", "grads_bytes",
            "adapter_optimizer", "optimizer_bytes")
    assert {k: got[k] for k in keys} == {k: est[k] for k in keys}
    assert got["trainable"] == got["adapter_params"] > 0


@pytest.mark.parametrize("rank,gib", [(8, (56.9, 0.8, 1.6, 4.7, 63.9)), (4, (56.9, 0.4, 0.8, 2.4, 60.4))])
def test_qwen3_30b_a3b_lora_figures(rank, gib):
    """The full model on one GPU with adapters on attention and every expert: bf16 base, fp32 Adam states. The
    adapter elements counted by hand; the figures docs/memory.md quotes."""
    from mrl.config.schema import LoraConfig
    from mrl.megatron.memory import lora_state_bytes

    b, c = _bridge_30b(), QWEN3_30B_A3B
    est = lora_state_bytes(b, ParallelConfig(), LoraConfig(rank=rank, targets=["attention", "experts"]),
                           dtype=DType.bf16, optimizer_states_dtype=DType.fp32, padded_vocab=b.padded_vocab(128, 1))
    h, q, kv, i = c["hidden_size"], 32 * 128, 4 * 128, c["moe_intermediate_size"]
    attention = (h + q) + 2 * (h + kv) + (q + h)  # q, k, v, o: A [r, in] + B [out, r] each
    experts = c["num_experts"] * 3 * (h + i)
    assert est["adapter_params"] == rank * c["num_hidden_layers"] * (attention + experts)
    assert est["base_params"] == 30_532_122_624
    got = tuple(round(est[f"{k}_gib"], 1) for k in ("base", "adapters", "grads", "optimizer", "total"))
    assert got == gib
    doc = open(os.path.join(REPO, "docs", "memory.md")).read()
    assert f"| {rank} | {gib[0]} | {gib[1]} | {gib[2]} | {gib[3]} | **{gib[4]}** |" in doc


def test_estimate_imports_no_torch():
    """What ``mrl check`` runs: the bridge over config.json and the estimate, with torch and transformers
    unimportable."""
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'megatron'): sys.modules[m] = None\n"
            "from tests.unit.test_memory_estimate import _estimate_30b\n"
            "print(round(_estimate_30b(4, 'bf16')['total_gib'], 1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "91.8"


def test_the_8gpu_preset_places_the_trainer_and_engines_and_quotes_the_estimate():
    from mrl.config.load import compose
    from mrl.megatron.memory import model_state_bytes

    cfg = compose(["+experiment=qwen3_30b_a3b_8gpu", "model.hf_path=/ckpt/Qwen3-30B-A3B"])
    p, e = cfg.parallel, cfg.engine
    assert (p.tp, p.pp, p.ep, p.expert_tp, p.world_size) == (1, 1, 4, 1, 4)
    assert (e.cpu_mode, e.count, e.tp, e.dp, e.base_gpu_id) == (False, 2, 2, 1, 4)
    engine_gpus = [e.base_gpu_id + i * e.tp * e.dp + k for i in range(e.count) for k in range(e.tp)]
    assert engine_gpus == [4, 5, 6, 7] and not set(engine_gpus) & set(range(p.world_size))
    assert cfg.model.dtype == DType.bf16 and cfg.train.optimizer_states_dtype == DType.bf16
    b = _bridge_30b()
    est = model_state_bytes(b, p, dtype=cfg.model.dtype, optimizer_states_dtype=cfg.train.optimizer_states_dtype,
                            padded_vocab=b.padded_vocab(cfg.model.vocab_divisible_by, p.tp))
    comment = open(PRESET).read()
    quoted = re.search(r"([\d.]+) GiB with\s+# bf16 Adam states \(weights ([\d.]+) \+ grads ([\d.]+) \+ "
                       r"optimizer ([\d.]+) GiB\)", comment)
    assert quoted, "the preset's comment quotes the estimate"
    assert [float(x) for x in quoted.groups()] == [round(est[f"{k}_gib"], 1)
                                                  for k in ("total", "weights", "grads", "optimizer")]
    assert est["total_gib"] + 40 < 139  # room for activations on an H200, which fp32 states would not leave
    assert _estimate_30b(4, "fp32")["total_gib"] + 10 > 139


def _model_dir(tmp_path) -> str:
    d = tmp_path / "qwen3_30b_a3b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return str(d)


def test_mrl_check_prints_the_model_states_line(tmp_path):
    """Pass or fail, ``mrl check`` prints the estimate on stdout (here it fails: no GPU, no tokenizer, no
    weights) and its failures alone on stderr."""
    mrl = os.path.join(os.path.dirname(sys.executable), "mrl")
    p = subprocess.run([mrl, "check", "+experiment=qwen3_30b_a3b_8gpu", f"model.hf_path={_model_dir(tmp_path)}",
                        f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.stdout.splitlines() == [
        "[mrl] model states per trainer rank: 91.8 GiB = weights 16.4 GiB + grads 32.7 GiB + optimizer 42.7 GiB "
        "(bf16 weights, fp32 grads, bf16 Adam states; tp1 pp1 ep4 etp1 on 4 ranks: dp4 edp1); activations and "
        "allocator slack not included (docs/memory.md)"], p.stdout
    assert "model states" not in p.stderr and p.returncode == 2
    assert not (tmp_path / "run").exists()


def test_no_line_where_the_estimate_would_not_hold(tmp_path):
    """LoRA trains adapters only; a layout that cannot shard the model is the checks' to name."""
    from mrl.config.load import compose
    from mrl.preflight import LOCAL, model_state_note

    path = _model_dir(tmp_path)
    assert model_state_note(compose([f"model.hf_path={path}", "parallel=ep4"]), LOCAL).startswith("model states")
    assert model_state_note(compose([f"model.hf_path={path}", "parallel=ep4", "model.lora.rank=8"]), LOCAL) is None
    assert model_state_note(compose([f"model.hf_path={path}", "parallel.ep=3", "parallel.world_size=3"]),
                            LOCAL) is None  # 3 does not divide 128 experts
    assert model_state_note(compose([f"model.hf_path={tmp_path / 'none'}"]), LOCAL) is None


def test_checkpoint_bytes_of_qwen3_30b_a3b():
    """One checkpoint's lower bound: bf16 weights + the optimizer state once (the figure docs/training.md's
    fully reshardable save of the full model rests on: 12 fp32 bytes per parameter)."""
    from mrl.megatron.memory import checkpoint_bytes

    b = _bridge_30b()
    kw = dict(dtype=DType.bf16, padded_vocab=b.padded_vocab(128, 1))
    n, dp = checkpoint_bytes(b, optimizer_states_dtype=DType.bf16, optimizer_checkpoint="dp_reshardable", **kw)
    assert n == 30_532_122_624
    assert dp == n * (2 + 6)
    assert checkpoint_bytes(b, optimizer_states_dtype=DType.bf16, optimizer_checkpoint="fully_reshardable",
                            **kw)[1] == n * (2 + 12)
