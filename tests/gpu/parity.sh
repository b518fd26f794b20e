#!/usr/bin/env bash
# GPU parity (NCCL): mrl's Megatron model vs transformers per layout, fp32 and bf16, on 2 GPUs.
# On the GPU machine (torch preinstalled, no megatron-core): carry the megatron-core cp312 wheel in .whl/.
#   bash tests/gpu/parity.sh [OUT_DIR]        -> OUT_DIR/gpu_parity.json + one report per case
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_parity}}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__)" | tee -a "$OUT/gpus.txt"
M=/tmp/mrl_models
for p in tiny stress_a; do python3 -m mrl make-tiny-model $M/$p --preset $p >/dev/null || exit 1; done
fails=0
run() {  # name nproc args...
  local name=$1 n=$2; shift 2
  python3 -m torch.distributed.run --standalone --nproc-per-node=$n -m mrl.jobs.check_model "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || { fails=$((fails+1)); echo "FAIL $name"; tail -5 "$OUT/$name.log"; }
}
for dt in bf16 fp32; do
  for p in tiny stress_a; do
    run ${p}_tp2_$dt 2 --hf $M/$p --tp 2 --dtype $dt
    run ${p}_ep2_$dt 2 --hf $M/$p --ep 2 --dtype $dt
    run ${p}_tp2ep2_$dt 2 --hf $M/$p --tp 2 --ep 2 --etp 1 --dtype $dt
  done
  run stress_a_pp2_$dt 2 --hf $M/stress_a --pp 2 --dtype $dt
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*_*.json"))):
    d = json.load(open(f))
    keep = ("dtype", "layout", "logits_max_abs_diff", "logprobs_max_abs_diff", "logprobs_mean_abs_diff",
            "hf_bf16_logprobs_mean_abs_diff", "hf_bf16_logprobs_max_abs_diff", "roundtrip_bit_exact", "pass")
    rows[os.path.basename(f)[:-5]] = {k: d[k] for k in keep if k in d}
json.dump(rows, open(os.path.join(out, "gpu_parity.json"), "w"), indent=1)
for k, v in rows.items():
    print(f"{k:22s} " + " ".join(f"{a}={b:.3g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
PY
echo "failures: $fails"
exit $fails
