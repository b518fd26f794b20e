#!/usr/bin/env bash
# LoRA on GPUs (NCCL; megatron's TE spec when Transformer Engine imports): tests/jobs/lora_check per layout on
# stress_a (fp32, adapters on attention, the dense layer and every expert), 2 GPUs. Each case reports its
# logits against transformers on the merged checkpoint; the summary adds each sharded adapter's largest
# difference to the 1-GPU run's after one RL step.
# On the GPU machine (torch preinstalled, no megatron-core): carry the megatron-core cp312 wheel in .whl/.
#   bash tests/gpu/lora.sh [OUT_DIR]        -> OUT_DIR/gpu_lora.json + one folder per case
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_lora}}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch, megatron.core as m; from mrl._compat.te import trainer_spec; print('torch', torch.__version__, 'megatron-core', m.__version__, 'spec', trainer_spec())" | tee "$OUT/stack.txt"
M=/tmp/mrl_models
python3 -m mrl make-tiny-model $M/stress_a --preset stress_a >/dev/null || exit 1
python3 -c "from tests.jobs.lora_check import write_random_adapter as w; w('$M/stress_a', '$OUT', rank=4, alpha=8.0, targets=['attention', 'dense_mlp', 'experts'])" || exit 1
fails=0
run() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  mkdir -p "$OUT/$name"
  python3 -m torch.distributed.run --standalone --nproc-per-node=$n -m tests.jobs.lora_check --hf $M/stress_a \
    --adapter "$OUT/adapter" --merged "$OUT/merged" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
    || { fails=$((fails+1)); echo "FAIL $name"; tail -5 "$OUT/$name.log"; }
}
run tp1 1 parallel=tp1
run tp2_sp 2 parallel=tp2_sp
run ep2 2 --ckpt /tmp/mrl_lora_ck parallel=ep2
run tp2_ep2 2 parallel=tp2_ep2
run pp2 2 parallel=pp2
python3 - "$OUT" <<'PY'
import json, os, sys
from mrl.models.peft import load_peft
out = sys.argv[1]
ref, _ = load_peft(os.path.join(out, "tp1", "adapter"))
rows = {}
for name in ("tp1", "tp2_sp", "ep2", "tp2_ep2", "pp2"):
    f = os.path.join(out, name, "report.json")
    if not os.path.isfile(f):
        continue
    d = json.load(open(f))
    got, _ = load_peft(os.path.join(out, name, "adapter"))
    d["adapter_max_abs_diff_vs_tp1"] = max((got[k] - ref[k]).abs().max().item() for k in ref)
    rows[name] = {k: v for k, v in d.items() if k != "layout"}
json.dump(rows, open(os.path.join(out, "gpu_lora.json"), "w"), indent=1)
for k, v in rows.items():
    print(k, {a: b for a, b in v.items() if not isinstance(b, dict)})
PY
echo "failures: $fails"
exit $fails
