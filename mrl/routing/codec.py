"""SGLang routed experts -> compact ``[tokens, moe_layers, top_k]`` uint8 (uint16 above 256 experts).

Wire format (sglang 0.5.10 and 0.5.14, tests/fixtures/sglang-0.5.10/gen_routed.json): base64 of
little-endian integers, logical shape ``[prompt + completion - 1, num_hidden_layers, num_experts_per_tok]``
(every input position; the last sampled token is never fed through the model). With ``max_new_tokens=0``
the engine returns ``prompt`` rows. Plain SGLang sends int32; engines started by mrl send the smallest
type that holds the request's ids (uint8, else int16; ``mrl.engine.server.patches``). The row count is
known here, so the payload's length tells the item size (1, 2 or 4 bytes); anything else is refused.
Length alone cannot catch a row count off by the ratio of two item sizes: int32 of a quarter of the
rows reads as uint8, of half the rows as 16-bit. The second is refused (16-bit ids that all fit in
uint8: mrl's engines never send those); the first passes when its ids are in range.
Dense layers are present and zero: they are dropped here, once, at the client; nothing downstream sees
JSON or the wire types again. Top-k order is kept.

Decoding runs once per sample in the rollout client's event loop, which every reply of a batch waits
on: base64 goes through pybase64 (SIMD; SGLang's own dependency) where it is installed, and the check
that no token repeats an expert compares ids in place rather than sorting them.

Shape legend: T tokens (rows), L MoE layers, K top-k.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass

import numpy as np

try:
    from pybase64 import b64decode
except ImportError:  # the standard library's decoder: same results, several times slower
    from base64 import b64decode


class RoutesError(ValueError):
    pass


# item size on the wire -> how to read it; 2 bytes: int16 from mrl's engines, read as uint16 (ids >= 0)
_WIRE_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<i4")}
_WIRE_NAMES = {1: "uint8", 2: "16-bit", 4: "int32"}


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
            raw = b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RoutesError(f"routed_experts is not valid base64: {e}") from e
        want = self.expected_rows(prompt_len, response_len)
        itemsize = self.wire_itemsize(len(raw), want)
        ids_TLK = np.frombuffer(raw, dtype=_WIRE_DTYPES[itemsize])
        ids_TLK = ids_TLK.reshape(want, self.num_layers, self.top_k)
        if len(self.moe_layers) != self.num_layers:
            ids_TLK = ids_TLK[:, list(self.moe_layers), :]
        if not ids_TLK.size:
            return np.ascontiguousarray(ids_TLK.astype(self.dtype))
        lo, hi = ids_TLK.min(), ids_TLK.max()
        if lo < 0 or hi >= self.num_experts:
            raise RoutesError(f"routed_experts has expert ids outside [0, {self.num_experts}): min {lo}, max {hi}")
        if self.top_k > 1:  # a router picks k distinct experts per token and layer
            dup = np.flatnonzero(repeats(ids_TLK.reshape(-1, self.top_k)))
            if len(dup):
                t, layer = divmod(int(dup[0]), ids_TLK.shape[1])
                raise RoutesError(f"routed_experts repeats an expert within one token's top-{self.top_k} "
                                  f"(row {t}, MoE layer {layer}: {ids_TLK[t, layer].tolist()}); "
                                  f"{len(dup)} such (row, layer) pairs")
        if itemsize == 2 and hi < 256:
            # mrl's engines send 16 bits only for an id that needs them: these bytes are more likely
            # another type's with a wrong row count (int32 of half the rows)
            raise RoutesError(f"routed_experts has {len(raw)} bytes, 2 per id for {want} rows, but every id fits in "
                              f"uint8 (max {hi}): not a payload an engine sends; wrong row count?")
        return np.ascontiguousarray(ids_TLK.astype(self.dtype))

    def wire_itemsize(self, nbytes: int, rows: int) -> int:
        """Bytes per expert id of a ``nbytes`` payload (decoded from base64) holding ``rows`` rows."""
        ids = rows * self.num_layers * self.top_k
        for size in _WIRE_DTYPES:
            if nbytes == ids * size:
                return size
        rows_if = ", ".join(f"{nbytes // (self.num_layers * self.top_k * s)} of {_WIRE_NAMES[s]}"
                            for s in _WIRE_DTYPES if nbytes % (self.num_layers * self.top_k * s) == 0)
        raise RoutesError(f"routed_experts has {nbytes} bytes, expected {rows} rows x {self.num_layers} layers x "
                          f"{self.top_k} top-k x 1, 2 or 4 bytes = {ids}, {2 * ids} or {4 * ids}"
                          + (f" (it holds whole rows: {rows_if})" if rows_if else ""))

    def compact_bytes_per_token(self) -> int:
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize


_BYTE_LOW = np.uint64(0x0101010101010101)
_BYTE_HIGH = np.uint64(0x8080808080808080)


def repeats(ids_NK: np.ndarray) -> np.ndarray:
    """``[N]`` bool: rows of ``ids_NK`` in which some id appears more than once."""
    n, k = ids_NK.shape
    if k == 8 and ids_NK.dtype.itemsize == 1:
        # eight one-byte ids are one 64-bit word: byte i meets byte i + d (mod 8) where the word XOR its
        # rotation by d bytes has a zero byte; d = 1..4 meets every pair
        w = np.ascontiguousarray(ids_NK).view(np.uint64).ravel()
        bad = np.zeros(n, bool)
        for d in range(1, 5):
            s = np.uint64(8 * d)
            v = w ^ ((w >> s) | (w << (np.uint64(64) - s)))
            bad |= ((v - _BYTE_LOW) & ~v & _BYTE_HIGH) != 0  # some byte of v is zero
        return bad
    bad = np.zeros(n, bool)
    for i in range(k):
        for j in range(i + 1, k):
            bad |= ids_NK[:, i] == ids_NK[:, j]
    return bad
