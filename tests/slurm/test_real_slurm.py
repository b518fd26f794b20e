"""mrl's own batch script on a real Slurm cluster (one node on localhost): the tiny CPU run completes, a
bad config fails and is reported with its Slurm log, USR1 becomes a checkpoint and one requeue."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mrl.cluster import slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MRL = os.path.join(os.path.dirname(sys.executable), "mrl")
STAND_IN_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_in_trainer.sh")
# What a successful `mrl train` (the RL loop) leaves in its run directory.
EXPECTED_OUTPUTS = ("config.yaml", "metrics.jsonl", "summary.json", "curves.png", "checkpoints/step_2/loop_state.json")
# two RL steps with a real CPU engine started by the trainer (num_rollout_nodes=0 in slurm_cpu)
TINY_RUN = ["cluster=slurm_cpu", "model=tiny", "parallel=tp1", "rollout=cpu", "train.steps=2",
            "train.prompts_per_step=4", "train.eval_every=0"]


def mrl_launch(cluster, args: list[str], *, env: dict | None = None, timeout: float = 300):
    return subprocess.run([MRL, "launch", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**cluster.env, "OMP_NUM_THREADS": "1", **(env or {})})


def read(path) -> str:
    with open(path) as f:
        return f.read()


def test_tiny_cpu_run_completes(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"model.hf_path={tmp_path}/model", f"run_dir={run}", "--wait",
                                   "--poll=1", "--timeout=420"], timeout=480)
    assert p.returncode == 0, p.stdout + p.stderr + slurm_cluster.logs()
    job_id = p.stdout.split("submitted job ")[1].split(":")[0]
    assert f"job {job_id}: RUNNING" in p.stdout and f"job {job_id} completed" in p.stdout
    log = read(run / "logs" / f"slurm-{job_id}.out")
    assert f"job {job_id} attempt 0" in log and "trainer step exited with 0" in log
    for name in EXPECTED_OUTPUTS:
        assert (run / name).exists(), f"{name} missing after a completed job; log:\n{log}"
    assert slurm.job_info(job_id, env=slurm_cluster.env).exit_code == "0:0"


def test_failing_job_is_reported_with_its_slurm_log(slurm_cluster, tmp_path):
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"model.hf_path={tmp_path}/no_model", "model.make_tiny_if_missing=false",
                                   f"run_dir={tmp_path}/run", "--wait", "--poll=1", "--timeout=120"])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAILED (exit code 1:0" in p.stderr and "Slurm log " in p.stderr
    # the cause, from the job's own log, is in what the user sees
    assert f"model.hf_path={tmp_path}/no_model: no config.json there" in p.stderr
    assert "trainer step exited with 1" in p.stderr


def test_config_error_is_refused_before_submitting(slurm_cluster, tmp_path):
    p = mrl_launch(slurm_cluster, [*TINY_RUN, "parallel.tp=3", f"run_dir={tmp_path}/run", "--wait"])
    assert p.returncode == 2 and "nothing submitted" in p.stderr and "parallel.tp/pp/cp" in p.stderr
    assert not (tmp_path / "run").exists()


def test_usr1_checkpoints_and_requeues_once(slurm_cluster, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@N delivers) reaches the trainer step, which checkpoints
    and exits 0; the job requeues itself; the second attempt sees SLURM_RESTART_COUNT=1 and resumes."""
    run = tmp_path / "run"
    p = mrl_launch(slurm_cluster, [*TINY_RUN, f"run_dir={run}"], env={"MRL_TRAIN_CMD": f"bash {STAND_IN_TRAINER}"})
    assert p.returncode == 0, p.stdout + p.stderr
    job_id = p.stdout.split("submitted job ")[1].split(":")[0]
    deadline = time.monotonic() + 60
    while not (run / "trainer_ready_0").exists():
        assert time.monotonic() < deadline, slurm.tail(str(run / "logs" / f"slurm-{job_id}.out"))
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_cluster.env, check=True, timeout=30)
    info = slurm.wait(job_id, poll_s=1, timeout_s=120, env=slurm_cluster.env)
    log = read(run / "logs" / f"slurm-{job_id}.out")
    assert info.ok and info.restarts == 1, log
    assert "stand-in trainer: got USR1, writing checkpoint step_3" in log
    assert f"requeueing job {job_id} (attempt 1" in log
    assert f"job {job_id} attempt 1" in log and "stand-in trainer: attempt 1" in log
    assert "resumed from checkpoint step_3" in log and read(run / "resumed_attempt").strip() == "1"
    assert (run / "logs" / "attempt_0").is_dir() and (run / "logs" / "attempt_1").is_dir()
    assert log.count("trainer step exited with 0") == 2 and "not requeueing" not in log


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
