"""Where the job runs: this machine, or Slurm (nodes, containers)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from mrl.config.base import fail


class ClusterKind(str, enum.Enum):
    local = "local"  # this machine: torchrun ranks and local SGLang subprocesses (``mrl train``)
    slurm = "slurm"  # one Slurm job written and submitted by ``mrl launch``


class ContainerKind(str, enum.Enum):
    """How the per-node steps of a Slurm job enter the cluster image (docker/)."""

    none = "none"  # the host environment (e.g. a virtualenv on shared storage)
    pyxis = "pyxis"  # srun --container-image=... (enroot; image = .sqsh path or registry image)
    apptainer = "apptainer"  # apptainer exec image.sif ...


@dataclass(kw_only=True)
class ClusterConfig:
    """Where processes run: this machine, or one Slurm allocation split into engine and trainer nodes.

    Slurm layout (``mrl launch``, mrl/cluster/): the first ``num_rollout_nodes`` nodes run ``mrl engine``
    (``engine.count / num_rollout_nodes`` engines each), the next ``num_train_nodes`` run the
    trainer (``nproc_per_node`` ranks each). ``num_rollout_nodes=0``: no engine nodes, the trainer starts
    its engines itself on its node, as a local run does (CPU runs, colocated GPU runs).
    """

    kind: ClusterKind = ClusterKind.local
    nproc_per_node: int = 1
    """Trainer processes per trainer node (torchrun --nproc-per-node); on GPU nodes usually gpus_per_node."""
    num_train_nodes: int = 1
    num_rollout_nodes: int = 1
    """Engine nodes, first in the allocation; 0 = engines started by the trainer on its own node."""
    gpus_per_node: int = 8
    """sbatch --gpus-per-node (0 = CPU nodes: no GPU request, no apptainer --nv)."""
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "04:00:00"
    """Wall-clock limit (sbatch --time)."""
    job_name: str = "mrl"
    exclusive: bool = True
    """Whole nodes (sbatch --exclusive): no other job's processes or /dev/shm files next to ours."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra sbatch options, one per entry (``--constraint=h100``, ``--mem=0``)."""
    srun_args: list[str] = field(default_factory=list)
    """Extra options of every srun step (``--mpi=pmix``, ``--cpu-bind=none``)."""
    hetjob: bool = False
    """Heterogeneous job: engine nodes and trainer nodes as two components, for pools that need different
    partitions or node types. Both components must be free at once; one allocation schedules sooner."""
    rollout_partition: Optional[str] = None
    """hetjob only: partition of the engine component (null: ``partition``)."""
    rollout_gpus_per_node: Optional[int] = None
    """hetjob only: GPUs per engine node (null: ``gpus_per_node``)."""
    rollout_sbatch_args: list[str] = field(default_factory=list)
    """hetjob only: extra sbatch options of the engine component."""
    container: ContainerKind = ContainerKind.none
    image: Optional[str] = None
    """pyxis: squashfs path (must start with / or ./) or registry image; apptainer: .sif path."""
    container_mounts: list[str] = field(default_factory=list)
    """``src:dst[:flags]`` besides the run directory (always mounted at its own path): models, data."""
    container_workdir: str = "/opt/mrl"
    """Working directory inside the image (where docker/Dockerfile installs mrl)."""
    python: Optional[str] = None
    """Interpreter that runs ``-m mrl`` on the nodes; null: the launcher's own interpreter without a
    container (a virtualenv on shared storage), ``python`` inside one."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before the steps start (``module load cuda``, ``source env.sh``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every step (``CUDA_DEVICE_MAX_CONNECTIONS``, NCCL settings). Never secrets: those go in
    ``$RUN_DIR/secrets.env`` (mode 0600), which the batch script sources."""
    signal_seconds: int = 600
    """USR1 this many seconds before the time limit: the trainer checkpoints and the job requeues (0 = off)."""
    max_restarts: int = 10
    """Requeues after USR1 before the job ends instead."""

    def __post_init__(self) -> None:
        for name, low in (("nproc_per_node", 1), ("num_train_nodes", 1), ("num_rollout_nodes", 0),
                          ("gpus_per_node", 0), ("signal_seconds", 0), ("max_restarts", 0)):
            if getattr(self, name) < low:
                fail(f"cluster.{name}", f"must be >= {low}, got {getattr(self, name)}")
        if self.container != ContainerKind.none and not self.image:
            fail("cluster.image", f"must be set for cluster.container={self.container.value}")
        if self.hetjob and self.num_rollout_nodes < 1:
            fail("cluster.hetjob", "needs cluster.num_rollout_nodes >= 1 (the engine component)")
        for name in ("rollout_partition", "rollout_gpus_per_node", "rollout_sbatch_args"):
            if getattr(self, name) not in (None, []) and not self.hetjob:
                fail(f"cluster.{name}", "applies to heterogeneous jobs only: set cluster.hetjob=true "
                      "(one allocation has one partition and one node type)")
