"""mrl's own batch script on a real Slurm cluster (one node on localhost): the tiny CPU run, stopped by USR1
with a checkpoint, requeues and completes; a bad config fails and is reported with its Slurm log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from mrl.cluster import slurm
from mrl.sglang.keys import ENV_VAR as KEYS_ENV_VAR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")
STEPS = 12
# What a successful `mrl train` (the RL loop) leaves in its run directory.
EXPECTED_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "curves.png",
                    f"checkpoints/step_{STEPS}/loop_state.json")
# RL steps with a real CPU engine started by the trainer (num_rollout_nodes=0 in slurm_cpu)
TINY_RUN = ["cluster=slurm_cpu", "model=tiny", "parallel=tp1", "engine=cpu", "train.steps=2",
            "train.prompts_per_step=4", "train.eval_every=0"]


def mrl_launch(cluster, args: list[str], *, env: dict | None = None, timeout: float = 300):
    """``mrl launch`` as from a fresh login shell: engine keys another test's run exported (a session fixture of
    the integration tests) are not inherited, so each launch makes its run's own, inside its run directory."""
    env = {k: v for k, v in {**cluster.env, "OMP_NUM_THREADS": "1", **(env or {})}.items() if k != KEYS_ENV_VAR}
    return subprocess.run([MRL, "launch", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def test_failing_job_is_reported_with_its_slurm_log(slurm_cluster, tmp_path):
    # what the login node can see is checked before submitting (mrl.preflight): nothing written or submitted
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"model.hf_path={tmp_path}/no_model", "model.make_tiny_if_missing=false",
                                   f"run_dir={tmp_path}/run0", "--wait"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"[mrl] model.hf_path={tmp_path}/no_model: no such directory" in p.stderr
    assert not (tmp_path / "run0").exists()
    # a failure only the node meets: its cause, from the job's own log, is in what the user sees
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"run_dir={tmp_path}/run", "--wait", "--poll=1", "--timeout=120"],
                   env={"MRL_TRAIN_CMD": "echo 'node-only failure: no scratch space' >&2; exit 1"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED (exit code 1:0" in p.stderr and "Slurm log " in p.stderr
    assert "node-only failure: no scratch space" in p.stderr
    assert "trainer step exited with 1" in p.stderr


def test_config_error_is_refused_before_submitting(slurm_cluster, tmp_path):
    p = mrl_launch(slurm_cluster, [*TINY_RUN, "parallel.tp=3", f"run_dir={tmp_path}/run", "--wait"])
    assert p.returncode == 2 and "nothing submitted" in p.stderr and "parallel.tp/pp/cp" in p.stderr
    assert not (tmp_path / "run").exists()


def test_usr1_checkpoints_requeues_and_the_run_completes(slurm_cluster, tmp_path):
    """The tiny CPU run (a real SGLang engine, the real trainer) under mrl's batch script. USR1 to the batch
    shell (what --signal=B:USR1@N delivers) once step 1 is logged travels through srun and ``mrl train`` to
    the trainer rank, which finishes its step, checkpoints and exits 0; the job requeues itself, and the
    second attempt (SLURM_RESTART_COUNT=1) resumes from that checkpoint and completes with every output."""
    run = tmp_path / "run"
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"train.steps={STEPS}", f"model.hf_path={tmp_path}/model",
                                   f"run_dir={run}"])
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = p.stdout.split("submitted job ")[1].split(":")[0]
    deadline = time.monotonic() + 420
    while not _steps(run):
        assert time.monotonic() < deadline, slurm.tail(str(run / "logs" / f"slurm-{job_id}.out")) + slurm_cluster.logs()
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_cluster.env, check=True, timeout=30)
    info = slurm.wait(job_id, poll_s=1, timeout_s=480, env=slurm_cluster.env)
    log = read(run / "logs" / f"slurm-{job_id}.out")
    assert info.ok and info.restarts == 1, log
    assert f"requeueing job {job_id} (attempt 1" in log and f"job {job_id} attempt 1" in log, log
    assert log.count("trainer step exited with 0") == 2 and "not requeueing" not in log, log
    resumed = [x for x in log.splitlines() if "[mrl] resuming from " in x]
    assert len(resumed) == 1, log
    stopped = int(re.search(r"resuming from \S+/step_(\d+) ", resumed[0]).group(1))
    assert 1 <= stopped < STEPS, resumed
    # every step once: 1..k in attempt 0, k+1.. after the resume
    assert [r["step"] for r in _steps(run)] == list(range(1, STEPS + 1))
    for name in (*EXPECTED_OUTPUTS, f"checkpoints/step_{stopped}/loop_state.json"):
        assert (run / name).exists(), f"{name} missing after the job; log:\n{log}"
    assert (run / "logs" / "attempt_0").is_dir() and (run / "logs" / "attempt_1").is_dir()
    assert slurm.job_info(job_id, env=slurm_cluster.env).exit_code == "0:0"


def _steps(run) -> list[dict]:
    path = run / "metrics.jsonl"
    return [r for r in map(json.loads, open(path)) if "step_seconds" in r] if path.exists() else []


def test_every_rendered_preset_is_accepted_by_sbatch(slurm_cluster, tmp_path):
    """The #SBATCH lines of every snapshot pass `sbatch --test-only` once the site-specific ones
    (partitions, GPUs, constraints, node counts) are fitted to the one-node test cluster."""
    import re

    snapshots = os.path.join(os.path.dirname(__file__), "snapshots")
    for name in sorted(os.listdir(snapshots)):
        text = read(os.path.join(snapshots, name))
        text = re.sub(r"#SBATCH --(partition|gpus-per-node|constraint|mem|account|qos)=.*\n", "", text)
        text = re.sub(r"#SBATCH --nodes=\d+", "#SBATCH --nodes=1", text)
        text = text.replace("#SBATCH --output=/shared/", f"#SBATCH --output={tmp_path}/")
        path = tmp_path / name
        path.write_text(text)
        p = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=30,
                           env=slurm_cluster.env)
        assert p.returncode == 0 and "to start at" in p.stderr, f"{name}: {p.stderr}"
