"""Fake srun / scontrol / squeue / scancel / apptainer for running a rendered multi-node batch script on one
machine: each srun task runs locally with SLURM_PROCID and FAKE_HOST set, every call is recorded.

The real one-node cluster (localslurm.py) cannot host an engine node and a trainer node at once; these
fakes check the script's multi-node logic (host split, placement, container flags, engine stop) instead.
"""

from __future__ import annotations

import os
import stat
import sys

SRUN = r'''
import json, os, re, signal, subprocess, sys
fake = os.environ["FAKE_DIR"]

def expand(nodelist):
    out = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
        out += [f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)] if m else [part]
    return out

argv = sys.argv[1:]
opts, i = {}, 0
while i < len(argv) and argv[i].startswith("-"):
    k, _, v = argv[i].partition("=")
    opts[k] = v
    i += 1
cmd = argv[i:]
if "--het-group" in opts:
    hosts = expand(os.environ["SLURM_JOB_NODELIST_HET_GROUP_" + opts["--het-group"]])
else:
    hosts = expand(opts["--nodelist"])
assert len(hosts) == int(opts["--ntasks"]) == int(opts["--nodes"]), (hosts, opts)
name = opts.get("--job-name", "step")
with open(os.path.join(fake, "srun.log"), "a") as f:
    f.write(json.dumps({"argv": argv, "hosts": hosts, "name": name}) + "\n")
procs = []
for rank, host in enumerate(hosts):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(len(hosts)), FAKE_HOST=host)
    out = open(opts["--output"].replace("%N", host), "a") if "--output" in opts else None
    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
os.makedirs(os.path.join(fake, "steps"), exist_ok=True)
with open(os.path.join(fake, "steps", name), "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
signal.signal(signal.SIGUSR1, lambda *_: [p.send_signal(signal.SIGUSR1) for p in procs])
signal.signal(signal.SIGTERM, lambda *_: [p.kill() for p in procs])  # real srun ends the step at once
codes = [p.wait() for p in procs]
sys.exit(max((128 - c if c < 0 else c) for c in codes))
'''

SCONTROL = r'''
import os, re, sys
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args[2]):
        m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
        print("\n".join(f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)) if m else part)
elif args[0] == "requeue":
    open(os.path.join(os.environ["FAKE_DIR"], "requeued"), "a").write(args[1] + "\n")
'''

SQUEUE = r'''
import os
d = os.path.join(os.environ["FAKE_DIR"], "steps")
for k, name in enumerate(sorted(os.listdir(d)) if os.path.isdir(d) else []):
    print(f"{os.environ['SLURM_JOB_ID']}.{k} {name}")
'''

SCANCEL = r'''
import os, signal, sys
sig = next(a.split("=")[1] for a in sys.argv[1:] if a.startswith("--signal="))
step = sys.argv[-1]
d = os.path.join(os.environ["FAKE_DIR"], "steps")
name = sorted(os.listdir(d))[int(step.split(".")[1])]
open(os.path.join(os.environ["FAKE_DIR"], "scancel.log"), "a").write(f"{sig} {step} {name}\n")
for pid in open(os.path.join(d, name)).read().split():
    os.kill(int(pid), getattr(signal, "SIG" + sig))
'''

APPTAINER = r'''
import json, os, sys
args = sys.argv[1:]
open(os.path.join(os.environ["FAKE_DIR"], "apptainer.log"), "a").write(json.dumps(args) + "\n")
i = 1
while args[i].startswith("-"):
    i += 1 if args[i] == "--nv" else 2
os.execvp(args[i + 1], args[i + 1:])  # args[i] is the image
'''


def install_fakes(bin_dir: str) -> None:
    os.makedirs(bin_dir, exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("squeue", SQUEUE), ("scancel", SCANCEL),
                       ("apptainer", APPTAINER)):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!{sys.executable}\n{body}")
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
