"""Rendered batch scripts: snapshots per preset, layout checks that name the fields, the run directory the
nodes load (job.yaml + config.yaml), and no secret ever rendered.

Regenerate the snapshots after an intended change: MRL_UPDATE_SNAPSHOTS=1 pytest tests/slurm/test_render.py
"""

from __future__ import annotations

import os
import subprocess

import pytest

from mrl.cluster import launch, render
from mrl.config.load import load_resolved
from tests.slurm.presets import PRESETS, overrides

SNAPSHOTS = os.path.join(os.path.dirname(__file__), "snapshots")


def rendered(name: str) -> str:
    return render.render_sbatch(launch.compose(overrides(name)), overrides=overrides(name))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rendered_sbatch_matches_snapshot(name):
    text = rendered(name)
    path = os.path.join(SNAPSHOTS, f"{name}.sbatch")
    if os.environ.get("MRL_UPDATE_SNAPSHOTS") == "1":
        os.makedirs(SNAPSHOTS, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    assert os.path.exists(path), f"no snapshot {path}: run with MRL_UPDATE_SNAPSHOTS=1 once and review it"
    with open(path) as f:
        assert text == f.read(), f"{name}: rendering changed; review and regenerate with MRL_UPDATE_SNAPSHOTS=1"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # syntax


def test_rendering_is_deterministic_and_has_no_clock_or_port():
    a, b = rendered("slurm"), rendered("slurm")
    assert a == b
    assert "MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 10000 ))" in a  # derived at run time, per job


def header(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_multi_node_split_2_plus_2():
    text = rendered("slurm_2x2")
    h = header(text)
    assert "#SBATCH --nodes=4" in h and "#SBATCH --gpus-per-node=8" in h and "#SBATCH --ntasks-per-node=1" in h
    assert not any("gpus-per-task" in line for line in h)  # hides peer GPUs with >1 task per node
    assert {"#SBATCH --account=rl", "#SBATCH --qos=high", "#SBATCH --constraint=h100", "#SBATCH --mem=0",
            "#SBATCH --time=24:00:00", "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue"} <= set(h)
    assert "export NUM_ROLLOUT_NODES=2\nexport ENGINES_PER_NODE=1\nexport NPROC_PER_NODE=8" in text
    assert "SRUN_ARGS=--cpu-bind=none" in text and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert "\nmodule load cuda/12.9\n" in text


def test_hetjob_components_engines_first():
    h = header(rendered("slurm_hetjob"))
    split = h.index("#SBATCH hetjob")
    engine, trainer = h[:split], h[split + 1:]
    assert "#SBATCH --partition=infer" in engine and "#SBATCH --nodes=1" in engine
    assert "#SBATCH --partition=train" in trainer and "#SBATCH --nodes=2" in trainer
    assert "#SBATCH --job-name=mrl" in engine  # job-wide options go with the first component


def test_container_flags():
    pyxis = rendered("slurm_pyxis")
    assert "export CONTAINER=pyxis\nexport IMAGE=/shared/containers/mrl-0.1.0.sqsh" in pyxis
    assert "export MOUNTS=/shared/runs/slurm_pyxis:/shared/runs/slurm_pyxis,/shared/models:/shared/models:ro" in pyxis
    assert "export MRL_PYTHON=python" in pyxis  # the image's interpreter
    assert "--no-container-mount-home" in pyxis
    app = rendered("slurm_apptainer")
    assert "export CONTAINER=apptainer\nexport IMAGE=/shared/containers/mrl-0.1.0.sif" in app
    assert "WRAP=(apptainer exec" in app and "WRAP+=(--nv)" in app


def test_no_usr1_without_signal_seconds():
    cfg = launch.compose([*overrides("slurm_cpu"), "cluster.signal_seconds=0"])
    h = header(render.render_sbatch(cfg))
    assert "#SBATCH --no-requeue" in h and not any("--signal" in line for line in h)


@pytest.mark.parametrize("extra,match", [
    (["engine.count=3", "cluster.num_rollout_nodes=2"], r"engine\.count=3 must be a multiple of "
                                                        r"cluster\.num_rollout_nodes=2"),
    (["cluster.nproc_per_node=6"], r"parallel\.tp/pp/cp.*cluster\.num_train_nodes \* cluster\.nproc_per_node"),
    (["engine.count=2"], r"2 engines per node x engine\.tp=8 GPUs do not fit 8"),
    (["cluster.kind=local"], r"cluster\.kind=local: mrl launch submits Slurm jobs"),
    (["cluster.nproc_per_node=16", "cluster.gpus_per_node=8"], r"cluster\.nproc_per_node=16 exceeds"),
    (["engine.urls=[http://h:1]"], r"engine\.urls"),
])
def test_layout_errors_name_the_fields(extra, match):
    cfg = launch.compose([*overrides("slurm"), *extra])
    with pytest.raises(ValueError, match=match):
        render.layout(cfg)


def test_scoring_pool_nodes_between_engine_and_trainer_nodes():
    text = rendered("slurm_scoring")
    assert "#SBATCH --nodes=3" in header(text)  # 1 engine node + 1 teacher node + 1 trainer node
    assert "export ENGINES_PER_NODE=1\nexport SCORING_POOLS=teacher:1:2\n" in text
    assert "# layout: 1 engine node(s) x 1 engine(s) + 1 teacher node(s) x 2 engine(s) + 1 trainer node(s)" in text
    assert "export SCORING_POOLS=" not in rendered("slurm_2x2").split("# ---- body")[0]


TEACHER = ["scoring=opd", "scoring.teacher.hf_path=/t", "scoring.teacher.engine.cpu_mode=false"]


@pytest.mark.parametrize("extra,match", [
    (["scoring.teacher.nodes=1", "scoring.teacher.engine.tp=16"],
     r"1 teacher engines per node x scoring\.teacher\.engine\.tp=16 GPUs do not fit cluster\.gpus_per_node=8"),
    (["cluster=slurm_hetjob", "scoring.teacher.nodes=1"], r"scoring\.teacher\.nodes=1 with cluster\.hetjob=true"),
])
def test_scoring_layout_errors_name_the_keys(extra, match):
    cfg = launch.compose([*overrides("slurm"), *TEACHER, *extra])
    with pytest.raises(ValueError, match=match):
        render.layout(cfg)


@pytest.mark.parametrize("extra,match", [
    (["scoring.judge.nodes=1"], r"scoring\.judge\.nodes: =1 but scoring\.judge is off"),
    ([*TEACHER, "scoring.teacher.nodes=2"], r"scoring\.teacher\.nodes: =2 is more nodes than "
                                            r"scoring\.teacher\.engine\.count=1"),
    ([*TEACHER, "scoring.teacher.nodes=2", "scoring.teacher.engine.count=3"], r"=2 does not divide"),
    ([*TEACHER, "scoring.teacher.nodes=1", "scoring.teacher.engine.urls=[http://h:1]"],
     r"scoring\.teacher\.nodes: =1 with scoring\.teacher\.engine\.urls"),
    ([*TEACHER, "scoring.teacher.nodes=1", "cluster.kind=local"], r"scoring\.teacher\.nodes: =1 places the pool's "
                                                                  r"engines on Slurm nodes"),
    ([*TEACHER, "scoring.teacher.engine.url_dir=/x"], r"scoring\.teacher\.engine\.url_dir"),
    (["cluster.container=pyxis"], r"cluster\.image: must be set for cluster\.container=pyxis"),
    (["cluster.hetjob=true", "cluster.num_rollout_nodes=0"], r"cluster\.hetjob: needs cluster\.num_rollout_nodes"),
    (["cluster.rollout_partition=infer"], r"cluster\.rollout_partition: applies to heterogeneous jobs only"),
    (["cluster.num_train_nodes=0"], r"cluster\.num_train_nodes: must be >= 1"),
])
def test_cluster_config_errors_name_the_fields(extra, match):
    with pytest.raises(ValueError, match=match):
        launch.compose([*overrides("slurm"), *extra])


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = launch.compose(["cluster=slurm_cpu", "run_dir=runs/r1", "model.hf_path=models/tiny"])
    assert cfg.run_dir == str(tmp_path / "runs/r1") and cfg.model.hf_path == str(tmp_path / "models/tiny")


def test_run_dir_loads_the_composed_config_on_the_nodes(tmp_path):
    """What mrl_node.sh runs: `mrl <cmd> --config-path RUN_DIR --config-name job <role overrides>`."""
    from hydra import compose, initialize_config_dir

    from mrl.config.load import to_config
    from mrl.config.store import register

    ov = ["cluster=slurm_cpu", f"run_dir={tmp_path}", "rollout.max_new_tokens=7", "seed=5"]
    cfg = launch.compose(ov)
    script = launch.write_run_dir(cfg, render.render_sbatch(cfg, overrides=ov))
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "job.yaml", "logs", "mrl.sbatch", "mrl_node.sh"]
    assert os.access(tmp_path / "mrl_node.sh", os.X_OK) and script == str(tmp_path / "mrl.sbatch")
    assert load_resolved(str(tmp_path / "config.yaml")) == cfg
    register()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        node = to_config(compose(config_name="job", overrides=[f"engine.url_dir={tmp_path}/engines",
                                                                "engine.count=2"]))
    assert node.rollout.max_new_tokens == 7 and node.seed == 5 and node.run_dir == str(tmp_path)
    assert node.engine.url_dir == f"{tmp_path}/engines" and node.engine.count == 2


def test_secrets_are_never_rendered(monkeypatch, tmp_path):
    """mrl launch makes the run's engine keys (0600 file); neither key reaches the script or config dumps."""
    from mrl.sglang.keys import EngineSecrets

    monkeypatch.setenv("MRL_ENGINE_KEYS_FILE", "")  # restored after the test, whatever launch exports
    monkeypatch.delenv("MRL_ENGINE_KEYS_FILE")
    run = tmp_path / "run"
    assert launch.main([*PRESETS["slurm_2x2"], f"run_dir={run}", "--dry-run"]) == 0
    keys = EngineSecrets.from_env()
    assert keys is not None and str(run) in os.environ["MRL_ENGINE_KEYS_FILE"]
    for name in ("mrl.sbatch", "config.yaml", "job.yaml"):
        text = (run / name).read_text()
        assert keys.api_key not in text and keys.admin_api_key not in text, name
    text = rendered("slurm_2x2")
    assert 'MRL_SECRETS_FILE=${MRL_SECRETS_FILE:-$RUN_DIR/secrets.env}' in text  # the hook: a private file


def test_dry_run_writes_run_dir_and_prints_script(tmp_path, capsys):
    rc = launch.main([*PRESETS["slurm_cpu"], f"run_dir={tmp_path}", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.startswith("#!/bin/bash") and "submit with: sbatch" in out.err
    with open(tmp_path / "mrl.sbatch") as f:
        assert f.read() == out.out


def test_bad_override_is_refused_before_anything_is_written(tmp_path, capsys):
    rc = launch.main(["cluster=slurm_cpu", f"run_dir={tmp_path}/r", "parallel.tp=3"])
    assert rc == 2 and "nothing submitted" in capsys.readouterr().err and not os.path.exists(tmp_path / "r")
