"""Rendered multi-node scripts executed against fake srun/scontrol/squeue/scancel/apptainer (fake_slurm.py):
engine nodes first, trainer ranks and rendezvous, engines announced before the trainer starts and
stopped with TERM after it, container wrapping, engine failure and secrets handling."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mrl.cluster import launch, render
from tests.slurm.fake_slurm import install_fakes
from tests.slurm.presets import GPU_RUN

HERE = os.path.dirname(os.path.abspath(__file__))
# rank 0 waits for every engine announcement (as the trainer attaching through engine.url_dir does)
TRAINER = r'''
echo "trainer host=$FAKE_HOST rank=$PET_NODE_RANK/$PET_NNODES nproc=$PET_NPROC_PER_NODE" \
  "master=$PET_MASTER_ADDR:$PET_MASTER_PORT"
if [[ $PET_NODE_RANK == 0 ]]; then
  want=$(( NUM_ROLLOUT_NODES * ENGINES_PER_NODE ))
  for _ in $(seq 100); do (( $(ls "$RUN_DIR"/engines/*.url 2>/dev/null | wc -l) >= want )) && break; sleep 0.1; done
  cat "$RUN_DIR"/engines/*.url > "$RUN_DIR/seen_urls"
  echo "api key: ${MRL_ENGINE_API_KEY:-none}"
fi
'''


def run_job(tmp_path, overrides: list[str], *, slurm_env: dict, env: dict | None = None):
    run = tmp_path / "run"
    cfg = launch.compose([*overrides, f"run_dir={run}", "cluster.python=python"])
    script = launch.write_run_dir(cfg, render.render_sbatch(cfg))
    fake = tmp_path / "fake"
    install_fakes(str(fake / "bin"))
    full_env = {**os.environ, "PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE_DIR": str(fake),
                "SLURM_JOB_ID": "4242", "MRL_ENGINE_CMD": f"bash {HERE}/stand_in_engine.sh",
                "MRL_TRAIN_CMD": TRAINER, **slurm_env, **(env or {})}
    p = subprocess.run(["bash", script], capture_output=True, text=True, timeout=90, env=full_env, cwd=tmp_path)
    sruns = [json.loads(line) for line in open(fake / "srun.log")] if (fake / "srun.log").exists() else []
    return p, run, fake, {s["name"]: s for s in sruns}


def test_two_engine_nodes_two_trainer_nodes(tmp_path):
    p, run, fake, steps = run_job(tmp_path, ["cluster=slurm", *GPU_RUN, "cluster.num_rollout_nodes=2",
                                             "cluster.num_train_nodes=2", "engine.count=2"],
                                  slurm_env={"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert steps["mrl-engine"]["hosts"] == ["n1", "n2"] and steps["mrl-train"]["hosts"] == ["n3", "n4"]
    assert "trainer host=n3 rank=0/2 nproc=8 master=n3:24242" in out  # 20000 + 4242 % 10000
    assert "trainer host=n4 rank=1/2 nproc=8 master=n3:24242" in out
    assert (run / "seen_urls").read_text() == "http://n1:30000\nhttp://n2:30000\n"
    # engines stopped by TERM to their step (not to srun), announcements withdrawn
    assert (fake / "scancel.log").read_text() == "TERM 4242.0 mrl-engine\n"
    assert not list((run / "engines").glob("*.url"))
    engine_log = (run / "logs" / "attempt_0" / "engine_n1.log").read_text()
    assert "announced n1-engine0" in engine_log and "TERM, withdrawn" in engine_log


def test_a_scoring_pool_on_a_node_of_its_own(tmp_path):
    """scoring.teacher.nodes=1: the teacher's step on the node after the engine node, its servers announced in
    engines/teacher, where the trainer finds them; stopped with TERM after the trainer, as the engine step."""
    wait_teacher = ('for _ in $(seq 100); do ls "$RUN_DIR"/engines/teacher/*.url >/dev/null 2>&1 && break; '
                    'sleep 0.1; done; cat "$RUN_DIR"/engines/teacher/*.url > "$RUN_DIR/seen_teacher"')
    p, run, fake, steps = run_job(tmp_path, ["cluster=slurm", *GPU_RUN, "scoring=opd", "scoring.teacher.hf_path=/t",
                                             "scoring.teacher.nodes=1", "scoring.teacher.engine.count=2",
                                             "scoring.teacher.engine.cpu_mode=false"],
                                  slurm_env={"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3"},
                                  env={"MRL_SCORING_CMD": f"bash {HERE}/stand_in_engine.sh",
                                       "MRL_TRAIN_CMD": TRAINER + wait_teacher})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert steps["mrl-engine"]["hosts"] == ["n1"] and steps["mrl-score-teacher"]["hosts"] == ["n2"]
    assert steps["mrl-train"]["hosts"] == ["n3"] and "scoring pool teacher nodes: n2" in out
    assert "bash" in steps["mrl-score-teacher"]["argv"] and steps["mrl-score-teacher"]["argv"][-2:] == [
        "scoring", "teacher"]
    assert (run / "seen_urls").read_text() == "http://n1:30000\n"
    assert (run / "seen_teacher").read_text() == "http://n2:31000\nhttp://n2:31001\n"
    assert sorted((fake / "scancel.log").read_text().splitlines()) == ["TERM 4242.0 mrl-engine",
                                                                       "TERM 4242.1 mrl-score-teacher"]
    assert not list((run / "engines").glob("**/*.url"))
    assert "announced n2-teacher0 n2-teacher1" in (run / "logs" / "attempt_0" / "teacher_n2.log").read_text()


def test_node_commands_attach_to_the_scoring_pools(tmp_path):
    """mrl_node.sh: the scoring node runs `mrl engine --pool`, and every role attaches the pool's url_dir."""
    env = {**os.environ, "RUN_DIR": str(tmp_path), "MRL_PYTHON": "echo", "SCORING_POOLS": "teacher:1:2 judge:2:1",
           "NUM_ROLLOUT_NODES": "1"}
    node = os.path.join(os.path.dirname(HERE), "..", "scripts", "mrl_node.sh")
    attach = (f"engine.url_dir={tmp_path}/engines scoring.teacher.engine.url_dir={tmp_path}/engines/teacher "
              f"scoring.judge.engine.url_dir={tmp_path}/engines/judge")
    job = f"--config-path {tmp_path} --config-name job"
    for role, want in ((["scoring", "teacher"], f"-m mrl engine --pool teacher {job} {attach}"),
                       (["train"], f"-m mrl train {job} {attach}")):
        p = subprocess.run(["bash", node, *role], capture_output=True, text=True, env=env, timeout=30)
        assert p.returncode == 0 and p.stdout.splitlines()[-1] == want, p.stdout + p.stderr


