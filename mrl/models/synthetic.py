"""Synthetic weights: every HF tensor of a model drawn from (seed, tensor name, shape), with no checkpoint on disk.

    weights = SyntheticWeights(hf_dir, seed=0, device="cuda")   # hf_dir: config.json only
    load_hf_into(model, layout, bridge, weights, padded_vocab)  # the trainer imports it as it reads a checkpoint
    for name, t in weights.tensors(): ...                        # or streams it, one tensor at a time (an engine)

A model too large to write next to its software (Qwen3-30B-A3B: 61 GB of bf16 on a 64 GB disk) can still be
built by the trainer and served by an engine with the same weights: both ask for the same tensor by name and
get the same values. Values follow transformers' init, as ``bench/_random_checkpoint.py`` writes them:
matrices normal(0, ``std``) from a generator seeded with ``crc32(f"{seed}:{name}")``, 1-D tensors (norms)
ones, so a checkpoint written by that script reads back bitwise equal to these weights on the same kind of
device (CUDA and CPU generators draw different numbers). At 0.02 the forward stays finite through 48 layers
(pre-norm residual stream, unit norms) and the router's logits have a spread of about 0.02 * sqrt(hidden),
so every token picks its experts rather than ties.

The tensor names and shapes are the bridge's (``ModelBridge.hf_tensor_shapes``): the names a checkpoint
of that ``config.json`` holds, per-expert as SGLang loads them.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator

from mrl.models.checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

    from mrl.models.bridge import ModelBridge

STD = 0.02
"""transformers' ``initializer_range`` for these families: the matrices' standard deviation."""


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: stable across processes and runs (not Python's ``hash``)."""
    return zlib.crc32(f"{seed}:{name}".encode())


def synthetic_tensor(name: str, shape: tuple[int, ...], *, seed: int = 0, std: float = STD, device="cpu",
                     dtype=None) -> torch.Tensor:
    """Tensor ``name`` of ``shape``: ones for 1-D tensors (norms), else normal(0, ``std``) drawn in fp32 on
    ``device`` from its own generator, cast to ``dtype`` (default bf16, what a checkpoint of the family holds)."""
    import torch

    dtype = dtype or torch.bfloat16
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=g).to(dtype)


class SyntheticWeights:
    """A checkpoint reader (``HFCheckpoint``'s ``read``/``shapes``/``check_against``) whose tensors are drawn,
    not read: the trainer's importer takes it as it takes a checkpoint (``mrl.megatron.weights.load_hf_into``).

    ``path``: a directory with the model's ``config.json`` (weights are not looked for). Tensors are drawn on
    ``device`` in fp32 and cast to ``dtype`` (bf16 by default: the values a bf16 checkpoint would hold, also
    for an fp32 trainer). The few most recent full tensors are kept (``cache_bytes``), since the importer
    reads q/k/v and gate/up in row slices, one per query group or TP rank."""

    def __init__(self, path: str, *, seed: int = 0, std: float = STD, device="cpu", dtype=None,
                 bridge: ModelBridge | None = None, cache_bytes: int = 1 << 30):
        import torch

        from mrl.models import get_bridge

        self.path, self.seed, self.std, self.device = path, seed, std, device
        self.dtype = dtype or torch.bfloat16
        self.bridge = bridge or get_bridge(path)
        # the HF tensors' shapes do not depend on vocab padding (pad rows are no HF tensor's)
        self._shapes = self.bridge.hf_tensor_shapes(self.bridge.vocab_size)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_bytes = cache_bytes

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    @property
    def num_bytes(self) -> int:
        """Bytes of every tensor in ``dtype``."""
        import math

        import torch

        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(s) for s in self._shapes.values()) * size

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        if name not in self._shapes:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in a model of this config.json")
        t = self._cache.get(name)
        if t is None:
            t = synthetic_tensor(name, self._shapes[name], seed=self.seed, std=self.std, device=self.device,
                                 dtype=self.dtype)
            self._cache[name] = t
            while len(self._cache) > 1 and sum(x.numel() * x.element_size() for x in self._cache.values()) \
                    > self._cache_bytes:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(name)
        return t

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
             ) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of tensor ``name`` (``HFCheckpoint.read``'s contract)."""
        t = self.full(name)
        if rows is not None:
            t = t[rows[0]:rows[1]]
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        return t

    def tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of ``names`` (default: every tensor, in the bridge's order), each drawn when asked
        for and not kept: a consumer holding one bucket at a time holds no more than that."""
        for name in names if names is not None else list(self._shapes):
            if name not in self._shapes:
                raise CheckpointError(f"{self.path}: no tensor {name!r} in a model of this config.json")
            yield name, synthetic_tensor(name, self._shapes[name], seed=self.seed, std=self.std, device=self.device,
                             dtype=self.dtype)

    def check_against(self, expected: dict[str, tuple[int, ...]], skip=()) -> None:
        """The importer's check: the same tensors and shapes (always true for the bridge that made them,
        unless the caller's bridge is another model's)."""
        have = {k: v for k, v in self._shapes.items() if k not in set(skip)}
        if have != {k: tuple(v) for k, v in expected.items()}:
            diff = sorted(set(have) ^ set(expected))[:5]
            raise CheckpointError(f"{self.path}: synthetic weights of this config.json do not match the model "
                                  f"being loaded (first differing names: {diff})")
