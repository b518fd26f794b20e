"""Writing a Hugging Face checkpoint directory: sharded safetensors with ``model.safetensors.index.json``, the
model's config and tokenizer files, all into ``OUT.partial``, renamed to ``OUT`` once complete.

    partial = begin_output(out, force=False)        # refuses an existing OUT
    writer = ShardWriter(partial, prefix="rank00000", max_bytes=5 << 30)
    writer.add(name, tensor) ...                     # streamed: a shard is written once full
    files = writer.close()                           # [(file, names, bytes)]
    write_index(partial, [files])                    # model-0000i-of-0000n.safetensors + the index
    copy_model_files(hf_path, partial, dtype="bfloat16", engine_config={...})
    publish(partial, out)

A directory named OUT is always whole: an export that dies leaves ``OUT.partial`` (removed by the next one).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

from mrl.models.checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
PARTIAL = ".partial"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def begin_output(out: str, *, force: bool) -> str:
    """The ``OUT.partial`` directory to write into, empty; a CheckpointError for an ``out`` that exists (a
    directory only with ``force``, which ``publish`` then replaces)."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not (force and os.path.isdir(out)):
        what = "a file" if not os.path.isdir(out) else "a directory"
        raise CheckpointError(f"{out}: {what} already exists; choose another output directory"
                              + (" (--force replaces an existing directory)" if os.path.isdir(out) else ""))
    partial = out + PARTIAL
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted export left
    os.makedirs(partial)
    return partial


def publish(partial: str, out: str) -> None:
    """Rename the complete ``partial`` to ``out`` (its files synced first), replacing an existing ``out``."""
    for root, _, names in os.walk(partial):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    out = os.path.abspath(out)
    if os.path.isdir(out):  # --force: the old one goes aside first, a rename cannot replace a directory
        old = out + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)


class ShardWriter:
    """Tensors streamed into safetensors files of at most ``max_bytes`` each (a larger tensor gets a file of its
    own) named ``<prefix>-<k>.safetensors`` under ``path``, until ``write_index`` gives them their final names."""

    def __init__(self, path: str, *, prefix: str, max_bytes: int):
        self.path, self.prefix, self.max_bytes = path, prefix, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str], int]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().cpu().contiguous()
        self.pending_bytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        fn = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.path, fn), metadata={"format": "pt"})
        self.files.append((fn, sorted(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str], int]]:
        """Write what is pending; every file written, as (file name, tensor names, bytes)."""
        self.flush()
        return self.files


def write_index(path: str, files_per_writer: list[list[tuple[str, list[str], int]]]) -> int:
    """Rename every writer's files under ``path`` to transformers' ``model-0000i-of-0000n.safetensors`` (in the
    order given) and write ``model.safetensors.index.json``; the tensors' total bytes."""
    files = [f for per in files_per_writer for f in per]
    weight_map: dict[str, str] = {}
    total = 0
    for i, (fn, names, nbytes) in enumerate(files, 1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(path, fn), os.path.join(path, final))
        for name in names:
            if name in weight_map:
                raise AssertionError(f"{name} written twice")
            weight_map[name] = final
        total += nbytes
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return total


def copy_model_files(src: str, dst: str, *, dtype: str | None = None, engine_config: dict | None = None) -> list[str]:
    """Copy every top-level file of the HF directory ``src`` but its weights (config.json,
    generation_config.json, the tokenizer's files, chat template, remote code, license) into ``dst``; in
    config.json, the dtype is ``dtype`` (what the export holds) and ``engine_config``'s keys it lacks are added
    (what SGLang reads beyond transformers). The names copied."""
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES:
            continue
        shutil.copyfile(path, os.path.join(dst, name))
        copied.append(name)
    cfg_file = os.path.join(dst, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"{src}: no config.json (the model's Hugging Face directory holds it)")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if dtype is not None:  # transformers 5 writes "dtype", earlier versions "torch_dtype"
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]:
            cfg[key] = dtype
    cfg |= {k: v for k, v in (engine_config or {}).items() if k not in cfg}
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)
    return copied
