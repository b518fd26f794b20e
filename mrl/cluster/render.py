"""Render a run's Slurm batch script: #SBATCH lines and variables from the config, then the body of
scripts/mrl.sbatch verbatim.

Pure and deterministic (no clock, no ports: MASTER_PORT is derived from SLURM_JOB_ID at run time), so the
rendered script of every preset is snapshot-tested (tests/slurm/snapshots/).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from mrl.config.schema import ClusterConfig, ClusterKind, Config, ContainerKind

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEMPLATE = os.path.join(REPO, "scripts", "mrl.sbatch")
NODE_ENTRY = os.path.join(REPO, "scripts", "mrl_node.sh")
BODY_MARKER = "# ---- mrl body"
SCRIPT_NAME = "mrl.sbatch"
NODE_ENTRY_NAME = "mrl_node.sh"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Node split of one Slurm run: rollout engine nodes first, then each scoring pool's nodes, then trainer
    nodes."""

    num_rollout_nodes: int
    num_train_nodes: int
    engines_per_node: int
    """0 when there are no engine nodes (the trainer starts engine.count itself)."""
    nproc_per_node: int
    scoring: tuple[tuple[str, int, int], ...] = ()
    """``(pool, nodes, engines per node)`` of the scoring pools on nodes of their own (``scoring.<pool>.nodes``)."""

    @property
    def num_scoring_nodes(self) -> int:
        return sum(n for _, n, _ in self.scoring)

    @property
    def num_nodes(self) -> int:
        return self.num_rollout_nodes + self.num_scoring_nodes + self.num_train_nodes


def layout(cfg: Config) -> Layout:
    """The node split of ``cfg``; a ValueError naming the fields when the config does not fit it."""
    c, eng = cfg.cluster, cfg.engine
    if c.kind != ClusterKind.slurm:
        raise ValueError(f"cluster.kind={c.kind.value}: mrl launch submits Slurm jobs (choose cluster=slurm or "
                         "a slurm_* preset); on this machine run `mrl train` directly")
    world = c.num_train_nodes * c.nproc_per_node
    try:
        cfg.parallel.check_world_size(world)
    except ValueError as e:
        raise ValueError(f"{e} (trainer world size = cluster.num_train_nodes * cluster.nproc_per_node = "
                         f"{c.num_train_nodes}*{c.nproc_per_node})") from None
    if c.gpus_per_node and c.nproc_per_node > c.gpus_per_node:
        raise ValueError(f"cluster.nproc_per_node={c.nproc_per_node} exceeds cluster.gpus_per_node={c.gpus_per_node}")
    engines_per_node = 0
    if c.num_rollout_nodes:
        if eng.count % c.num_rollout_nodes:
            raise ValueError(f"engine.count={eng.count} must be a multiple of cluster.num_rollout_nodes="
                             f"{c.num_rollout_nodes} (every engine node runs the same number of engines)")
        if eng.urls:
            raise ValueError("engine.urls: engine nodes announce their own URLs; leave it empty or set "
                             "cluster.num_rollout_nodes=0")
        engines_per_node = eng.count // c.num_rollout_nodes
        gpus = c.rollout_gpus_per_node if c.rollout_gpus_per_node is not None else c.gpus_per_node
        if not eng.cpu_mode and engines_per_node * eng.tp > gpus:
            raise ValueError(f"{engines_per_node} engines per node x engine.tp={eng.tp} GPUs do not fit "
                             f"{gpus} GPUs per engine node (cluster.gpus_per_node / rollout_gpus_per_node)")
    return Layout(num_rollout_nodes=c.num_rollout_nodes, num_train_nodes=c.num_train_nodes,
                  engines_per_node=engines_per_node, nproc_per_node=c.nproc_per_node, scoring=_scoring_nodes(cfg))


def _scoring_nodes(cfg: Config) -> tuple[tuple[str, int, int], ...]:
    """The scoring pools on nodes of their own; a ValueError naming the key where one cannot be placed (the
    pool's own keys, ``nodes`` against ``engine.count``, are checked by its config)."""
    c, out = cfg.cluster, []
    for name, p in cfg.scoring.pools.items():
        if not p.nodes:
            continue
        if c.hetjob:
            raise ValueError(f"{p.NODE}.nodes={p.nodes} with cluster.hetjob=true: scoring nodes are placed in one "
                             "allocation only; set cluster.hetjob=false or nodes=0")
        per = p.engine.count // p.nodes
        if not p.engine.cpu_mode and per * p.engine.tp > c.gpus_per_node:
            raise ValueError(f"{per} {name} engines per node x {p.NODE}.engine.tp={p.engine.tp} GPUs do not fit "
                             f"cluster.gpus_per_node={c.gpus_per_node} ({p.NODE}.nodes={p.nodes})")
        out.append((name, p.nodes, per))
    return tuple(out)


def _component(c: ClusterConfig, *, nodes: int, partition: str | None, gpus: int, extra: list[str]) -> list[str]:
    """#SBATCH lines of one allocation (or one component of a heterogeneous job)."""
    opts = [f"--partition={partition}"] if partition else []
    opts += [f"--nodes={nodes}", "--ntasks-per-node=1"]
    # --gpus-per-node, never --gpus-per-task: with several tasks per node it hides peer GPUs (CUDA IPC/P2P).
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += ["--exclusive"] if c.exclusive else []
    opts += [f"--time={c.time}", *extra]
    return [f"#SBATCH {o}" for o in opts]


