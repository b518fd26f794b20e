"""``mrl export-fp8 SRC DST``: a block-FP8 Hugging Face checkpoint from a bf16/fp32 one.

The tensors ``mrl.quant.fp8_targets`` names become e4m3 with a ``<name>_scale_inv`` partner (fp32, one per
128x128 block); the others are copied as they are. ``config.json`` gets the ``quantization_config`` block-FP8
checkpoints of Qwen3 and DeepSeek-V3 carry, which SGLang's ``fp8`` method and transformers' fine-grained
FP8 loader read; tokenizer, generation config and other small files are copied. Streamed: one source
tensor is read, quantized and queued at a time, and output shards are written as they fill
(``shard_bytes``), so memory holds one shard, not the model. transformers-5 fused expert tensors are
written under per-expert names, as every mrl export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Sequence

import torch
from safetensors.torch import save_file

from mrl.log import get_logger
from mrl.models.checkpoint import HFCheckpoint
from mrl.quant.fp8 import quantize_block_fp8
from mrl.quant.fp8_format import BLOCK_SIZE
from mrl.quant.fp8_targets import check_fused_groups, is_fp8_target, modules_to_not_convert, scale_inv_name

logger = get_logger(__name__)
WEIGHT_FILES = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth)$")


def quantization_config(names: Sequence[str], ignored: Sequence[str] = (),
                        block_size: tuple[int, int] = BLOCK_SIZE) -> dict:
    """``config.json``'s ``quantization_config`` for a block-FP8 checkpoint of these tensors."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block_size), "modules_to_not_convert": modules_to_not_convert(names, ignored)}


def export_fp8(src: str, dst: str, *, ignored: Sequence[str] = (), block_size: tuple[int, int] = BLOCK_SIZE,
               shard_bytes: int = 5 * 2 ** 30, device: str | None = None, log=None) -> dict:
    """Write the block-FP8 checkpoint of ``src`` to ``dst`` (must not hold a checkpoint); returns a summary.

    ignored: module paths kept in high precision on top of the rule (``modules_to_not_convert`` style,
    matched on whole path components). device: where tensors are quantized (``cuda`` takes the fused
    kernel); default: the CPU. log: where its summary line goes (default: mrl's logger)."""
    log = log or logger.info
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"{dst}: the FP8 checkpoint must go to another directory than its source")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src}/config.json already has a quantization_config "
                         f"({config['quantization_config'].get('quant_method')}): export from a bf16/fp32 checkpoint")
    if os.path.isfile(os.path.join(dst, "config.json")):
        raise FileExistsError(f"{dst}: already holds a checkpoint (config.json); give an empty or new directory")
    ckpt = HFCheckpoint(src)
    names = sorted(ckpt.shapes, key=_natural)
    check_fused_groups(names, ignored)
    os.makedirs(dst, exist_ok=True)
    t0 = time.monotonic()
    shards: list[dict[str, str]] = []  # per shard: tensor name -> temporary file name
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0
    quantized = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        tmp = f"model-{len(shards) + 1:05d}.safetensors.partial"
        save_file(pending, os.path.join(dst, tmp), metadata={"format": "pt"})
        shards.append({n: tmp for n in pending})
        pending, pending_bytes = {}, 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal pending_bytes, total_bytes
        t = t.contiguous()
        size = t.numel() * t.element_size()
        if pending and pending_bytes + size > shard_bytes:
            flush()
        pending[name] = t
        pending_bytes += size
        total_bytes += size

    for name in names:
        t = ckpt.read(name)
        if is_fp8_target(name, ignored) and t.dim() == 2:
            q, s = quantize_block_fp8(t.to(device) if device else t, block_size)
            add(name, q.cpu())
            add(scale_inv_name(name), s.cpu())
            quantized += 1
        else:
            add(name, t)
    flush()
    weight_map = _name_shards(dst, shards)
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
    _copy_side_files(src, dst)
    config["quantization_config"] = quantization_config(names, ignored, block_size)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    summary = {"src": src, "dst": dst, "tensors": len(names), "quantized": quantized, "shards": len(shards),
               "bytes": total_bytes, "seconds": round(time.monotonic() - t0, 2)}
    log(f"export-fp8: {quantized} of {len(names)} tensors block-FP8 ({block_size[0]}x{block_size[1]}), "
        f"{total_bytes / 2 ** 30:.2f} GiB in {len(shards)} shard(s) -> {dst}")
    return summary


def _name_shards(dst: str, shards: list[dict[str, str]]) -> dict[str, str]:
    """Temporary shard files -> ``model.safetensors`` (one) or ``model-0000i-of-0000n.safetensors``."""
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        tmp = next(iter(shard.values()))
        final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(dst, tmp), os.path.join(dst, final))
        weight_map.update({name: final for name in shard})
    return weight_map


def _copy_side_files(src: str, dst: str) -> None:
    """Everything at the top of ``src`` but the weights and config.json (tokenizer files, generation config,
    chat template, custom code)."""
    for fn in sorted(os.listdir(src)):
        path = os.path.join(src, fn)
        if fn == "config.json" or WEIGHT_FILES.search(fn) or not os.path.isfile(path):
            continue
        shutil.copy(path, os.path.join(dst, fn))


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="mrl export-fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="Hugging Face checkpoint directory (bf16 or fp32 safetensors)")
    ap.add_argument("dst", help="new directory for the block-FP8 checkpoint")
    ap.add_argument("--ignore", action="append", default=[], metavar="MODULE",
                    help="module path kept in high precision (repeatable), e.g. model.layers.0.self_attn")
    ap.add_argument("--block", type=int, nargs=2, default=list(BLOCK_SIZE), metavar=("ROWS", "COLS"))
    ap.add_argument("--shard-gb", type=float, default=5.0, help="output shard size (GiB)")
    ap.add_argument("--device", default=None, help="quantize on this device (cuda: the fused kernel)")
    a = ap.parse_args(argv)
    try:
        export_fp8(a.src, a.dst, ignored=a.ignore, block_size=tuple(a.block), shard_bytes=int(a.shard_gb * 2 ** 30),
                   device=a.device)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        logger.error("export-fp8: %s", e)
        return 1
    return 0
