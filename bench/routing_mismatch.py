"""Train/inference routing mismatch: transformers vs Megatron on the same weights and inputs, without
and with Keep Routing (Megatron replaying transformers' expert choices). One process, TP1.

    python bench/routing_mismatch.py                          # CPU: tiny model, fp32 and bf16
    python bench/routing_mismatch.py --scale gpu --json m.json  # one GPU: §13's 490M MoE, 4 x 512 tokens

transformers stands in for the inference engine. Its routing is read from forward hooks on every
``model.model.layers[i].mlp.gate`` (the top-k ids it returns; its logits' top-k if a version returns
logits only). Megatron's natural routing is recorded by a ``ReplayDriver`` in RECORD mode; with replay,
a ``ReplayDriver`` in REPLAY mode feeds transformers' ids and forward hooks on Megatron's routers read
back the experts actually dispatched to (their routing map), so the replayed disagreement is measured,
not assumed. Reported per dtype: token-layer decisions whose expert sets differ (all layers, worst
layer), tokens differing in >= 1 layer, mean |logprob diff| of the next tokens, mean full-vocab
KL(transformers || Megatron); and transformers' own bf16-vs-fp32 logprob error as the floor.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from rich.console import Console
from rich.table import Table

from _bench_common import device_name, dump, make_model, slug


def hf_forward(path: str, ids: torch.Tensor, dtype: torch.dtype, attn: str):
    """transformers' logits [B, S, V] (fp32) and routes [B, S, L, K] of every MoE layer."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(ids.device).eval()
    k = hf.config.num_experts_per_tok
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue  # dense layer

        def hook(_m, _inp, out, i=i):
            outs = out if isinstance(out, tuple) else (out,)
            idx = next((o for o in outs if torch.is_tensor(o) and not o.is_floating_point()), None)
            if idx is None:  # a version returning router logits only
                idx = outs[0].float().softmax(-1).topk(k, -1).indices
            got[i] = idx.reshape(-1, k).detach()

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float()
    for h in hooks:
        h.remove()
    b, s = ids.shape
    routes = torch.stack([got[i].view(b, s, k) for i in sorted(got)], 2).long()
    del hf
    return logits, routes


def router_taps(model) -> list:
    """Forward hooks on Megatron's routers: the expert set of each token (from the routing map)."""
    calls = []
    for layer in model.decoder.layers:
        r = getattr(layer.mlp, "router", None)
        if r is None:
            continue

        def hook(_m, _inp, out):
            rmap = out[1]
            k = int(rmap.sum(1).max())
            calls.append(rmap.float().topk(k, dim=1).indices.detach())

        r.register_forward_hook(hook)
    return calls


def compare(mc_logits, hf_logits, ids, vocab: int) -> dict:
    from mrl.megatron.forward import token_logprobs

    lp_mc = token_logprobs(mc_logits, ids, vocab)
    lp_hf = token_logprobs(hf_logits, ids, vocab)
    a = torch.log_softmax(hf_logits[..., :vocab].float(), -1)
    b = torch.log_softmax(mc_logits[..., :vocab].float(), -1)
    kl = (a.exp() * (a - b)).sum(-1).mean()
    return {"logprob_mean_abs_diff": float((lp_mc - lp_hf).abs().mean()),
            "logprob_max_abs_diff": float((lp_mc - lp_hf).abs().max()), "kl_hf_mc": float(kl)}


def disagreement(a_bslk: torch.Tensor, b_bslk: torch.Tensor) -> dict:
    x, _ = a_bslk.sort(-1)
    y, _ = b_bslk.sort(-1)
    differ = (x != y).any(-1).flatten(0, 1).float()  # [T, L]
    return {"decisions_differ": float(differ.mean()), "worst_layer_differ": float(differ.mean(0).max()),
            "tokens_differ_any_layer": float((differ.sum(1) > 0).float().mean())}


