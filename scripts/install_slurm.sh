#!/usr/bin/env bash
# Install the Slurm daemons, client tools and munge from Debian/Ubuntu packages, if missing.
# Idempotent and quiet: a no-op when sbatch, slurmctld, slurmd and munged are already on PATH; apt's
# output is shown only when it fails. Used by tests/slurm (a real one-node cluster on localhost).
set -euo pipefail
need=()
for bin in sbatch slurmctld slurmd munged; do
  command -v "$bin" >/dev/null 2>&1 || need+=("$bin")
done
(( ${#need[@]} == 0 )) && exit 0
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: missing ${need[*]}; installing them needs root and apt-get" \
       "(as root: apt-get install -y slurm-wlm munge)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# No daemon may start from the package scripts: the tests start their own, with their own config.
policy=/usr/sbin/policy-rc.d
cleanup() { rm -f "$log"; }
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
  cleanup() { rm -f "$log" "$policy"; }
fi
trap cleanup EXIT
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$log" 2>&1; then
  echo "install_slurm.sh: apt-get failed:" >&2; tail -30 "$log" >&2; exit 1
fi
for bin in sbatch slurmctld slurmd munged; do
  command -v "$bin" >/dev/null 2>&1 || { echo "install_slurm.sh: $bin still missing after install" >&2; exit 1; }
done
