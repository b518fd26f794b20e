"""Reads of the package's state that only the tests need (the package never asks them): kept here so that
``mrl/`` holds no name used by tests alone (``tests/unit/test_package_layout.py``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import torch

from mrl.rollout.lora import AdapterRouter
from mrl.routing.sampling_mask import mask_from_support_ids


def adapters_in_use(router: AdapterRouter) -> dict[str, int]:
    """adapter name -> requests in flight (all engines)."""
    out: Counter = Counter()
    for (_, name), n in router._users.items():
        out[name] += n
    return dict(out)


async def wait_unloads(router: AdapterRouter) -> None:
    """Wait for the unloads the router sent so far."""
    while router._tasks:
        await asyncio.gather(*list(router._tasks), return_exceptions=True)


def count_support_mismatch(mask_NV: torch.Tensor, support_ids: Sequence[Sequence[int]]) -> int:
    """Positions where a (trainer-side) mask differs from the engine's support ids."""
    if mask_NV.shape[0] != len(support_ids):
        raise ValueError(f"mask has {mask_NV.shape[0]} positions, engine support {len(support_ids)}")
    engine_NV = mask_from_support_ids(support_ids, mask_NV.shape[-1], device=mask_NV.device)
    return int((engine_NV != mask_NV).any(-1).sum())
