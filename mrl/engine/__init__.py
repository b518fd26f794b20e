"""Starting, watching and stopping SGLang servers (rank 0 of the trainer, ``mrl engine`` nodes): the launcher
(CPU mode and GPUs), the restarter, the FP8 checkpoint FP8 engines start from and the fused-MoE kernel tuner.
What is loaded into the servers themselves lives in ``mrl.engine.server``; talking to a running server is
``mrl.sglang``'s."""
