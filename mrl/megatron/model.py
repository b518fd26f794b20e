"""Build megatron-core's GPTModel for an HF architecture (through its bridge) in a given layout.

Spec choice: megatron's Transformer Engine spec when TE imports, its local spec otherwise. The local
spec's only norm without apex/TE (``WrappedTorchNorm``) asserts ``not sequence_parallel``
(``transformer/torch_norm.py:50``), while MoE training with TP>1 requires SP
(``transformer/moe/moe_layer.py:629``); ``SPTorchNorm`` is a plain torch norm whose params carry the
``sequence_parallel`` tag (as apex/TE norms do) so ``finalize_model_grads`` all-reduces their grads
over TP. It is plugged in through the spec, not by patching megatron.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import torch

from mrl._compat.te import HAVE_TE
from mrl.config.schema import DType, GroupedGemm, ParallelConfig, Recompute
from mrl.megatron import compat
from mrl.megatron.context_parallel import check_runnable
from mrl.megatron.parallel import Layout
from mrl.models.bridge import ModelBridge
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


class SPTorchNorm:
    """``torch.nn.RMSNorm``/``LayerNorm`` usable with sequence parallelism in the local spec."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        m = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for p in m.parameters():
            p.sequence_parallel = config.sequence_parallel
        return m


class QKTorchNorm:
    """Per-head q/k norm for the local spec under SP. No ``sequence_parallel`` tag: megatron already
    all-reduces q/k-norm grads over TP by name (``distributed/finalize_model_grads.py:452``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        return norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)


class MLALocalAttention(DotProductAttention):
    """megatron's local (non-TE) core attention for multi-latent attention: MLA passes the query/key and
    value head dims (``k_channels``, ``v_channels``), which only TE's attention takes. The local kernel
    needs neither: its scale comes as ``softmax_scale`` and its output width is ``kv_channels`` per head,
    which the bridge sets to ``v_head_dim``."""

    def __init__(self, config: TransformerConfig, *args, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA: kv_channels={config.kv_channels} must equal v_head_dim={v_channels}")
        super().__init__(config, *args, **kwargs)


# All fusions off on CPU: they are CUDA kernels, or TE-only. megatron's router fusion stays off everywhere:
# it would silently skip routing replay (megatron-core: moe_router_fusion returns before the replay hook);
# train.fused_router_replay puts TE's fused router kernels in the replay path itself (layer_spec).
_CPU_SAFE = dict(
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    cross_entropy_loss_fusion=False,
    moe_router_fusion=False,
    moe_permute_fusion=False,
)


def fusions(*, cuda: bool, te: bool) -> dict[str, bool]:
    """Megatron's fused kernels this machine can run. On GPUs with TE: the fused rope, SwiGLU, residual
    add and TE's fused MoE permute. Weight-gradient accumulation fusion needs apex's CUDA extension for
    the output layer (megatron raises without it), so it follows that extension's presence."""
    kw = dict(_CPU_SAFE)
    if cuda and te:
        kw.update(apply_rope_fusion=True, bias_activation_fusion=True, bias_dropout_fusion=True,
                  masked_softmax_fusion=True, moe_permute_fusion=True,
                  gradient_accumulation_fusion=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)
    return kw


def residual_add_fusion(kw: dict) -> bool:
    """Whether megatron's fused bias-dropout-add has anything to fuse for a config's keyword arguments
    (megatron's defaults where absent). Without a bias and without dropout it is one add, compiled by
    torch.compile for every new sequence length and stride until dynamo's recompile limit, after which it
    runs eagerly anyway: RL batches change length every step, so on a node without a warm inductor cache
    the fused version costs the first steps that compile time and buys nothing."""
    return bool(kw.get("add_bias_linear", True) or kw.get("hidden_dropout", 0.1))


def use_grouped_gemm(kind: GroupedGemm) -> None:
    """Pick TE's grouped-GEMM kernel for this process. TE reads the variable at every grouped GEMM, so
    setting it before the first forward is enough; the config decides, whatever the environment held."""
    os.environ.pop("NVTE_USE_CUTLASS_GROUPED_GEMM", None)
    if kind == GroupedGemm.cutlass:
        os.environ["NVTE_USE_CUTLASS_GROUPED_GEMM"] = "1"


LOCAL_SPEC_ON_GPU = (
    "Transformer Engine is not installed: the trainer runs megatron-core's local spec on GPUs, which is slower "
    "than the TE spec (docs/gpu.md) and runs out of memory where TE fits (it materialises the attention scores); "
    "install it (pip install -e '.[gpu]' in the repository) or use the image in docker/")


