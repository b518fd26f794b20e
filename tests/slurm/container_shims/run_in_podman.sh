#!/bin/bash
# What pyxis/enroot and Apptainer do for one Slurm task, done with podman: run CMD in IMAGE with the task's
# environment, MOUNTS (src:dst[:ro],...) bound, in WORKDIR, sharing the host's network and IPC namespaces
# (enroot and Apptainer create neither), signals forwarded to CMD.
#   run_in_podman.sh IMAGE MOUNTS WORKDIR CMD...
set -euo pipefail
image=$1 mounts=$2 workdir=$3
shift 3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
podman=${MRL_PODMAN:-$here/../../../docker/podman.sh}
echo "[run_in_podman] $image: $*" >&2
envfile=$(mktemp)
trap 'rm -f "$envfile"' EXIT
# the task's environment (SLURM_*, RUN_DIR, PET_*, ...) minus what belongs to the host's file system
while IFS= read -r -d '' kv; do
  case ${kv%%=*} in
    PATH|HOME|PWD|OLDPWD|SHLVL|_|TMPDIR|LD_LIBRARY_PATH|LD_PRELOAD|PYTHONPATH|PYTHONHOME|VIRTUAL_ENV|CONTAINERS_CONF) ;;
    *) [[ $kv == *$'\n'* ]] || printf '%s\n' "$kv" >> "$envfile" ;;
  esac
done < <(env -0)
vols=()
IFS=, read -ra ms <<< "$mounts"
for m in "${ms[@]}"; do [[ -n $m ]] && vols+=(--volume "$m"); done
"$podman" run --rm --network host --ipc host --env-file "$envfile" "${vols[@]}" --workdir "$workdir" \
  "$image" "$@" &
pid=$!
# srun signals this task (TERM at the end of a step, USR1 for preemption): pass it to podman, which proxies it
for sig in TERM INT USR1 USR2; do trap "kill -$sig $pid 2>/dev/null" "$sig"; done
set +e
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || break  # a trapped signal interrupts wait: wait again while podman runs
done
exit "$rc"
