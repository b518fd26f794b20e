"""GPU job (tests/gpu/fp8_sync.sh): the FP8 weight sync into a real SGLang engine serving block FP8.

    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 1 -m tests.jobs.fp8_sync_check \\
        --hf MODEL --run-dir DIR --out DIR/fp8_sync.json

Trainer (megatron, bf16, TP1) on GPU 0; an engine on GPU 1 started as ``engine.quantization=fp8`` starts
one: from the run's block-FP8 export (``mrl.engine.fp8_model``) with ``--quantization fp8 --dtype bfloat16``
(``--engine-gpu 0 --transport tensor``: both on one GPU, the sync over CUDA IPC).
The trainer's weights are perturbed (so the sync has something to change), synced over NCCL (or IPC) as FP8
(``FullWeightChannel`` over ``make_transport(..., fp8=True)``), then:

- bitwise: the engine's sampled tensors (first and last layer in full, experts included; norms, router,
  embeddings, head) hash equal to the trainer's export quantized by ``quantize_checkpoint``, cut the way a
  TP1 engine holds them (SGLang's ``/weights_checker`` checksums, its own ``tensor_hash`` on both sides).
  The checker reports an FP8 weight dequantized with its ``weight_scale_inv`` (and not the scale itself),
  so both sides compare that bf16 view (``fp8_checker_view``): the weights as the engine computes with them;
- probe logprobs: the engine's teacher-forced logprobs of a fixed random probe against the trainer's with
  the dequantized weights (quantization is the only difference left: bf16 noise and near-tie routing), and,
  for scale, against the bf16 trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # _engine_shards, _bench_common: the engine layouts


def dequantize(hf: dict[str, torch.Tensor], dtype: torch.dtype, ignored=()) -> dict[str, torch.Tensor]:
    """Full HF tensors as the engine computes with them: each FP8 target (but ``ignored``'s modules)
    quantized and read back per block (the view SGLang's weight checker reports, ``fp8_checker_view``)."""
    from _engine_shards import fp8_checker_view

    from mrl.quant.fp8 import quantize_block_fp8
    from mrl.quant.fp8_targets import is_fp8_target

    out = {}
    for name, t in hf.items():
        out[name] = fp8_checker_view(*quantize_block_fp8(t.to(dtype))).to(dtype) \
            if t.dim() == 2 and is_fp8_target(name, ignored) else t
    return out


def engine_tensors(qhf: dict[str, torch.Tensor], name: str, bridge) -> torch.Tensor:
    """What a TP1 engine holds under ``name`` (an FP8 layer's weight or ``weight_scale_inv``, or any other)."""
    from _engine_shards import engine_shard

    kw = dict(num_experts=bridge.num_experts, kv_heads=bridge.num_query_groups,
              head_dim=getattr(bridge.hf_config, "head_dim", None)
              or bridge.hf_config.hidden_size // bridge.hf_config.num_attention_heads)
    if name.endswith("_scale_inv"):  # the scales fuse and stack as their weights do, per block row
        src = {k.removesuffix("_scale_inv"): v for k, v in qhf.items() if k.endswith("_scale_inv")}
        return engine_shard(src, name.removesuffix("_scale_inv"), 1, 0, **kw)
    return engine_shard(qhf, name, 1, 0, **kw)


def main() -> int:
    from _bench_common import engine_call
    from sglang.srt.managers.mm_utils import tensor_hash

    from mrl.config.schema import WeightTransport
    from mrl.engine.fp8_model import ensure_fp8_model
    from mrl.engine.launcher import Engine
    from mrl.sglang.keys import ensure_run_secrets
    from mrl.jobs.common import load_model
    from mrl.megatron.forward import forward_logits, token_logprobs
    from mrl.megatron.parallel import destroy
    from mrl.megatron.weights import export_hf
    from mrl.models.checkpoint import save_hf
    from mrl.weight_sync.fp8 import quantize_checkpoint
    from mrl.weight_sync.factory import make_transport
    from mrl.weight_sync.full import FullWeightChannel
    from _engine_shards import fp8_checker_view, sampled_names

    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine-gpu", type=int, default=1)
    ap.add_argument("--transport", default="distributed", choices=["distributed", "tensor"],
                    help="tensor: CUDA IPC into an engine on the trainer's GPU (--engine-gpu 0: one GPU)")
    ap.add_argument("--probe-tol", type=float, default=0.1, help="max |logprob diff| vs the dequantized trainer")
    ap.add_argument("--fp8-ignore", nargs="*", default=[], metavar="MODULE",
                    help="engine.fp8_ignore: modules the export and the sync keep in bf16")
    a = ap.parse_args()
    os.makedirs(a.run_dir, exist_ok=True)
    ensure_run_secrets(a.run_dir)
    report: dict = {}
    t0 = time.monotonic()
    ignored = tuple(a.fp8_ignore)
    report["fp8_ignore"] = list(ignored)
    fp8_dir = ensure_fp8_model(a.hf, a.run_dir, ignored=ignored)
    report["export_seconds"] = time.monotonic() - t0
    engine = Engine(model_path=fp8_dir, cpu_mode=False, quantization="fp8", dtype="bfloat16",
                    base_gpu_id=a.engine_gpu, mem_fraction_static=0.3 if a.transport == "tensor" else 0.5,
                    log_dir=os.path.join(a.run_dir, "engines"))
    engine.start()
    try:
        engine.wait_healthy(900)
        layout_args = argparse.Namespace(hf=a.hf, tp=1, pp=1, ep=1, etp=None, pp_first=None, pp_last=None,
                                         dispatcher="alltoall", dtype="bf16")
        m = load_model(layout_args)
        g = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():  # a training step's worth of change, so the engine's checkpoint weights go stale
            for p in m.model.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.01 * p.float().std().item()).to(p.device, p.dtype))
        transport, disk = make_transport(
            WeightTransport(a.transport), model=m.model, layout=m.layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
            engines=[engine.endpoint], bucket_bytes=1 << 20, export_dir=os.path.join(a.run_dir, "weights"),
            config_src=a.hf, dtype="bfloat16", fp8=True, fp8_ignore=ignored)
        syncer = FullWeightChannel(transport, disk, m.layout, [engine.endpoint])
        syncer.connect()
        rep = syncer.sync("1")
        report["sync"] = {"transport": a.transport, "seconds": rep.seconds, "bytes": rep.bytes_sent,
                          "failed": rep.failed_engines, "repaired_from_disk": rep.repaired_from_disk}
        hf = export_hf(m.model, m.layout, m.bridge, m.padded_vocab)
        qhf = quantize_checkpoint(hf, torch.bfloat16, ignored=ignored)
        sums = engine_call(engine.url, lambda c: c.weight_checksums())[0]
        bitwise = {}
        for name in sampled_names(m.bridge.num_layers):
            if name not in sums:
                bitwise[name] = "absent from the engine"
                continue
            t = engine_tensors(qhf, name, m.bridge)
            if t is not None and t.dtype == torch.float8_e4m3fn:  # as SGLang's checker reports it
                t = fp8_checker_view(t.cuda(), engine_tensors(qhf, name + "_scale_inv", m.bridge).cuda())
            bitwise[name] = None if t is None else f"{tensor_hash(t.cuda().contiguous()):016x}" == sums[name]
        report["bitwise"] = bitwise
        report["bitwise_all_equal"] = all(v is True for v in bitwise.values() if v is not None)
        probe = torch.randint(0, m.bridge.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))

        async def engine_probe(c):
            out = await c.generate(probe[0].tolist(), {"max_new_tokens": 1, "temperature": 0.0}, rid="fp8-probe",
                                   logprob_start_len=0)
            return out.input_logprobs[1:]

        got = torch.tensor(engine_call(engine.url, engine_probe))
        syncer.close()
        m.model.eval()
        bf16 = token_logprobs(forward_logits(m.model, m.layout, probe.cuda()), probe.cuda(), m.bridge.vocab_size)[0]
        deq_dir = os.path.join(a.run_dir, "dequantized")
        save_hf(dequantize(hf, torch.bfloat16, ignored), deq_dir, config_src=a.hf)
        destroy()
        d = load_model(argparse.Namespace(**{**vars(layout_args), "hf": deq_dir}))
        d.model.eval()
        deq = token_logprobs(forward_logits(d.model, d.layout, probe.cuda()), probe.cuda(), m.bridge.vocab_size)[0]
        report["probe_max_abs_diff_vs_dequantized"] = (got - deq.float().cpu()).abs().max().item()
        report["probe_max_abs_diff_vs_bf16"] = (got - bf16.float().cpu()).abs().max().item()
        report["probe_ok"] = report["probe_max_abs_diff_vs_dequantized"] <= a.probe_tol
    finally:
        engine.stop()
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "bitwise"}, indent=1), flush=True)
    ok = report.get("bitwise_all_equal") and report.get("probe_ok") and not report["sync"]["failed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
