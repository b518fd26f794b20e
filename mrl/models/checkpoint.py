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
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # torch only where tensors are read or written: the preflight reads headers without it
    import torch

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
                with safe_open(fn, framework="numpy") as f:
                    for name in f.keys():
                        self._file_of[name] = fn
        self._handles: dict[str, object] = {}
        self._aliases: dict[str, _Alias] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        headers: dict[str, object] = {}  # shapes from the headers; "numpy": no torch until a tensor is read
        for name in self._file_of:
            fn = self._file_of[name]
            if fn not in headers:
                headers[fn] = safe_open(fn, framework="numpy")
            shape = tuple(headers[fn].get_slice(name).get_shape())
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
            span = slice(a.row0 + r0, a.row0 + r1)
            t = sl[a.index, span] if cols is None else sl[a.index, span, cols[0]:cols[1]]
            return t.contiguous()
        sl = self._slice(name)
        if len(self._shapes[name]) == 1:
            return sl[r0:r1]
        return sl[r0:r1] if cols is None else sl[r0:r1, cols[0]:cols[1]]

    def check_against(self, expected: dict[str, tuple[int, ...]], skip=()) -> None:
        """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor (``skip``: tensors
        the model does not use, e.g. multi-token-prediction layers)."""
        have = {k: v for k, v in self._shapes.items() if k not in set(skip)}
        missing = sorted(set(expected) - set(have))
        extra = sorted(set(have) - set(expected))
        bad = sorted(n for n in set(expected) & set(have) if tuple(expected[n]) != tuple(have[n]))
        problems = []
        if missing:
            problems.append(f"missing tensors: {missing}")
        if extra:
            problems.append(f"unexpected tensors: {extra}")
        if bad:
            problems.append("mis-shaped tensors: " + ", ".join(
                f"{n} has {list(have[n])}, expected {list(expected[n])}" for n in bad))
        if problems:
            raise CheckpointError(f"{self.path}: checkpoint does not match config.json: " + "; ".join(problems))


def save_hf(tensors: dict[str, torch.Tensor], path: str, config_src: str | None = None,
            engine_config: dict | None = None) -> None:
    """Write per-expert-named tensors as ``model.safetensors`` (+ copy config/tokenizer files; the keys of
    ``engine_config`` missing from config.json are added: what SGLang reads beyond transformers)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    if config_src:
        import shutil

        for fn in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(config_src, fn)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, fn)):
                shutil.copy(src, os.path.join(path, fn))
    if engine_config:
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            cfg = json.load(f)
        missing = {k: v for k, v in engine_config.items() if k not in cfg}
        if missing:
            with open(cfg_file, "w") as f:
                json.dump({**cfg, **missing}, f, indent=2)


def check_tokenizer(path: str, *, vocab_size: int, special_ids: dict[str, int | list[int] | None]) -> None:
    """The RL loop encodes prompts with ``<path>/tokenizer.json``: refuse one that cannot belong to the
    model of ``<path>/config.json`` (more tokens than the model's vocabulary, or special token ids of the
    config outside the tokenizer), naming both files."""
    tok_file, cfg_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "config.json")
    if not os.path.isfile(tok_file):
        raise CheckpointError(f"{tok_file}: missing; the RL loop encodes prompts with the model's own tokenizer "
                              "(tokenizers' tokenizer.json next to config.json)")
    from tokenizers import Tokenizer

    try:
        n = Tokenizer.from_file(tok_file).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises plain Exception on bad JSON
        raise CheckpointError(f"{tok_file}: not a tokenizers file: {e}") from e
    problems = []
    if n > vocab_size:
        problems.append(f"it has {n} tokens but {cfg_file} has vocab_size={vocab_size} (ids >= {vocab_size} "
                        "have no embedding)")
    for key, ids in special_ids.items():
        for i in [ids] if isinstance(ids, int) else list(ids or []):
            if not 0 <= i < n:
                problems.append(f"{cfg_file} has {key}={i}, outside its {n} tokens")
    if problems:
        raise CheckpointError(f"{tok_file} does not match the model: " + "; ".join(problems)
                              + " -- is it the tokenizer of another model?")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")  # megatron's optimizer keys, chained ones prefixed


def check_trainer_checkpoint(path: str, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...] | None],
                             *, model: str, hint: str) -> None:
    """Before resuming from a trainer checkpoint (megatron dist_checkpointing): its tensors (``saved``: key ->
    global shape, optimizer state excluded) must be the model's (``expected``: every rank's keys, shape None
    where megatron does not give one up front). Raise CheckpointError naming the checkpoint, the model and
    every missing, unexpected or mis-shaped tensor, and ``hint``: what to do."""
    saved = {k: v for k, v in saved.items() if not _OPTIMIZER.match(k)}
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    bad = sorted(k for k in set(expected) & set(saved)
                 if expected[k] is not None and tuple(saved[k]) != tuple(expected[k]))
    if not (missing or extra or bad):
        return

    def layers(keys) -> int:
        return 1 + max((int(m.group(1)) for k in keys if (m := _LAYER.match(k))), default=-1)

    problems = []
    if layers(saved) != layers(expected):
        problems.append(f"{layers(saved)} transformer layers in the checkpoint, {layers(expected)} in the model")
    if bad:
        problems.append("mis-shaped tensors: " + ", ".join(
            f"{k} is {list(saved[k])} in the checkpoint, {list(expected[k])} in the model" for k in bad[:5])
            + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
    for what, keys in (("missing from the checkpoint", missing), ("not in the model", extra)):
        if keys:
            problems.append(f"{len(keys)} tensors {what}: {keys[:5]}" + (" ..." if len(keys) > 5 else ""))
    raise CheckpointError(f"{path}: this trainer checkpoint does not match the model of model.hf_path={model}: "
                          + "; ".join(problems) + f" -- it was written for another model: {hint}")
