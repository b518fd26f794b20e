"""Tests of the built image (marker ``container``): skipped, with the reason, only where the image does not
exist (no podman, or `make image` not run on this machine); where it exists, it is first rebuilt from this
tree (cached layers: seconds when nothing changed)."""

from __future__ import annotations

import pytest

from tests.container.podman import image_tag, missing_reason, rebuilt


@pytest.fixture(scope="session")
def image() -> str:
    tag = image_tag()
    if reason := missing_reason(tag):
        pytest.skip(reason)
    return rebuilt(tag)
