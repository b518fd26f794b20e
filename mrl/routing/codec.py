"""SGLang routed experts -> compact ``[tokens, moe_layers, top_k]`` uint8 (uint16 above 256 experts).

Wire format (sglang 0.5.10 and 0.5.14, tests/fixtures/sglang-0.5.10/gen_routed.json): base64 of little-endian
int32, logical shape ``[prompt + completion - 1, num_hidden_layers, num_experts_per_tok]`` (every
input position; the last sampled token is never fed through the model). With ``max_new_tokens=0``
the engine returns ``prompt`` rows. Dense layers are present and zero: they are dropped here, once,
at the client; nothing downstream sees JSON or int32 again. Top-k order is kept.

Shape legend: T tokens (rows), L MoE layers, K top-k.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np


class RoutesError(ValueError):
    pass


@dataclass(frozen=True)
class RoutesCodec:
    num_layers: int
    """num_hidden_layers of the HF config (the engine's layer axis)."""
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]
    """Indices of the sparse layers, in order (the trainer's RouterReplay order)."""

    @classmethod
    def from_bridge(cls, bridge) -> "RoutesCodec":
        pattern = bridge.moe_layer_pattern()
        return cls(num_layers=len(pattern), top_k=int(bridge.hf_config.num_experts_per_tok),
                   num_experts=bridge.num_experts, moe_layers=tuple(i for i, s in enumerate(pattern) if s))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    def expected_rows(self, prompt_len: int, response_len: int) -> int:
        return prompt_len if response_len == 0 else prompt_len + response_len - 1

    def decode(self, b64: str, *, prompt_len: int, response_len: int) -> np.ndarray:
        """Validated compact routes ``routes_TLK`` for a sequence of prompt_len + response_len tokens."""
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RoutesError(f"routed_experts is not valid base64: {e}") from e
        per_row = self.num_layers * self.top_k
        if len(raw) % (4 * per_row):
            raise RoutesError(f"routed_experts has {len(raw)} bytes, "
                              f"not a multiple of 4*{self.num_layers}*{self.top_k}")
        ids_TLK = np.frombuffer(raw, dtype="<i4").reshape(-1, self.num_layers, self.top_k)
        want = self.expected_rows(prompt_len, response_len)
        if ids_TLK.shape[0] != want:
            raise RoutesError(f"routed_experts has {ids_TLK.shape[0]} rows, expected {want} "
                              f"(prompt {prompt_len} + response {response_len} - 1)")
        ids_TLK = ids_TLK[:, list(self.moe_layers), :]
        if ids_TLK.size and (ids_TLK.min() < 0 or ids_TLK.max() >= self.num_experts):
            raise RoutesError(f"routed_experts has expert ids outside [0, {self.num_experts}): "
                              f"min {ids_TLK.min()}, max {ids_TLK.max()}")
        return np.ascontiguousarray(ids_TLK.astype(self.dtype))

    def wire_bytes_per_token(self, b64: str, num_tokens: int) -> float:
        return len(b64) / max(1, num_tokens)

    def compact_bytes_per_token(self) -> int:
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize
