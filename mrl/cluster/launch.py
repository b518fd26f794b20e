"""``mrl launch``: compose the config once, write the run directory, submit its Slurm job, optionally wait.

    mrl launch cluster=slurm model=qwen3_30b_a3b parallel=tp4_ep8 run_dir=/shared/runs/r1 [--dry-run] [--wait]

The run directory gets config.yaml (the resolved config), job.yaml (the Hydra entry every node loads),
mrl_node.sh (node entry), mrl.sbatch (the rendered batch script) and logs/. ``--dry-run`` writes them and
prints the script instead of submitting; ``--wait`` follows the job (across requeues) and, when it does not
complete, prints its state and the tail of its Slurm log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Callable

from omegaconf import OmegaConf

from mrl.cluster import render, slurm
from mrl.config.schema import Config, ContainerKind
from mrl.log import get_logger

LOG_TAIL_LINES = 40
log = get_logger(__name__)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mrl launch", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for mrl train (cluster=slurm ...)")
    ap.add_argument("--dry-run", action="store_true", help="write the run directory and print the script; no sbatch")
    ap.add_argument("--wait", action="store_true", help="wait for the job; report state and log tail on failure")
    ap.add_argument("--timeout", type=float, default=None, help="--wait: give up after this many seconds")
    ap.add_argument("--poll", type=float, default=5.0, help="--wait: seconds between scontrol calls")
    return ap


def compose(overrides: list[str]) -> Config:
    """The run's config, with its paths made absolute and the node interpreter chosen.

    Relative paths are taken against the directory mrl launch runs in: jobs may run elsewhere (containers
    start in cluster.container_workdir).
    """
    from mrl.config.load import compose as hydra_compose

    cfg = hydra_compose(overrides)
    cfg.run_dir = os.path.abspath(cfg.run_dir)
    cfg.model.hf_path = os.path.abspath(cfg.model.hf_path)
    if cfg.data.path:
        cfg.data.path = os.path.abspath(cfg.data.path)
    if cfg.engine.url_dir:
        cfg.engine.url_dir = os.path.abspath(cfg.engine.url_dir)
    for pool in cfg.scoring.pools.values():  # read by the scoring nodes and the preflight
        if pool.hf_path:
            pool.hf_path = os.path.abspath(pool.hf_path)
    if cfg.cluster.python is None:  # a virtualenv on shared storage, or the image's interpreter
        cfg.cluster.python = sys.executable if cfg.cluster.container == ContainerKind.none else "python"
    return cfg


def write_run_dir(cfg: Config, script: str) -> str:
    """config.yaml, job.yaml, mrl_node.sh, mrl.sbatch and logs/ in cfg.run_dir; returns the script's path."""
    os.makedirs(os.path.join(cfg.run_dir, "logs"), exist_ok=True)  # sbatch does not create --output's directory
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    with open(os.path.join(cfg.run_dir, "job.yaml"), "w") as f:
        f.write(render.job_yaml(cfg.run_dir))
    node_sh = os.path.join(cfg.run_dir, render.NODE_ENTRY_NAME)
    shutil.copyfile(render.NODE_ENTRY, node_sh)
    os.chmod(node_sh, 0o755)
    path = os.path.join(cfg.run_dir, render.SCRIPT_NAME)
    with open(path, "w") as f:
        f.write(script)
    return path


def report(info: slurm.JobInfo, run_dir: str) -> str:
    log = info.stdout or os.path.join(run_dir, "logs", f"slurm-{info.job_id}.out")
    head = (f"job {info.job_id} {info.state} (exit code {info.exit_code or '?'}, reason {info.reason or '-'}, "
            f"{info.restarts} restart(s))")
    return f"{head}\nSlurm log {log} (last {LOG_TAIL_LINES} lines):\n{slurm.tail(log, LOG_TAIL_LINES)}"


def main(argv: list[str], preflight: Callable[[Config], int] | None = None) -> int:
    """``preflight``: checks of the composed config before anything is written (``mrl launch``: the inputs the
    login node can see, ``mrl.preflight``); its nonzero status is returned."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = _parser().parse_args(argv)
    try:
        cfg = compose(args.overrides)
        script = render.render_sbatch(cfg, overrides=args.overrides)
    except (ValueError, HydraException, OmegaConfBaseException) as e:
        cause = f" ({e.__cause__})" if e.__cause__ else ""
        print(f"mrl launch: bad config, nothing submitted: {e}{cause}", file=sys.stderr)
        return 2
    if preflight is not None and (code := preflight(cfg)):  # each bad input: one line; nothing written or submitted
        return code
    from mrl.sglang.keys import ensure_run_secrets

    ensure_run_secrets(cfg.run_dir)  # once, before any node starts: every node then loads the same file
    path = write_run_dir(cfg, script)
    if args.dry_run:
        print(script, end="")  # stdout is the script alone (``> job.sbatch``): the note goes to stderr, any level
        print(f"\n[mrl] wrote {cfg.run_dir}/{{config.yaml,job.yaml,{render.NODE_ENTRY_NAME},{render.SCRIPT_NAME}}}; "
              f"submit with: sbatch {path}", file=sys.stderr)
        return 0
    try:
        job_id = slurm.submit(path)
    except slurm.SlurmError as e:
        print(f"mrl launch: {e}", file=sys.stderr)
        return 1
    log.info("submitted job %s: %s (log %s/logs/slurm-%s.out)", job_id, path, cfg.run_dir, job_id)
    if not args.wait:
        return 0
    try:
        info = slurm.wait(job_id, poll_s=args.poll, timeout_s=args.timeout, on_change=lambda i: log.info(
            "job %s: %s (attempt %s)", i.job_id, i.state, i.restarts))
    except (slurm.SlurmError, TimeoutError) as e:
        print(f"mrl launch: {e}", file=sys.stderr)
        return 1
    if info.ok:
        log.info("job %s completed; outputs in %s", job_id, cfg.run_dir)
        return 0
    print(f"mrl launch: {report(info, cfg.run_dir)}", file=sys.stderr)
    return 1