def recompute_kwargs(kind: Recompute) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``train.recompute``: full recompute one layer at a time (each layer keeps
    its input only), or megatron's selective recompute (its default modules: the core attention)."""
    if kind == Recompute.full:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if kind == Recompute.selective:
        return dict(recompute_granularity="selective")
    return {}


def transformer_config(bridge: ModelBridge, parallel: ParallelConfig, *, dtype: DType = DType.fp32,
                       recompute: Recompute = Recompute.off, device_init: bool = False,
                       **overrides: Any) -> TransformerConfig:
    """``recompute``: ``train.recompute``; ``device_init``: megatron allocates the parameters on the GPU
    (without CUDA: ignored), not in host memory first (a model of tens of GB would pass through the host)."""
    check_runnable(parallel)  # context_parallel_size > 1 only where TE's CP attention runs
    parallel.check_model(num_experts=bridge.num_experts, num_layers=bridge.num_layers,
                         num_query_groups=bridge.num_query_groups)
    torch_dtype = torch.bfloat16 if dtype == DType.bf16 else torch.float32
    kw = dict(bridge.transformer_config_kwargs())
    kw.update(fusions(cuda=compat.HAS_CUDA, te=HAVE_TE))
    kw["bias_dropout_fusion"] = kw["bias_dropout_fusion"] and residual_add_fusion(kw)
    kw.update(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        num_layers_in_first_pipeline_stage=parallel.pp_first_layers,
        num_layers_in_last_pipeline_stage=parallel.pp_last_layers,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
        moe_token_dispatcher_type=parallel.dispatcher.value,
        moe_grouped_gemm=HAVE_TE,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=True,  # Keep Routing; inactive until an action is set
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=dtype == DType.bf16,
        use_cpu_initialization=not (device_init and compat.HAS_CUDA),
        perform_initialization=False,  # weights come from the HF checkpoint
    )
    kw.update(recompute_kwargs(recompute))
    kw.update(overrides)
    # multi-latent attention (DeepSeek-V3) has its own config class (latent ranks, head dims, yarn)
    return (MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig)(**kw)


def layer_spec(cfg: TransformerConfig, *, fused_router_replay: bool = False):
    """megatron's decoder block spec for this machine; ``fused_router_replay``: the MoE layers' routers
    replay through TE's fused kernels (``mrl.routing.fused_replay``)."""
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=HAVE_TE, normalization="RMSNorm")
    if fused_router_replay:
        from mrl.routing.fused_replay import with_fused_replay_router

        spec = with_fused_replay_router(spec)
    if HAVE_TE:
        return spec
    # local spec: swap every torch norm for the SP-capable one (layer norms and the final norm)
    layers = []
    for ls in spec.layer_specs:
        attn = ls.submodules.self_attention
        attn_sub = attn.submodules
        if cfg.multi_latent_attention:
            # MLA's q/kv norms act on the latents, which sequence parallelism splits like the hidden
            # states: their grads are all-reduced over TP as the layer norms' are
            attn_sub = dataclasses.replace(attn_sub, q_layernorm=SPTorchNorm, kv_layernorm=SPTorchNorm,
                                           core_attention=MLALocalAttention)
        elif cfg.qk_layernorm:
            attn_sub = dataclasses.replace(attn_sub, q_layernorm=QKTorchNorm, k_layernorm=QKTorchNorm)
        sub = dataclasses.replace(ls.submodules, input_layernorm=SPTorchNorm, pre_mlp_layernorm=SPTorchNorm,
                                  self_attention=dataclasses.replace(attn, submodules=attn_sub))
        layers.append(dataclasses.replace(ls, submodules=sub))
    return dataclasses.replace(spec, layer_specs=layers, layer_norm=SPTorchNorm)


def build_gpt_model(bridge: ModelBridge, cfg: TransformerConfig, layout: Layout, padded_vocab: int, *,
                    fused_router_replay: bool = False) -> GPTModel:
    # RouterReplay instances are process-global in megatron: drop those of any earlier model
    RouterReplay.clear_global_router_replay_instances()
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec(cfg, fused_router_replay=fused_router_replay),
        pre_process=layout.is_first_stage,
        post_process=layout.is_last_stage,
        parallel_output=True,
        **bridge.gpt_model_kwargs(padded_vocab),
    )
    if fused_router_replay:
        from mrl.routing.fused_replay import FusedReplayRouter
        from mrl.routing.replay import ReplayError
        from megatron.core.transformer.moe.router import TopKRouter

        plain = [n for n, m in model.named_modules()
                 if isinstance(m, TopKRouter) and not isinstance(m, FusedReplayRouter)]
        if plain:  # a spec of another form would leave the option silently without effect
            raise ReplayError(f"train.fused_router_replay: megatron's spec built plain routers ({plain[0]}, ...)")
    return model.to(compat.DEVICE)
