"""The cluster presets whose rendered batch scripts are snapshot-tested (tests/slurm/snapshots/<name>.sbatch).

Paths are fixed (/shared/...) so the rendering is the same on every machine.
"""

GPU_RUN = ["model=qwen3_30b_a3b", "model.hf_path=/shared/models/Qwen3-30B-A3B", "parallel=tp4_ep8", "engine=gpu_tp8"]
IMAGE = "/shared/containers/mrl-0.1.0"

PRESETS: dict[str, list[str]] = {
    # the CPU test cluster: one node, engines started by the trainer
    "slurm_cpu": ["cluster=slurm_cpu", "model=tiny", "model.hf_path=/shared/models/tiny", "parallel=tp1",
                  "engine=cpu", "cluster.python=/shared/venvs/mrl/bin/python"],
    # GPU: 1 engine node + 1 trainer node
    "slurm": ["cluster=slurm", *GPU_RUN, "cluster.python=/shared/venvs/mrl/bin/python", "cluster.partition=batch"],
    # 4 nodes: 2 engine nodes (1 TP8 engine each) + 2 trainer nodes (16 ranks), with the extras rendered
    "slurm_2x2": ["cluster=slurm", *GPU_RUN, "cluster.num_rollout_nodes=2", "cluster.num_train_nodes=2",
                  "engine.count=2", "cluster.python=/shared/venvs/mrl/bin/python", "cluster.partition=batch",
                  "cluster.account=rl", "cluster.qos=high", "cluster.time=24:00:00",
                  "cluster.sbatch_args=['--constraint=h100','--mem=0']", "cluster.srun_args=['--cpu-bind=none']",
                  "+cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=1", "+cluster.env.NCCL_DEBUG=WARN",
                  "cluster.setup=['module load cuda/12.9']"],
    "slurm_pyxis": ["cluster=slurm_pyxis", *GPU_RUN, f"cluster.image={IMAGE}.sqsh", "cluster.partition=batch",
                    "cluster.container_mounts=[/shared/models:/shared/models:ro]"],
    "slurm_apptainer": ["cluster=slurm_apptainer", *GPU_RUN, f"cluster.image={IMAGE}.sif", "cluster.partition=batch",
                        "cluster.container_mounts=[/shared/models:/shared/models]"],
    # a teacher pool on a node of its own (2 TP4 engines) between the engine node and the trainer node
    "slurm_scoring": ["cluster=slurm", *GPU_RUN, "cluster.python=/shared/venvs/mrl/bin/python", "scoring=opd",
                      "scoring.teacher.hf_path=/shared/models/Qwen3-30B-A3B-teacher", "scoring.teacher.nodes=1",
                      "scoring.teacher.engine.count=2", "scoring.teacher.engine.tp=4",
                      "scoring.teacher.engine.cpu_mode=false"],
    # engines on an inference partition, trainer on the training partition
    "slurm_hetjob": ["cluster=slurm_hetjob", *GPU_RUN, "cluster.partition=train", "cluster.rollout_partition=infer",
                     "cluster.num_train_nodes=2", "cluster.python=/shared/venvs/mrl/bin/python"],
}


def overrides(name: str) -> list[str]:
    return [*PRESETS[name], f"run_dir=/shared/runs/{name}"]
