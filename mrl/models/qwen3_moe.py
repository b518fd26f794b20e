"""Qwen3-MoE (``Qwen3MoeForCausalLM``) <-> megatron-core GPTModel, local or Transformer Engine spec.

Verified mapping (docs: ``qwen3_moe_bridge.md`` in the design notes): q/k/v interleaved by KV group into
``linear_qkv``; ``[gate; up]`` -> ``linear_fc1``; per-expert HF names; q/k norms per head; vocab rows
zero-padded. Pitfalls it guards: ``head_dim`` must set ``kv_channels``; rope theta is a GPTModel
argument; ``norm_topk_prob`` is the *inverse* of ``moe_router_pre_softmax``; the dense/MoE pattern is
passed as a list (megatron's integer ``moe_layer_freq`` is off by one against ``decoder_sparse_step``).
"""

from __future__ import annotations

from typing import Any

from mrl.models.bridge import ModelBridge, ParamMap, Part, UnsupportedModelError, concat, copy, padded_rows


class Qwen3MoeBridge(ModelBridge):
    architectures = ("Qwen3MoeForCausalLM",)

    # -- config ---------------------------------------------------------------------------------
    def validate(self) -> None:
        c = self.hf_config
        problems = []
        if getattr(c, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={c.hidden_act!r} (only 'silu' is mapped)")
        if getattr(c, "attention_bias", False):
            problems.append("attention_bias=true (not mapped)")
        if getattr(c, "use_sliding_window", False):
            problems.append("use_sliding_window=true (not mapped)")
        rope_type = self._rope().get("rope_type", "default")
        if rope_type != "default":
            problems.append(f"rope_type={rope_type!r} (only 'default' rope is mapped)")
        if problems:
            raise UnsupportedModelError(f"{self.path or 'Qwen3-MoE config'}: unsupported settings: "
                                        + "; ".join(problems))

    def _rope(self) -> dict:
        c = self.hf_config
        rp = getattr(c, "rope_parameters", None) or {}
        rs = getattr(c, "rope_scaling", None) or {}
        out = dict(rs)
        out.update(rp)
        if "rope_type" not in out and "type" in out:
            out["rope_type"] = out["type"]
        if "rope_theta" not in out:
            out["rope_theta"] = getattr(c, "rope_theta", 10000.0)
        return out

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_experts(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts"))

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_query_groups(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // self.num_heads)

    def moe_layer_pattern(self) -> list[int]:
        """HF: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
        c = self.hf_config
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(c, "mlp_only_layers", None) or [])
        return [int(i not in dense and self.num_experts > 0 and (i + 1) % step == 0) for i in range(self.num_layers)]

    def transformer_config_kwargs(self) -> dict[str, Any]:
        import torch.nn.functional as F  # here, not at import: the preflight uses the bridge without torch

        c = self.hf_config
        return dict(
            num_layers=self.num_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,  # used by dense (mlp_only) layers only
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,  # default would be hidden/heads: wrong for Qwen3
            qk_layernorm=True,
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_router_topk=c.num_experts_per_tok,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(getattr(c, "norm_topk_prob", False)),
            moe_router_dtype="fp32",
            moe_layer_freq=self.moe_layer_pattern(),
            moe_shared_expert_intermediate_size=None,
            moe_expert_capacity_factor=None,
        )

    def gpt_model_kwargs(self, padded_vocab: int) -> dict[str, Any]:
        return dict(
            vocab_size=padded_vocab,
            max_sequence_length=int(self.hf_config.max_position_embeddings),
            position_embedding_type="rope",
            rotary_base=float(self._rope()["rope_theta"]),
            rotary_percent=1.0,
            share_embeddings_and_output_weights=self.tied_embeddings,
        )

    # -- parameters -----------------------------------------------------------------------------
    def param_maps(self, padded_vocab: int) -> list[ParamMap]:
        maps = self.embedding_maps(padded_vocab)
        for i, sparse in enumerate(self.moe_layer_pattern()):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            maps += [copy(m + "input_layernorm.weight", h + "input_layernorm.weight", (self.hf_config.hidden_size,))]
            maps += self.attention_maps(h, m)
            maps += [copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight",
                          (self.hf_config.hidden_size,))]
            maps += self.moe_maps(h, m) if sparse else self.dense_mlp_maps(h, m)
        return maps

    def embedding_maps(self, padded_vocab: int) -> list[ParamMap]:
        H, V = self.hf_config.hidden_size, self.vocab_size
        maps = [
            padded_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", V, padded_vocab, H),
            copy("decoder.final_layernorm.weight", "model.norm.weight", (H,)),
        ]
        if not self.tied_embeddings:
            maps.append(padded_rows("output_layer.weight", "lm_head.weight", V, padded_vocab, H))
        return maps

    def qkv_parts(self, h: str, what: str) -> tuple[Part, ...]:
        """Rows of ``linear_qkv.<what>`` (weight or bias): per KV group, its q heads, then k_g, then v_g."""
        nq, ng, d = self.num_heads, self.num_query_groups, self.head_dim
        qpg = nq // ng
        parts = []
        for g in range(ng):
            parts += [Part(h + f"self_attn.q_proj.{what}", g * qpg * d, (g + 1) * qpg * d),
                      Part(h + f"self_attn.k_proj.{what}", g * d, (g + 1) * d),
                      Part(h + f"self_attn.v_proj.{what}", g * d, (g + 1) * d)]
        return tuple(parts)

    def attention_maps(self, h: str, m: str) -> list[ParamMap]:
        H, nq, d = self.hf_config.hidden_size, self.num_heads, self.head_dim
        return [
            ParamMap(m + "self_attention.linear_qkv.weight", (self.qkv_parts(h, "weight"),), H),
            copy(m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight", (d,)),
            copy(m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight", (d,)),
            copy(m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight", (H, nq * d)),
        ]

    def moe_maps(self, h: str, m: str) -> list[ParamMap]:
        H, inter = self.hf_config.hidden_size, self.hf_config.moe_intermediate_size
        maps = [copy(m + "mlp.router.weight", h + "mlp.gate.weight", (self.num_experts, H))]
        for e in range(self.num_experts):
            he, me = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            maps.append(concat(me + "linear_fc1.weight",
                               [(he + "gate_proj.weight", inter), (he + "up_proj.weight", inter)], H))
            maps.append(copy(me + "linear_fc2.weight", he + "down_proj.weight", (H, inter)))
        return maps

    def dense_mlp_maps(self, h: str, m: str, hf: str = "mlp.", mc: str = "mlp.",
                       inter: int | None = None) -> list[ParamMap]:
        """SwiGLU MLP ``h + hf`` (gate/up/down) -> ``m + mc`` (linear_fc1 = [gate; up], linear_fc2)."""
        H = self.hf_config.hidden_size
        inter = self.hf_config.intermediate_size if inter is None else inter
        return [concat(m + mc + "linear_fc1.weight",
                       [(h + hf + "gate_proj.weight", inter), (h + hf + "up_proj.weight", inter)], H),
                copy(m + mc + "linear_fc2.weight", h + hf + "down_proj.weight", (H, inter))]
