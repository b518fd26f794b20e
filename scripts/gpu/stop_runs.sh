#!/usr/bin/env bash
# Stops what a detached GPU run left behind (its driver, mrl's trainer ranks and engines) before another starts.
# Its own ancestors are spared: the command that calls it may name the same scripts.
set -u
keep=" $$ "
p=$$
while [ "$p" -gt 1 ]; do p=$(ps -o ppid= -p "$p" | tr -d ' '); keep="$keep$p "; done
for pat in recipe_export.sh recipe_run.py run_phases.sh mrl.jobs sglang torchrun export_time.py; do
  for pid in $(pgrep -f "$pat"); do
    case "$keep" in *" $pid "*) continue ;; esac
    kill -9 "$pid" 2>/dev/null
  done
done
sleep 2
nvidia-smi --query-gpu=memory.used --format=csv,noheader
