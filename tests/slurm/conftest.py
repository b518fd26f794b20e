"""A real one-node Slurm cluster on localhost, started once per session by the tests that ask for it.

Slurm and munge come from Debian packages (scripts/install_slurm.sh, needs root and apt-get). A machine
where they can be neither found nor installed fails these tests with the installer's message: a skip
would hide that the real-Slurm path was never exercised.
"""

from __future__ import annotations

import pytest

from tests.slurm.localslurm import LocalSlurm, install


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    install()
    cluster = LocalSlurm(str(tmp_path_factory.mktemp("slurm"))).start()
    try:
        yield cluster
    finally:
        cluster.stop()