def sbatch_header(cfg: Config, lay: Layout) -> list[str]:
    c = cfg.cluster
    job = [f"--job-name={c.job_name}", f"--output={cfg.run_dir}/logs/slurm-%j.out", "--open-mode=append"]
    job += [f"--account={c.account}"] if c.account else []
    job += [f"--qos={c.qos}"] if c.qos else []
    if c.signal_seconds:
        job += [f"--signal=B:USR1@{c.signal_seconds}", "--requeue"]
    else:
        job += ["--no-requeue"]
    lines = [f"#SBATCH {o}" for o in job]
    if c.hetjob:  # component 0 = engine nodes, component 1 = trainer nodes (the body relies on this order)
        gpus = c.rollout_gpus_per_node if c.rollout_gpus_per_node is not None else c.gpus_per_node
        lines += _component(c, nodes=lay.num_rollout_nodes, partition=c.rollout_partition or c.partition,
                            gpus=gpus, extra=[*c.sbatch_args, *c.rollout_sbatch_args])
        lines += ["#SBATCH hetjob"]
        lines += _component(c, nodes=lay.num_train_nodes, partition=c.partition, gpus=c.gpus_per_node,
                            extra=c.sbatch_args)
    else:
        lines += _component(c, nodes=lay.num_nodes, partition=c.partition, gpus=c.gpus_per_node, extra=c.sbatch_args)
    return lines


def _shell_word(arg: str) -> str:
    """Quote for copy-paste into a shell, preferring double quotes around Hydra's single-quoted lists."""
    if shlex.quote(arg) == arg or any(ch in arg for ch in '"$`\\!'):
        return shlex.quote(arg)
    return f'"{arg}"'


def _export(name: str, value: object) -> str:
    return f"export {name}={shlex.quote(str(value))}"


def variables(cfg: Config, lay: Layout) -> list[str]:
    """The body's variables (scripts/mrl.sbatch documents each), then cluster.env and cluster.setup."""
    c = cfg.cluster
    out = [_export("RUN_DIR", cfg.run_dir),
           _export("NUM_ROLLOUT_NODES", lay.num_rollout_nodes),
           _export("ENGINES_PER_NODE", lay.engines_per_node),
           *([_export("SCORING_POOLS", " ".join(f"{n}:{k}:{e}" for n, k, e in lay.scoring))] if lay.scoring else []),
           _export("NPROC_PER_NODE", lay.nproc_per_node),
           _export("GPUS_PER_NODE", c.gpus_per_node),
           _export("MRL_PYTHON", c.python or "python"),
           _export("MRL_NODE_SH", os.path.join(cfg.run_dir, NODE_ENTRY_NAME)),
           _export("MAX_RESTARTS", c.max_restarts),
           _export("CONTAINER", c.container.value)]
    if c.container != ContainerKind.none:
        mounts = [f"{cfg.run_dir}:{cfg.run_dir}", *c.container_mounts]
        out += [_export("IMAGE", c.image), _export("MOUNTS", ",".join(mounts)), _export("WORKDIR", c.container_workdir)]
    if c.srun_args:
        out.append(f"SRUN_ARGS={shlex.quote(' '.join(c.srun_args))}")
    if c.env:
        out += ["# cluster.env"] + [_export(k, v) for k, v in c.env.items()]
    if c.setup:
        out += ["# cluster.setup"] + list(c.setup)
    return out


def template_body() -> str:
    with open(TEMPLATE) as f:
        text = f.read()
    at = text.index(BODY_MARKER)
    return text[text.index("\n", at) + 1:]


def render_sbatch(cfg: Config, *, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The batch script of ``cfg`` (``cfg.run_dir`` absolute, as ``mrl launch`` writes it)."""
    assert os.path.isabs(cfg.run_dir), f"run_dir must be absolute here, got {cfg.run_dir}"
    lay = layout(cfg)
    split = (f"{lay.num_rollout_nodes} engine node(s) x {lay.engines_per_node} engine(s)"
             if lay.num_rollout_nodes else "no engine nodes (the trainer starts its engines)")
    split += "".join(f" + {k} {n} node(s) x {e} engine(s)" for n, k, e in lay.scoring)
    lines = ["#!/bin/bash",
             f"# Rendered by `mrl launch` into {cfg.run_dir}; submit it again with: sbatch {cfg.run_dir}/{SCRIPT_NAME}",
             "# overrides: " + (" ".join(_shell_word(o) for o in overrides) or "(none)"),
             f"# layout: {split} + {lay.num_train_nodes} trainer node(s) x {lay.nproc_per_node} rank(s)"
             + (", heterogeneous job" if cfg.cluster.hetjob else ""),
             *sbatch_header(cfg, lay),
             "",
             *variables(cfg, lay),
             "",
             "# ---- body of scripts/mrl.sbatch ----"]
    return "\n".join(lines) + "\n" + template_body()


JOB_YAML = """\
# Hydra entry of the nodes of this run (scripts/mrl_node.sh: mrl <cmd> --config-path <run_dir> --config-name job):
# the schema plus config.yaml, the config composed once by `mrl launch`. Logs go to stdout (the Slurm logs),
# not to one file in the run directory that every node would write.
defaults:
  - config_schema
  - config
  - override hydra/job_logging: stdout
  - _self_
hydra:
  run:
    dir: {run_dir}
  output_subdir: null
  job:
    chdir: false
"""


def job_yaml(run_dir: str) -> str:
    return JOB_YAML.format(run_dir=run_dir)
