"""`cluster=slurm_pyxis` and `cluster=slurm_apptainer` with the built CPU image on the localhost Slurm: mrl
launch renders and submits the batch script, its srun step runs `mrl train` inside the image, and the run
directory (mounted at its own path) gets every output.

Neither pyxis/enroot nor Apptainer is packaged for Debian, so each is replaced by a stand-in that runs the
same container with podman (tests/slurm/container_shims): an ``srun`` in front of the real one that takes
pyxis's --container-* options, and an ``apptainer`` that takes ``exec --bind --pwd IMAGE``. Everything else is
real: Slurm, the rendered script, the image, the engine and trainer inside it.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.slurm.test_real_slurm import mrl_launch, read

pytestmark = pytest.mark.container
SHIMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "container_shims")
STEPS = 2
# slurm_pyxis / slurm_apptainer default to GPU nodes with engine nodes; the one-node CPU cluster runs one
# trainer rank that starts its CPU engine itself
CPU_NODE = ["cluster.num_rollout_nodes=0", "cluster.gpus_per_node=0", "cluster.nproc_per_node=1",
            "cluster.exclusive=false", "cluster.time=00:30:00", "model=tiny", "parallel=tp1", "engine=cpu",
            f"train.steps={STEPS}", "train.prompts_per_step=4", "train.eval_every=0"]


@pytest.mark.parametrize("preset", ["slurm_pyxis", "slurm_apptainer"])
def test_container_preset_trains_in_the_image(preset, image, slurm_cluster, tmp_path):
    run, models = tmp_path / "run", tmp_path / "models"
    models.mkdir()
    p = mrl_launch(slurm_cluster, [f"cluster={preset}", f"cluster.image={image}", *CPU_NODE,
                                   f"cluster.container_mounts=[{models}:{models}]", f"model.hf_path={models}/tiny",
                                   f"run_dir={run}", "--wait", "--poll=1", "--timeout=900"],
                   env={"PATH": f"{SHIMS}:{os.environ['PATH']}"}, timeout=960)
    logs = sorted((run / "logs").glob("slurm-*.out"))
    log = read(logs[0]) if logs else "(no Slurm log)"
    assert p.returncode == 0, p.stdout + p.stderr + log
    script = read(run / "mrl.sbatch")
    assert f"export CONTAINER={preset.split('_')[1]}" in script and f"export IMAGE={image}" in script
    assert "trainer step exited with 0" in log, log
    # the step went through the container stand-in: pyxis's srun options, or apptainer exec
    assert f"[run_in_podman] {image}: bash {run}/mrl_node.sh train" in log, log
    # written inside the container: the interpreter is the image's, the files land on the host's run directory
    config = read(run / "config.yaml")
    assert "python: python" in config
    for name in ("metrics.jsonl", "summary.json", f"checkpoints/step_{STEPS}/loop_state.json"):
        assert (run / name).exists(), f"{name} missing; log:\n{log}"
    steps = [r["step"] for r in map(json.loads, open(run / "metrics.jsonl")) if "step_seconds" in r]
    assert steps == list(range(1, STEPS + 1))
    assert (models / "tiny" / "config.json").exists()  # made inside, on the mounted model folder
