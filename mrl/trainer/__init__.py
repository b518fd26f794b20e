"""The trainer ranks' process: the RL loop, rank 0's controller, the loop state and its checkpoints, the
step's batch, the supervised warm start (``mrl train`` starts one per rank through ``mrl.jobs.train``)."""
