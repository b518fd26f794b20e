"""Per-rank workers of the tests, started by torchrun (``python -m tests.jobs.<name>``)."""
