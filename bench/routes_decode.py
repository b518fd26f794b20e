"""Client-side cost of Keep Routing's routes: decoding one reply's routed experts, per sample.

    python bench/routes_decode.py                 # Qwen3-30B-A3B shapes (48 and 12 layers), 256 + 512 tokens

The rollout client decodes every reply's routes in its event loop; at a large batch the replies arrive
together, so this is time every sample of the batch waits for. Baseline: SGLang's own reader
(``sglang.srt.state_capturer.routed_experts.extract_routed_experts_from_meta_info``: pybase64 of plain
int32, no checks). Measured: ``mrl.routing.codec.RoutesCodec.decode`` on what mrl's engines send (uint8)
and on plain SGLang's int32, with its checks (row count, id range, no repeated expert within a token).
Each repetition decodes ``--samples`` replies; the median and spread over ``--reps`` are reported.
"""

import argparse
import base64
import statistics
import time
import warnings

import numpy as np

from _bench_common import dump

from mrl.routing.codec import RoutesCodec

SHAPES = {"qwen3_30b_a3b": (48, 8, 128), "qwen3_30b_a3b_l12": (12, 8, 128)}


def routes(rows: int, layers: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
    """Distinct experts per (token, layer), as a router picks them."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :k].astype(np.int32)


def per_sample_ms(fn, payload: str, samples: int) -> float:
    t = time.perf_counter()
    for _ in range(samples):
        fn(payload)
    return (time.perf_counter() - t) / samples * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning, module="sglang")  # GPU-kernel notices on import
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    rows = a.prompt_len + a.new - 1
    result = {"bench": "routes_decode", "prompt_len": a.prompt_len, "new": a.new, "samples": a.samples,
              "reps": a.reps, "shapes": {}}
    for name, (layers, k, experts) in SHAPES.items():
        ids = routes(rows, layers, k, experts)
        codec = RoutesCodec(num_layers=layers, top_k=k, num_experts=experts, moe_layers=tuple(range(layers)))
        wire = {"int32": base64.b64encode(ids.tobytes()).decode(),
                "uint8": base64.b64encode(ids.astype(np.uint8).tobytes()).decode()}
        cases = {
            "sglang_int32": (lambda p: extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": p}}),
                             wire["int32"]),
            "mrl_uint8": (lambda p: codec.decode(p, prompt_len=a.prompt_len, response_len=a.new), wire["uint8"]),
            "mrl_int32": (lambda p: codec.decode(p, prompt_len=a.prompt_len, response_len=a.new), wire["int32"]),
        }
        np.testing.assert_array_equal(cases["mrl_uint8"][0](wire["uint8"]), ids)
        runs = {c: [] for c in cases}
        for _ in range(a.reps):
            for c, (fn, payload) in cases.items():
                runs[c].append(per_sample_ms(fn, payload, a.samples))
        row = {"rows": rows, "layers": layers, "top_k": k, "experts": experts,
               "wire_bytes": {w: len(p) for w, p in wire.items()}, "per_sample_ms": runs}
        for c, ms in runs.items():
            q = statistics.quantiles(ms, n=4)
            row[c] = {"median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2],
                      "batch_ms": statistics.median(ms) * a.samples}
        row["mrl_uint8_vs_sglang_int32"] = row["mrl_uint8"]["median_ms"] / row["sglang_int32"]["median_ms"]
        result["shapes"][name] = row
        print(f"{name}: per sample  sglang int32 {row['sglang_int32']['median_ms']:.3f} ms, "
              f"mrl uint8 {row['mrl_uint8']['median_ms']:.3f} ms, mrl int32 {row['mrl_int32']['median_ms']:.3f} ms; "
              f"a batch of {a.samples}: {row['mrl_uint8']['batch_ms']:.0f} ms", flush=True)
    dump(result, a.json, name="routes_decode_cpu")


if __name__ == "__main__":
    main()
