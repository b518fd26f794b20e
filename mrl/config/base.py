"""What every config node shares: the dtype enum and the error a bad value raises."""

from __future__ import annotations

import enum


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


def fail(key: str, msg: str) -> None:
    raise ValueError(f"{key}: {msg}")
