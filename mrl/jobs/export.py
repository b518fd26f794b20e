"""``mrl export CHECKPOINT OUT``: a trainer checkpoint as a Hugging Face checkpoint directory.

    mrl export runs/x/checkpoints/step_60 out/     # one process, TP1: megatron reads the shards into that layout
    mrl export runs/x out/ --force                 # a run directory: its newest complete checkpoint
    mrl export runs/x out/ --tp 2 --ep 2           # loaded in another layout: as many processes as it needs
    mrl export runs/lora out/ [--merge]            # LoRA runs: the PEFT adapter, or the base with it merged

CHECKPOINT was written in any layout (TP/PP/EP/ETP, its ``optimizer_format.json`` says which): the model's
tensors are global in megatron's dist_checkpointing, and each rank of the export reads its slices of them.
The model is the run's (``<run_dir>/config.yaml``, two levels above the checkpoint, or ``--config``), its HF
directory ``model.hf_path`` (or ``--hf``) gives config.json, generation_config.json and the tokenizer files.
OUT is written as ``OUT.partial`` and renamed when complete; an existing OUT is refused unless ``--force``.
``mrl export`` checks its arguments, then starts ``python -m mrl.jobs.export`` on each rank under torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from mrl.config.schema import Config, ParallelConfig
from mrl.models.checkpoint import CheckpointError
from mrl.process import LOOP_STATE_FILE


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mrl export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="<run_dir>/checkpoints/step_N, or a run directory (its newest checkpoint)")
    ap.add_argument("out", help="the Hugging Face directory to write")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--merge", action="store_true", help="LoRA runs: the base model with the adapter merged in")
    ap.add_argument("--config", default=None, help="the run's resolved config.yaml (default: <run_dir>/config.yaml)")
    ap.add_argument("--hf", default=None, help="the model's HF directory (default: model.hf_path of the config)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="cast the weights (default: the trainer's dtype, model.dtype)")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file, GB")
    ap.add_argument("--cpu", action="store_true", help="load and convert on the CPU even where CUDA is present")
    for k in ("tp", "pp", "ep"):
        ap.add_argument(f"--{k}", type=int, default=1, help=f"layout of the export's ranks ({k}; default 1)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    return ap


@dataclass
class Source:
    checkpoint: str
    config_path: str
    cfg: Config


def find_source(path: str, *, config: str | None = None, hf: str | None = None) -> Source:
    """The complete trainer checkpoint at ``path`` (a run directory: its newest), the run's config (model.hf_path
    replaced by ``hf``); a CheckpointError saying what ``path`` is instead."""
    from mrl.config.load import load_resolved
    from mrl.trainer.state import latest_checkpoint

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory (a trainer checkpoint is <run_dir>/checkpoints/step_N)")
    if os.path.isdir(os.path.join(path, "checkpoints")) and not os.path.exists(os.path.join(path, LOOP_STATE_FILE)):
        cfg_path = config or os.path.join(path, "config.yaml")
        cfg = _load(cfg_path, load_resolved)
        cfg.run_dir = path  # the directory as it is now (it may have moved since the run)
        ckpt = latest_checkpoint(cfg)
        if ckpt is None:
            raise CheckpointError(f"{path}: a run directory without a complete checkpoint under checkpoints/ "
                                  f"(each holds {LOOP_STATE_FILE} once its save completed)")
    else:
        ckpt = path
        if not os.path.isfile(os.path.join(path, LOOP_STATE_FILE)):
            if os.path.isfile(os.path.join(path, ".metadata")):
                raise CheckpointError(f"{path}: an incomplete checkpoint (no {LOOP_STATE_FILE}: its save never "
                                      "completed); export the one before it")
            if os.path.isfile(os.path.join(path, "config.json")):
                raise CheckpointError(f"{path}: a Hugging Face checkpoint (config.json), not a trainer checkpoint; "
                                      "it needs no export")
            raise CheckpointError(f"{path}: not a trainer checkpoint (<run_dir>/checkpoints/step_N, holding "
                                  f"{LOOP_STATE_FILE}) nor a run directory")
        cfg_path = config or os.path.join(os.path.dirname(os.path.dirname(path)), "config.yaml")
        cfg = _load(cfg_path, load_resolved)
    if hf is not None:
        cfg.model.hf_path = os.path.abspath(hf)
    if not os.path.isfile(os.path.join(cfg.model.hf_path, "config.json")):
        raise CheckpointError(f"model.hf_path={cfg.model.hf_path} (of {cfg_path}): no config.json there; the export "
                              "takes the model's config and tokenizer from it: pass --hf DIR")
    return Source(ckpt, cfg_path, cfg)


def _load(cfg_path: str, load_resolved) -> Config:
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing; the export builds the run's model from its resolved config "
                              "(mrl train writes <run_dir>/config.yaml): pass --config PATH")
    return load_resolved(cfg_path)


def layout(a: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp)


def launch(argv: list[str]) -> int:
    """``mrl export``: check the arguments (errors in one line, exit status 1), then the ranks under torchrun."""
    from mrl.models.hf_export import PARTIAL
    from mrl.process import torchrun

    a = parser().parse_args(argv)
    try:
        src = find_source(a.checkpoint, config=a.config, hf=a.hf)
        out = os.path.abspath(a.out)
        if os.path.exists(out) and not (a.force and os.path.isdir(out)):
            raise CheckpointError(f"{out}: already exists; choose another output directory"
                                  + (" (--force replaces it)" if os.path.isdir(out) else ""))
        for what, path in (("the checkpoint it exports", src.checkpoint), ("model.hf_path", src.cfg.model.hf_path)):
            path = os.path.abspath(path)
            if out == path or out.startswith(path + os.sep) or path.startswith(out + os.sep):
                raise CheckpointError(f"{out}: is, holds or lies inside {what} ({path}); choose another directory")
        pcfg = layout(a)
    except (CheckpointError, ValueError) as e:
        print(f"[mrl] export: {e}", file=sys.stderr)
        return 1
    if a.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args = [src.checkpoint, out, "--config", src.config_path, "--hf", src.cfg.model.hf_path,
            "--tp", str(a.tp), "--pp", str(a.pp), "--ep", str(a.ep), "--shard-gb", str(a.shard_gb)]
    args += (["--etp", str(a.etp)] if a.etp else []) + (["--dtype", a.dtype] if a.dtype else [])
    args += [f for f, on in (("--force", a.force), ("--merge", a.merge)) if on]
    print(f"[mrl] exporting {src.checkpoint} to {out} (written as {out}{PARTIAL}, renamed when complete)", flush=True)
    return torchrun("mrl.jobs.export", args, pcfg.local_world_size, capture=False).returncode


def main(argv: list[str] | None = None) -> int:
    """One rank of the export."""
    import torch

    from mrl.megatron.export import export_hf_dir, load_trainer_weights, saved_padded_vocab
    from mrl.megatron.lora import apply_lora
    from mrl.megatron.model import build_gpt_model, transformer_config
    from mrl.megatron.parallel import destroy, init_parallel
    from mrl.megatron.weights import load_hf_into
    from mrl.models import get_bridge
    from mrl.models.checkpoint import HFCheckpoint

    a = parser().parse_args(argv)
    src = find_source(a.checkpoint, config=a.config, hf=a.hf)
    cfg, pcfg = src.cfg, layout(a)
    lay = init_parallel(pcfg, seed=cfg.seed)
    try:
        bridge = get_bridge(cfg.model.hf_path)
        lora = cfg.model.lora if cfg.model.lora.enabled else None
        if a.merge and lora is None:
            raise CheckpointError(f"--merge: {src.checkpoint} is of a full-parameter run (model.lora.rank=0), "
                                  "there is no adapter to merge")
        tcfg = transformer_config(bridge, pcfg, dtype=cfg.model.dtype)
        # the run's TP padded the vocabulary: its rows, whatever this layout would pad to
        vp = saved_padded_vocab(src.checkpoint) or bridge.padded_vocab(cfg.model.vocab_divisible_by, pcfg.tp)
        if vp % pcfg.tp:
            raise CheckpointError(f"--tp {pcfg.tp} does not divide the checkpoint's {vp} embedding rows")
        model = build_gpt_model(bridge, tcfg, lay, vp)
        if lora is not None:  # the checkpoint holds the adapters; the frozen base is the HF checkpoint's
            load_hf_into(model, lay, bridge, HFCheckpoint(cfg.model.hf_path), vp)
            apply_lora(model, lay, bridge, lora, seed=cfg.model.seed)
        load_trainer_weights(model, lay, src.checkpoint, lora=lora is not None, model_name=cfg.model.hf_path)
        r = export_hf_dir(model.eval(), lay, bridge, vp, a.out, hf_path=cfg.model.hf_path, lora=lora,
                          merge=a.merge, force=a.force, dtype=getattr(torch, a.dtype) if a.dtype else None,
                          max_shard_bytes=int(a.shard_gb * 1e9))
        if lay.world_rank == 0:
            what = "PEFT adapter" if lora is not None and not a.merge else "model"
            print(f"[mrl] wrote the {what} of {src.checkpoint} to {r['path']}: {r['bytes'] / 2**30:.3g} GiB in "
                  f"{r['seconds']:.3g} s", flush=True)
    except CheckpointError as e:
        if lay.world_rank == 0:
            print(f"[mrl] export: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
