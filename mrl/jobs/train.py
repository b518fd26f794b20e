"""Trainer rank entry point (``mrl train`` starts one per rank with torchrun):

    python -m mrl.jobs.train <run_dir>/config.yaml

Rank 0 starts the engines the job owns first of all (``RunEngines``, which the loop's controller then
owns): they boot while the ranks import megatron and build the model. Library warnings go to
``<run_dir>/logs/rank<r>.log`` before megatron, transformers and torch are imported (they warn on import),
then the loop runs (``mrl.trainer.loop``).
"""

from __future__ import annotations

import os
import sys

from mrl.cluster.rundir import secure_run_dir
from mrl.compile_cache import cache_env
from mrl.config.load import load_resolved
from mrl.console import route_library_output
from mrl.trainer.engines import RunEngines


def main(config_path: str) -> int:
    cfg = load_resolved(config_path)
    secure_run_dir(cfg.run_dir)  # also on nodes where ``mrl train`` did not create it (Slurm)
    rank = int(os.environ.get("RANK", "0"))
    engines = RunEngines(cfg).start_early() if rank == 0 else None
    import torch  # importing torch gives its logger a console handler: the routing replaces it

    if torch.cuda.is_available():  # before anything compiles
        for key, value in cache_env(cfg.train.compile_cache_dir).items():
            os.environ.setdefault(key, value)

    route_library_output(cfg.run_dir, rank)
    from mrl.trainer.loop import main as run_loop  # after the routing: importing megatron warns

    route_library_output(cfg.run_dir, rank)  # again: transformers installs its own console handler on import
    return run_loop(cfg, engines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
