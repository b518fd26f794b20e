"""What every torchrun job shares: layout flags, and the HF checkpoint loaded into megatron."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from mrl.config.schema import Dispatcher, DType, ParallelConfig
from mrl.megatron import compat
from mrl.megatron.model import build_gpt_model, transformer_config
from mrl.megatron.parallel import Layout, init_parallel
from mrl.megatron.weights import load_hf_into
from mrl.models import ModelBridge, get_bridge
from mrl.models.checkpoint import HFCheckpoint
from mrl.models.synthetic import SyntheticWeights
from megatron.core.transformer.transformer_config import TransformerConfig


def add_layout_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hf", required=True, help="HF checkpoint directory")
    for k in ("tp", "pp", "ep"):
        ap.add_argument(f"--{k}", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--pp-first", type=int, default=None, help="uneven PP: layers on the first stage")
    ap.add_argument("--pp-last", type=int, default=None, help="uneven PP: layers on the last stage")
    ap.add_argument("--dispatcher", default="alltoall", choices=[d.value for d in Dispatcher])
    ap.add_argument("--dtype", default="fp32", choices=[d.value for d in DType])
    ap.add_argument("--synthetic-seed", type=int, default=None,
                    help="weights drawn from this seed (mrl.models.synthetic), not read: --hf needs config.json only")


@dataclass
class Loaded:
    layout: Layout
    bridge: ModelBridge
    cfg: TransformerConfig
    padded_vocab: int
    model: torch.nn.Module
    ckpt: HFCheckpoint | SyntheticWeights
    params_loaded: int


def load_model(a: argparse.Namespace, **cfg_overrides) -> Loaded:
    """Init the layout, build megatron's GPTModel for ``a.hf`` and read this rank's slices into it."""
    pcfg = ParallelConfig(tp=a.tp, pp=a.pp, ep=a.ep, etp=a.etp, dispatcher=Dispatcher(a.dispatcher),
                          pp_first_layers=a.pp_first, pp_last_layers=a.pp_last)
    layout = init_parallel(pcfg)
    bridge = get_bridge(a.hf)
    cfg = transformer_config(bridge, pcfg, dtype=DType(a.dtype), **cfg_overrides)
    vp = bridge.padded_vocab(128, pcfg.tp)
    model = build_gpt_model(bridge, cfg, layout, vp)
    seed = getattr(a, "synthetic_seed", None)
    # drawn where the engine's pusher draws them: CUDA and CPU generators give different numbers
    ckpt = HFCheckpoint(a.hf) if seed is None else SyntheticWeights(
        a.hf, seed=seed, bridge=bridge, device="cuda" if compat.HAS_CUDA else "cpu")
    n = load_hf_into(model, layout, bridge, ckpt, vp)
    return Loaded(layout, bridge, cfg, vp, model, ckpt, n)
