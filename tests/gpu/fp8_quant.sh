#!/usr/bin/env bash
# Block-FP8 quantizer on a GPU: the fused triton kernel against the torch path, bit for bit (codes and
# scales), on Qwen3-30B-A3B's shapes (one layer's expert stacks, attention, dense) and on edge shapes; the
# CUDA-only tests of tests/unit/test_fp8_quant.py; and both paths' time per call.
#   bash tests/gpu/fp8_quant.sh [OUT_DIR]        -> OUT_DIR/fp8_quant.json
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_fp8_quant}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -m pytest tests/unit/test_fp8_quant.py tests/unit/test_fp8_sync.py -q -k "triton" 2>&1 | tee "$OUT/pytest.log" | tail -3
rc_tests=${PIPESTATUS[0]}
python3 - "$OUT" <<'PY'
import json, os, sys
import torch, triton
from mrl.quant.fp8 import quantize_block_fp8, quantize_block_fp8_torch

out = sys.argv[1]
torch.manual_seed(0)
shapes = {  # Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768, 32 q / 4 kv heads of 128
    "experts_gate_up": (128, 1536, 2048), "experts_down": (128, 2048, 768), "q_proj": (4096, 2048),
    "k_proj": (512, 2048), "o_proj": (2048, 4096), "edge_2d": (1000, 777), "edge_3d": (3, 130, 260)}
rows, ok = {}, True


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1000


for name, shape in shapes.items():
    w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    w.view(-1)[torch.randint(0, w.numel(), (w.numel() // 500,), device="cuda")] *= 40
    w[..., :128, :128] = 0  # an all-zero block
    q0, s0 = quantize_block_fp8_torch(w)
    q1, s1 = quantize_block_fp8(w, backend="triton")
    codes = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
    scales = torch.equal(s0, s1)
    ok &= codes and scales
    rows[name] = {"shape": list(shape), "codes_equal": codes, "scales_equal": scales,
                  "codes_differing": int((q0.view(torch.uint8) != q1.view(torch.uint8)).sum()),
                  "torch_s": timed(lambda: quantize_block_fp8_torch(w)),
                  "triton_s": timed(lambda: quantize_block_fp8(w, backend="triton")),
                  "bytes_in": w.numel() * w.element_size()}
    print(name, rows[name], flush=True)
report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
          "bit_equal": ok, "cases": rows}
json.dump(report, open(os.path.join(out, "fp8_quant.json"), "w"), indent=1)
sys.exit(0 if ok else 1)
PY
rc_cmp=$?
echo "pytest rc=$rc_tests, comparison rc=$rc_cmp"
exit $(( rc_tests || rc_cmp ))
