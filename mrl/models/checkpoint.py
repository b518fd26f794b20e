"""Read and write Hugging Face safetensors checkpoints, reading only the slices a rank needs.

Accepts single-file, multi-file (``model.safetensors.index.json``) checkpoints, and transformers-5
fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]),
which are exposed under the per-expert hub names the bridges and SGLang use.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class _Alias:
    """A per-expert name backed by one slice of a fused tensor: ``fused[index, row0:row0+rows]``."""

    fused: str
    index: int
    row0: int
    rows: int


class HFCheckpoint:
    """Lazy reader: nothing is loaded until ``read`` asks for rows of one tensor."""

    def __init__(self, path: str):
        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        index = os.path.join(path, "model.safetensors.index.json")
        self._file_of: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index) as f:
                for name, fn in json.load(f)["weight_map"].items():
                    self._file_of[name] = os.path.join(path, fn)
        else:
            for fn in files:
                with safe_open(fn, framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = fn
        self._handles: dict[str, object] = {}
        self._aliases: dict[str, _Alias] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in self._file_of:
            shape = tuple(self._slice(name).get_shape())
            m = _FUSED.match(name)
            if not m:
                self._shapes[name] = shape
                continue
            num_experts = shape[0]
            if m.group(2) == "gate_up_proj":  # [E, 2I, H], gate first
                inter = shape[1] // 2
                for e in range(num_experts):
                    for j, proj in enumerate(("gate_proj", "up_proj")):
                        alias = f"{m.group(1)}{e}.{proj}.weight"
                        self._aliases[alias] = _Alias(name, e, j * inter, inter)
                        self._shapes[alias] = (inter, shape[2])
            else:  # down_proj [E, H, I]
                for e in range(num_experts):
                    alias = f"{m.group(1)}{e}.down_proj.weight"
                    self._aliases[alias] = _Alias(name, e, 0, shape[1])
                    self._shapes[alias] = (shape[1], shape[2])

    def _slice(self, name: str):
        fn = self._file_of[name]
        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, framework="pt")
        return self._handles[fn].get_slice(name)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor under its per-expert (hub) name."""
        return dict(self._shapes)

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of tensor ``name``; only those bytes are read."""
        r0, r1 = rows if rows is not None else (0, self._shapes[name][0])
        a = self._aliases.get(name)
        if a is not None:
            sl = self._slice(a.fused)
            t = sl[a.index, a.row0 + r0:a.row0 + r1] if cols is None else sl[a.index, a.row0 + r0:a.row0 + r1, cols[0]:cols[1]]
            return t.contiguous()
        sl = self._slice(name)
        if len(self._shapes[name]) == 1:
            return sl[r0:r1]
        return sl[r0:r1] if cols is None else sl[r0:r1, cols[0]:cols[1]]

    def check_against(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor."""
        have = self._shapes
        missing = sorted(set(expected) - set(have))
        extra = sorted(set(have) - set(expected))
        bad = sorted(n for n in set(expected) & set(have) if tuple(expected[n]) != tuple(have[n]))
        problems = []
        if missing:
            problems.append(f"missing tensors: {missing}")
        if extra:
            problems.append(f"unexpected tensors: {extra}")
        if bad:
            problems.append("mis-shaped tensors: " + ", ".join(f"{n} has {list(have[n])}, expected {list(expected[n])}" for n in bad))
        if problems:
            raise CheckpointError(f"{self.path}: checkpoint does not match config.json: " + "; ".join(problems))


def save_hf(tensors: dict[str, torch.Tensor], path: str, config_src: str | None = None) -> None:
    """Write per-expert-named tensors as ``model.safetensors`` (+ copy config/tokenizer files)."""
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    if config_src:
        import shutil

        for fn in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(config_src, fn)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, fn)):
                shutil.copy(src, os.path.join(path, fn))
