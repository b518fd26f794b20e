"""Cluster launch: render a run's Slurm batch script from its config, submit it, wait for it.

    mrl launch cluster=slurm model=... [--dry-run] [--wait]     (mrl/cluster/launch.py)

``render`` is pure (config -> script text; snapshot-tested), ``slurm`` wraps sbatch/scontrol/sacct with
timeouts, ``engines`` is the ``<dir>/<name>.url`` announcement format shared by engine and trainer nodes.
The batch script body and the node entry live in scripts/ (mrl.sbatch, mrl_node.sh) so users can read
and submit them without mrl.
"""
