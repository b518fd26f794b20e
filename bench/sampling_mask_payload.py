"""Keep Sampling Mask payload: bytes per token of ``output_top_logprobs`` (top_logprobs_num = top_k) vs routes.

    python bench/sampling_mask_payload.py            # computed from the JSON encoding (orjson, as the server)
    python bench/sampling_mask_payload.py --engine   # also measured on a real tiny SGLang CPU engine (~1 min)

SGLang answers with ORJSONResponse, so ``orjson.dumps`` of a field is its size on the wire. Each candidate is
``[logprob, id, text]``; ``text`` is null under --skip-tokenizer-init (mrl's engines), a quoted string otherwise.
"Kept ids" is the compact form after the client rebuilds the support: int32 ids of the kept candidates.
"""

import argparse
import asyncio
import base64
import math
import os
import tempfile

import httpx
import numpy as np
import orjson
import torch
from rich.console import Console
from rich.table import Table

from _bench_common import dump

from mrl.routing.sampling_mask import support_from_top_logprobs

TOP_KS = (5, 20, 50)
TOKENS = 256
# (name, vocab, num_layers, moe_layers, experts_per_tok, num_experts)
MODELS = [("tiny (mrl tests)", 512, 3, 3, 2, 8), ("Qwen3-30B-A3B", 151936, 48, 48, 8, 128)]


def top_logprobs_payload(vocab: int, k: int, temperature: float = 1.0, seed: int = 0) -> list:
    """Engine-shaped output_top_logprobs for TOKENS positions: fp32 logprobs as Python floats, [lp, id, null]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, vocab, generator=g) * 2.0
    lp, ids = torch.log(torch.softmax(logits / temperature, -1)).topk(k, dim=-1)
    return [[[v, i, None] for v, i in zip(rv, ri)] for rv, ri in zip(lp.tolist(), ids.tolist())]


def routes_wire_bytes(num_layers: int, top_k: int) -> float:
    """base64 of int32 [layers, top_k] per token (the routed_experts string), amortized."""
    return 4 * math.ceil(4 * num_layers * top_k * TOKENS / 3) / TOKENS


def computed_rows():
    rows = []
    for name, vocab, layers, moe_layers, kr, experts in MODELS:
        compact_routes = moe_layers * kr * (1 if experts <= 256 else 2)
        for k in TOP_KS:
            top = top_logprobs_payload(vocab, k)
            wire = len(orjson.dumps(top)) / TOKENS
            kept = support_from_top_logprobs(top, temperature=1.0, top_k=k, top_p=0.95, min_p=0.0)
            kept_bytes = 4 * np.mean([len(x) for x in kept])
            rows.append((name, "computed", k, wire, kept_bytes, routes_wire_bytes(layers, kr), compact_routes))
    return rows


async def measured_rows(url: str, api_key: str, codec_layers: tuple[int, int, int]):
    layers, moe_layers, kr = codec_layers
    rows = []
    auth = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=auth) as http:
        for k in TOP_KS:
            body = {"input_ids": [1, 17, 42, 99, 7], "rid": f"payload-{k}", "return_logprob": True,
                    "top_logprobs_num": k, "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "top_k": k, "top_p": 0.95,
                                        "ignore_eos": True}}
            resp = (await http.post("/generate", json=body)).json()
            if "meta_info" not in resp:
                raise RuntimeError(f"engine error: {resp}")
            meta = resp["meta_info"]
            top = meta["output_top_logprobs"]
            n = len(top)
            wire = len(orjson.dumps(top)) / n
            kept = support_from_top_logprobs(top, temperature=1.0, top_k=k, top_p=0.95, min_p=0.0)
            kept_bytes = 4 * np.mean([len(x) for x in kept])
            routes = meta["routed_experts"]
            rows_routes = len(base64.b64decode(routes)) // (4 * layers * kr)  # prompt + response - 1 rows
            rows.append(("tiny (mrl tests)", "measured", k, wire, kept_bytes, len(routes) / rows_routes,
                         moe_layers * kr))
    return rows


def measure_on_engine():
    from mrl.models.tiny import make_tiny_model
    from mrl.engine.launcher import Engine

    tmp = tempfile.mkdtemp(prefix="mrl_smask_bench_")
    model = make_tiny_model(os.path.join(tmp, "tiny"))
    with Engine(model_path=model, tp=1, log_dir=tmp, name="payload") as eng:
        eng.wait_healthy(600)
        return asyncio.run(measured_rows(eng.url, eng.secrets.api_key, (3, 3, 2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true", help="also measure on a real tiny SGLang CPU engine")
    ap.add_argument("--json", default=None, help="report path (default: bench/reports/<topic>/<date>_<name>.json)")
    a = ap.parse_args()
    rows = computed_rows() + (measure_on_engine() if a.engine else [])
    t = Table(title="bytes per response token: top logprobs (top_logprobs_num = top_k, top_p 0.95) vs routes")
    for c in ("model", "source", "top_k", "top_logprobs wire", "kept ids int32", "routes wire", "routes compact",
              "top_logprobs / routes wire"):
        t.add_column(c)
    for name, src, k, wire, kept, rwire, rcompact in rows:
        t.add_row(name, src, str(k), f"{wire:.0f}", f"{kept:.0f}", f"{rwire:.0f}", str(rcompact),
                  f"{wire / rwire:.2f}")
    Console(width=160).print(t)
    keys = ("model", "source", "top_k", "top_logprobs_wire", "kept_ids_int32", "routes_wire", "routes_compact")
    dump({"bench": "sampling_mask_payload", "bytes_per_token": [dict(zip(keys, r)) for r in rows]}, a.json,
         name="sampling_mask_payload")


if __name__ == "__main__":
    main()
