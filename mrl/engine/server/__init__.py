"""What runs inside the SGLang servers mrl starts: the patches (``patches``: compact routes, batched and
replayed bucket loads), the recorded loads they replay (``replayed_load``), CPU mode's batched attention
(``cpu_attention``) and the ``sitecustomize`` shims that install them (``shim/`` on GPUs, ``cpu/pyshim/``
in CPU mode). Nothing here imports the trainer or rollout side; the one mrl module it shares with them is
the wire contract, ``mrl.sglang.wire``."""
