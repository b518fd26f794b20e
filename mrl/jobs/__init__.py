"""Per-rank entry points started by torchrun (``python -m mrl.jobs.<name>``; launcher: ``mrl.process.torchrun``)."""
