#!/usr/bin/env bash
# The engine-vs-trainer mismatch split by cause (mismatch/* metrics, docs/keep_routing.md) on 2 GPUs in bf16:
# `mrl train model=tiny_gpu engine=gpu` in overlap mode, trainer on GPU 0 and one engine on GPU 1, weights
# synced every step over NCCL, twice:
#   launched  the engine mrl starts itself (with its engine patches: compact routes, replayed loads)
#   attached  a plain `python -m sglang.launch_server` started here and attached through engine.urls
#             (no patch of mrl's: int32 routes, SGLang's own weight loading)
# Prints each run's medians over its steps -- numerics (lag-0 tokens, replay on), routing (replay off minus
# on), staleness (older tokens, with the correction weights) -- and writes OUT_DIR/mismatch_split.json.
# Needs the GPU stack (scripts/gpu/README.md; `source STACK/env.sh [te]` first) and GPUs 0 and 1 free.
#   bash tests/gpu/mismatch_split.sh [OUT_DIR]
#   STEPS=100 EXTRA="algo.correction=icepop" bash tests/gpu/mismatch_split.sh runs/split_icepop
set -uo pipefail
OUT=${1:-${OUT:-runs/gpu_mismatch_split}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
export NCCL_CUMEM_ENABLE=0  # as mrl sets for its own engines (mrl.engine.gpu_mode): NCCL weight updates
STEPS=${STEPS:-60}; PORT=${PORT:-31000}; LIMIT=${TIMEOUT:-1500}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, sglang, megatron.core as m; from mrl._compat.te import trainer_spec; print('torch', torch.__version__, 'sglang', sglang.__version__, 'megatron-core', m.__version__, 'spec', trainer_spec())" | tee -a "$OUT/gpus.txt"
M=/tmp/mrl_models/tiny_gpu
[ -f $M/config.json ] || python3 -m mrl make-tiny-model $M --preset tiny_gpu >/dev/null || exit 1
# overlap mode is the preset's default (conf/train/default.yaml); said here because it is the point
COMMON=(model=tiny_gpu "model.hf_path=$M" engine=gpu train.mode=overlap "train.steps=$STEPS" train.eval_every=0)
fails=0

# 1. the engine mrl launches: GPU 1, after the trainer rank's GPU 0
# shellcheck disable=SC2086
timeout "$LIMIT" python3 -m mrl train "${COMMON[@]}" "run_dir=$OUT/launched" ${EXTRA:-} > "$OUT/launched.log" 2>&1 \
  || { fails=$((fails+1)); echo "FAIL launched"; tail -20 "$OUT/launched.log"; }

# 2. a plain SGLang server on GPU 1, started with what mrl needs of any engine: token ids in and out, integer
#    weight versions, routed experts (Keep Routing), the run's dtype; then attached by URL
BACKEND=$(python3 -c "from mrl.engine.gpu_mode import attention_backend; print(attention_backend())")
setsid python3 -m sglang.launch_server --model-path $M --host 127.0.0.1 --port "$PORT" --tp-size 1 --base-gpu-id 1 \
  --skip-tokenizer-init --weight-version 0 --enable-return-routed-experts --dtype bfloat16 \
  --mem-fraction-static 0.7 --max-running-requests 64 --attention-backend "$BACKEND" --skip-server-warmup \
  > "$OUT/plain_server.log" 2>&1 &
SERVER=$!
stop_server() { kill -TERM -- -"$SERVER" 2>/dev/null; sleep 5; kill -KILL -- -"$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }
trap stop_server EXIT
up=0
for _ in $(seq 1 120); do  # 10 minutes at most
  if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2>/dev/null; then
    up=1; break
  fi
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 5
done
if [ $up = 1 ]; then
  # shellcheck disable=SC2086
  timeout "$LIMIT" python3 -m mrl train "${COMMON[@]}" "run_dir=$OUT/attached" "engine.urls=[http://127.0.0.1:$PORT]" \
    ${EXTRA:-} > "$OUT/attached.log" 2>&1 || { fails=$((fails+1)); echo "FAIL attached"; tail -20 "$OUT/attached.log"; }
else
  fails=$((fails+1)); echo "FAIL attached: the plain SGLang server did not come up"; tail -20 "$OUT/plain_server.log"
fi
stop_server; trap - EXIT

python3 - "$OUT" <<'PY'
import json, os, statistics, sys

out = sys.argv[1]
parts = {"numerics": ("mismatch/numerics_kl", "mismatch/numerics_logprob_diff", "mismatch/numerics_tokens"),
         "numerics_resumed": ("mismatch/numerics_resumed_kl", "mismatch/numerics_resumed_logprob_diff",
                              "mismatch/numerics_resumed_tokens"),
         "routing": ("mismatch/routing_kl", "mismatch/routing_logprob_diff", None),
         "staleness": ("mismatch/stale_kl", "mismatch/stale_logprob_diff", "mismatch/stale_tokens")}
report = {}
for run in ("launched", "attached"):
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.isfile(path):
        continue
    steps = [r for r in map(json.loads, open(path)) if "step_seconds" in r]
    med = lambda k: statistics.median(v) if (v := [r[k] for r in steps if k in r]) else None
    row = {"steps": len(steps), "kl_engine_replay_on_median": med("kl_engine_replay_on")}
    for name, (kl, diff, n) in parts.items():
        row[name] = {"kl_median": med(kl), "kl_max": max((r[kl] for r in steps if kl in r), default=None),
                     "logprob_diff_median": med(diff), "steps_with_tokens": sum(kl in r for r in steps)}
        if n:
            row[name]["tokens"] = int(sum(r.get(n, 0) for r in steps))
    row["staleness"]["is_weight_mean_median"] = med("mismatch/stale_is_weight_mean")
    row["staleness"]["is_cut_frac_median"] = med("mismatch/stale_is_cut_frac")
    lags = sorted({k for r in steps for k in r if k.startswith("mismatch/stale_lag") and k.endswith("_tokens")})
    row["staleness"]["tokens_by_lag"] = {k.split("_lag")[1].split("_")[0]: int(sum(r.get(k, 0) for r in steps))
                                         for k in lags}
    report[run] = row
json.dump(report, open(os.path.join(out, "mismatch_split.json"), "w"), indent=1)
fmt = lambda x: "-" if x is None else f"{x:.2e}"
print(f"{'run':9} {'part':17} {'KL median':>10} {'KL max':>10} {'|dlogp| med':>12} {'tokens':>8}")
for run, row in report.items():
    for name in parts:
        p = row[name]
        print(f"{run:9} {name:17} {fmt(p['kl_median']):>10} {fmt(p['kl_max']):>10} "
              f"{fmt(p['logprob_diff_median']):>12} {p.get('tokens', '-'):>8}")
    s = row["staleness"]
    print(f"{run:9} staleness by lag {s['tokens_by_lag']}, correction weight median {fmt(s['is_weight_mean_median'])}, "
          f"cut fraction median {fmt(s['is_cut_frac_median'])}; kl_engine_replay_on median {fmt(row['kl_engine_replay_on_median'])}")
PY
echo "failures: $fails"
exit $fails