def test_hetjob_places_steps_by_component(tmp_path):
    p, run, _, steps = run_job(tmp_path, ["cluster=slurm_hetjob", *GPU_RUN, "cluster.num_train_nodes=2"],
                               slurm_env={"SLURM_JOB_NODELIST": "e1,t1,t2", "SLURM_JOB_NUM_NODES": "3",
                                          "SLURM_JOB_NODELIST_HET_GROUP_0": "e1",
                                          "SLURM_JOB_NODELIST_HET_GROUP_1": "t[1-2]"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--het-group=0" in steps["mrl-engine"]["argv"] and "--het-group=1" in steps["mrl-train"]["argv"]
    assert "trainer host=t1 rank=0/2 nproc=8 master=t1:24242" in p.stdout
    assert (run / "seen_urls").read_text() == "http://e1:30000\n"


def test_engine_failure_fails_the_job(tmp_path):
    p, _, _, _ = run_job(tmp_path, ["cluster=slurm", *GPU_RUN],
                         slurm_env={"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"},
                         env={"MRL_ENGINE_CMD": "exit 1", "MRL_TRAIN_CMD": "sleep 60"})
    assert p.returncode == 1 and "the engine step ended before the trainer" in p.stderr


@pytest.mark.parametrize("kind", ["pyxis", "apptainer"])
def test_container_steps(tmp_path, kind):
    image = f"/shared/containers/mrl.{'sqsh' if kind == 'pyxis' else 'sif'}"
    p, run, fake, steps = run_job(tmp_path, [f"cluster=slurm_{kind}", *GPU_RUN, f"cluster.image={image}",
                                             "cluster.container_mounts=[/data:/data]"],
                                  slurm_env={"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"})
    assert p.returncode == 0, p.stdout + p.stderr
    mounts = f"{run}:{run},/data:/data"
    for step in steps.values():
        argv = step["argv"]
        if kind == "pyxis":
            assert {f"--container-image={image}", f"--container-mounts={mounts}", "--container-workdir=/opt/mrl",
                    "--no-container-mount-home"} <= set(argv)
        else:
            assert argv[argv.index("apptainer"):][:8] == ["apptainer", "exec", "--bind", mounts, "--pwd", "/opt/mrl",
                                                          "--nv", image]
    if kind == "apptainer":
        assert len((fake / "apptainer.log").read_text().splitlines()) == 2  # engine node + trainer node


def test_secrets_file_must_be_private(tmp_path):
    (tmp_path / "run").mkdir()
    secrets = tmp_path / "run" / "secrets.env"
    secrets.write_text("MRL_ENGINE_API_KEY=sk-test\n")
    nodes = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    secrets.chmod(0o644)
    p, _, _, _ = run_job(tmp_path, ["cluster=slurm", *GPU_RUN], slurm_env=nodes)
    assert p.returncode == 1 and "secrets.env must be mode 600 or 400" in p.stderr
    secrets.chmod(0o600)
    p, _, _, _ = run_job(tmp_path, ["cluster=slurm", *GPU_RUN], slurm_env=nodes)
    assert p.returncode == 0 and "api key: sk-test" in p.stdout
