"""A megatron model out as a Hugging Face checkpoint, from the live model (``train.save_hf``) or from a trainer
checkpoint of any layout (``mrl export``, ``mrl.jobs.export``).

    load_trainer_weights(model, layout, ckpt, lora=False, model_name=hf_path)  # every rank: its shards, resharded
    export_hf_dir(model, layout, bridge, padded_vocab, out, hf_path=hf_path)    # every rank

Streamed: each rank rebuilds the full tensors of its params a chunk at a time (an all-gather inside each TP
or expert-TP group), converts those it owns (``weights.is_owner``) to HF names and writes them into shard
files of its own; no weights cross ranks otherwise and no rank holds more than a chunk and a shard. Rank 0
then names the files, writes the index, copies config and tokenizer, and renames ``OUT.partial`` to OUT.
LoRA runs: the PEFT adapter directory, or with ``merge`` the base with the adapters folded in.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from mrl.config.schema import LoraConfig
from mrl.config.train import TrainConfig
from mrl.megatron import checkpoint_format
from mrl.megatron.collectives import broadcast_object
from mrl.megatron.lora import export_peft, is_adapter_key
from mrl.megatron.parallel import Layout
from mrl.megatron.weights import gather_full_many, is_owner, local_params, maps_by_name, unwrap
from mrl.models.bridge import ModelBridge, split_full
from mrl.models.checkpoint import CheckpointError, check_trainer_checkpoint
from mrl.models.hf_export import ShardWriter, begin_output, copy_model_files, publish, write_index
from mrl.models.peft import base_name, merge_peft, save_peft
from megatron.core import dist_checkpointing

SHARD_BYTES = 5 << 30
"""Largest safetensors file of an export (transformers' ``save_pretrained`` default, 5 GB)."""
CHUNK = 64
"""Params whose full tensors one rank rebuilds at a time."""


def owned_hf_tensors(model: torch.nn.Module, layout: Layout, bridge: ModelBridge,
                     padded_vocab: int) -> Iterator[dict[str, torch.Tensor]]:
    """The full HF-named CPU tensors this rank owns, a chunk of params at a time. Collective inside TP and
    expert-TP groups: their members hold the same params in the same order, so they chunk alike."""
    maps = maps_by_name(bridge, padded_vocab)
    items = [(lp, maps[lp.global_name]) for lp in local_params(model, layout)
             if not (bridge.tied_embeddings and lp.global_name == "output_layer.weight")]  # the embedding's copy
    for i in range(0, len(items), CHUNK):
        chunk = items[i:i + CHUNK]
        out: dict[str, torch.Tensor] = {}
        for (lp, pm), full in zip(chunk, gather_full_many(chunk)):
            if is_owner(lp, layout):
                out |= split_full(pm, full.detach().cpu())
        yield out


def merge_adapter(hf: dict[str, torch.Tensor], adapter: tuple[dict, dict]) -> dict[str, torch.Tensor]:
    """``hf`` (some of the model's HF tensors) with the adapter's factors of those folded in."""
    tensors, config = adapter
    mine = {k: v for k, v in tensors.items() if base_name(k) in hf}
    return merge_peft(hf, mine, config)


def export_hf_dir(model: torch.nn.Module, layout: Layout, bridge: ModelBridge, padded_vocab: int, out: str, *,
                  hf_path: str, lora: LoraConfig | None = None, merge: bool = False, force: bool = False,
                  dtype: torch.dtype | None = None, max_shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the model as a Hugging Face checkpoint directory ``out`` (see the module's docstring); config and
    tokenizer files from ``hf_path``. ``lora``: the model carries adapters: ``out`` is the PEFT directory, or
    with ``merge`` the merged model. ``dtype``: cast the weights (default: the model's). ``force``: replace
    an existing ``out``. Collective; every rank returns {path, bytes, seconds}."""
    t0 = time.perf_counter()
    rank0 = layout.world_rank == 0
    partial: str | Exception | None = None
    if rank0:
        try:
            partial = begin_output(out, force=force)
        except (CheckpointError, OSError) as e:
            partial = e
    partial = broadcast_object(partial, what="the export's directory")
    if isinstance(partial, Exception):
        raise partial
    if lora is not None and not merge:
        peft = export_peft(model, layout, bridge, lora, dst=0, dtype=dtype)
        total = 0
        if rank0:
            save_peft(partial, *peft)
            total = sum(t.numel() * t.element_size() for t in peft[0].values())
    else:
        adapter = export_peft(model, layout, bridge, lora, dst=None) if lora is not None else None
        writer = ShardWriter(partial, prefix=f"rank{layout.world_rank:05d}", max_bytes=max_shard_bytes)
        for hf in owned_hf_tensors(model, layout, bridge, padded_vocab):
            for name, t in (merge_adapter(hf, adapter) if adapter else hf).items():
                writer.add(name, t.to(dtype) if dtype is not None else t)
        files = [None] * layout.world_size
        dist.all_gather_object(files, writer.close())
        total = 0
        if rank0:
            total = write_index(partial, files)
            dt = dtype or unwrap(model).config.params_dtype
            copy_model_files(hf_path, partial, dtype=str(dt).removeprefix("torch."),
                             engine_config=bridge.engine_config())
    dist.barrier()  # every rank's files are in place
    if rank0:
        publish(partial, out)
    dist.barrier()
    return {"path": os.path.abspath(out), "bytes": broadcast_object(total, what="the export's size"),
            "seconds": time.perf_counter() - t0}


def saved_format(path: str) -> str:
    """The optimizer format a checkpoint was written in (its record): the model's shards do not depend on it,
    but its sharded state dict is built with the same metadata it was saved with."""
    rec = os.path.join(path, checkpoint_format.RECORD)
    if not os.path.isfile(rec):
        return checkpoint_format.LEGACY
    with open(rec) as f:
        return json.load(f).get("format", checkpoint_format.LEGACY)


def check_model_keys(path: str, sharded: dict, layout: Layout, *, model: str, hint: str) -> None:
    """Fail naming the mismatched tensors, not megatron's first shape error, when the trainer checkpoint
    ``path`` was written for another model than the one ``sharded`` (this rank's model state dict) is of.
    Collective: every rank's keys are compared with the checkpoint's."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    mine = {t.key: tuple(t.global_shape) if isinstance(t, ShardedTensor) else None  # factories: key only
            for t in nested_values(sharded) if isinstance(t, (ShardedTensor, ShardedTensorFactory))}
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, mine)
    expected: dict = {}
    for d in everyone:
        for k, shape in d.items():
            expected[k] = expected.get(k) or shape
    saved = {k: tuple(t.global_shape) for k, t in dist_checkpointing.load_tensors_metadata(path).items()}
    check_trainer_checkpoint(path, saved, expected, model=model, hint=hint)


def saved_padded_vocab(path: str) -> int | None:
    """Rows of the checkpoint's embedding (the vocabulary as padded by the run's TP), None if it holds none
    (LoRA runs save adapters only)."""
    meta = dist_checkpointing.load_tensors_metadata(path)
    emb = meta.get("embedding.word_embeddings.weight")
    return int(emb.global_shape[0]) if emb is not None else None


def load_trainer_weights(model: torch.nn.Module, layout: Layout, path: str, *, lora: bool, model_name: str) -> None:
    """The model weights of trainer checkpoint ``path`` (its optimizer state left) into ``model``, whatever
    layout the checkpoint was written in: megatron's dist_checkpointing reads each rank's slices of the global
    tensors. ``lora``: the checkpoint holds the adapters only (the base comes from the HF checkpoint). Collective."""
    sd = model.sharded_state_dict(metadata=checkpoint_format.metadata(saved_format(path)))
    if lora:
        sd = {k: v for k, v in sd.items() if is_adapter_key(k)}
    check_model_keys(path, sd, layout, model=model_name,
                     hint="export it with the run's own model (--hf PATH when it moved)")
    state = dist_checkpointing.load({"model": sd}, path)["model"]
    if not lora:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if is_adapter_key(k)]:
        raise CheckpointError(f"{path}: adapter state does not match the model: unexpected {unexpected[:4]}, "
                              f"missing {[k for k in missing if is_adapter_key(k)][:4]}")


def hf_dir_due(train: TrainConfig, step: int) -> str | None:
    """The ``run_dir/hf`` directory ``train.save_hf`` / ``train.save_hf_every`` ask for after ``step``, if any:
    ``final`` at the run's last step, ``step_N`` every N steps (the last one is ``final`` when both apply)."""
    if train.save_hf and step == train.steps:
        return "final"
    if train.save_hf_every and step % train.save_hf_every == 0:
        return f"step_{step}"
    return None


def save_hf_due(cfg, policy, step: int) -> None:
    """After ``step``, the live model to ``run_dir/hf/<hf_dir_due>``, replacing one there. Collective (``cfg``: the
    run's Config; ``policy``: its ``Policy``)."""
    name = hf_dir_due(cfg.train, step)
    if name is None:
        return
    out = os.path.join(cfg.run_dir, "hf", name)
    r = export_hf_dir(policy.module, policy.layout, policy.bridge, policy.padded_vocab, out,
                      hf_path=cfg.model.hf_path, lora=policy.lora, force=True)
    if policy.layout.world_rank == 0:
        what = "the PEFT adapter" if policy.lora is not None else "the model"
        print(f"[mrl] {what} as a Hugging Face checkpoint: {out} ({r['bytes'] / 2**30:.3g} GiB in "
              f"{r['seconds']:.3g} s)", flush=True)