def run(hf_path: str, dtype: str, ids: torch.Tensor, attn: str) -> dict:
    from mrl.jobs.common import add_layout_args, load_model
    from mrl.megatron.forward import forward_logits
    from mrl.routing.codec import RoutesCodec
    from mrl.routing.replay import RankSlice, ReplayDriver, ReplayMode

    ap = argparse.ArgumentParser()
    add_layout_args(ap)
    m = load_model(ap.parse_args(["--hf", hf_path, "--dtype", dtype]))
    model, layout, cfg, bridge = m.model.eval(), m.layout, m.cfg, m.bridge
    codec = RoutesCodec.from_bridge(bridge)
    rs = RankSlice(tp_rank=0, tp_size=1, sequence_parallel=False, moe_columns=tuple(range(len(codec.moe_layers))))
    b, s = ids.shape
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    hf_logits, hf_routes = hf_forward(hf_path, ids, tdt, attn)
    out = {}
    if dtype == "bf16":  # transformers' own bf16 error (vs its fp32 run): the noise floor
        ref_logits, _ = hf_forward(hf_path, ids, torch.float32, attn)
        out["hf_bf16_vs_fp32"] = compare(hf_logits, ref_logits, ids, bridge.vocab_size)
        del ref_logits
    # natural megatron routing (RECORD)
    rec = ReplayDriver(cfg, rs, ReplayMode.record)
    rec.before_forward(None)
    logits = forward_logits(model, layout, ids)
    rec.after_forward(logits)
    rec.close()
    nat = torch.stack([t.to(ids.device).view(s, b, -1).transpose(0, 1) for t in rec.recorded[0]], 2).long()
    out["no_replay"] = {**disagreement(nat, hf_routes), **compare(logits, hf_logits, ids, bridge.vocab_size)}
    # megatron replaying transformers' routing
    taps = router_taps(model)
    drv = ReplayDriver(cfg, rs, ReplayMode.replay)
    drv.before_forward(hf_routes)
    logits_r = forward_logits(model, layout, ids)
    drv.close()
    used = torch.stack([t.view(s, b, -1).transpose(0, 1) for t in taps], 2).long()
    out["replay"] = {**disagreement(used, hf_routes), **compare(logits_r, hf_logits, ids, bridge.vocab_size)}
    out["moe_layers"] = len(codec.moe_layers)
    out["top_k"] = codec.top_k
    out["num_experts"] = codec.num_experts
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--preset", default=None, help="tiny | stress_a | gpu (default: tiny on CPU, gpu on GPU)")
    ap.add_argument("--hf", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    gpu = a.scale == "gpu"
    preset = a.preset or ("gpu" if gpu else "tiny")
    hf = a.hf or make_model(os.path.join(tempfile.mkdtemp(prefix="mrl_mismatch_"), preset), preset)
    b, s = a.batch or (4 if gpu else 2), a.seq or (512 if gpu else 64)
    from mrl.megatron import compat

    vocab = __import__("json").load(open(os.path.join(hf, "config.json")))["vocab_size"]
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0)).to(compat.DEVICE)
    res = {d: run(hf, d, ids, a.attn) for d in a.dtypes}
    dev = device_name().replace(f"{torch.cuda.device_count()}x ", "1x ") if gpu else "CPU"
    t = Table(title=f"routing: transformers ({a.attn}) vs Megatron (local spec), {preset}, {b} x {s} random tokens, "
                    f"{dev}")
    for c in ("dtype", "Megatron routing", "decisions differ", "worst layer", "tokens differ (>=1 layer)",
              "mean |lp diff|", "max |lp diff|", "KL(hf||mc)"):
        t.add_column(c)
    for d, r in res.items():
        for mode in ("no_replay", "replay"):
            x = r[mode]
            t.add_row(d, "natural" if mode == "no_replay" else "replays transformers'",
                      f"{100 * x['decisions_differ']:.2f}%", f"{100 * x['worst_layer_differ']:.1f}%",
                      f"{100 * x['tokens_differ_any_layer']:.1f}%", f"{x['logprob_mean_abs_diff']:.2e}",
                      f"{x['logprob_max_abs_diff']:.2e}", f"{x['kl_hf_mc']:.2e}")
        if "hf_bf16_vs_fp32" in r:
            x = r["hf_bf16_vs_fp32"]
            t.add_row(d, "(transformers bf16 vs fp32)", "", "", "", f"{x['logprob_mean_abs_diff']:.2e}",
                      f"{x['logprob_max_abs_diff']:.2e}", f"{x['kl_hf_mc']:.2e}")
    Console(width=170).print(t)
    dump({"bench": "routing_mismatch", "device": dev, "preset": preset, "batch": b, "seq": s, "attn": a.attn,
          "results": res}, a.json, name=f"routing_mismatch_{slug(device_name())}")


if __name__ == "__main__":
    main()
