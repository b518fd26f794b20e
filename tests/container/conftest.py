"""Tests of the built image (marker ``container``): skipped, with the reason, only where the image does not
exist (no podman, or `make image` not run on this machine); where it exists, it is first rebuilt from this
tree (cached layers: seconds when nothing changed)."""

# the ``image`` fixture is in tests/conftest.py: the Slurm container-preset tests use it too
