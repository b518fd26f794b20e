"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``) <-> megatron-core GPTModel.

What differs from Qwen3-MoE (whose bridge this extends) and how megatron expresses it:
- router: sigmoid scores; ``e_score_correction_bias`` is added for the *selection* only, the gate
  weights are the plain sigmoid scores of the chosen experts, renormalised, times
  ``routed_scaling_factor`` -> ``moe_router_score_function="sigmoid"``,
  ``moe_router_enable_expert_bias`` (megatron's ``expert_bias`` buffer plays the same role, also only in
  the selection), ``moe_router_topk_scaling_factor``; group-limited top-k with ``n_group`` /
  ``topk_group`` -> ``moe_router_num_groups`` / ``moe_router_group_topk``;
- shared experts (``mlp.shared_experts``, no gate) -> ``moe_shared_expert_intermediate_size``;
- the first ``first_k_dense_replace`` layers are dense -> ``moe_layer_freq`` as a list;
- partial rotary (rotate-half on the first ``partial_rotary_factor`` of each head) -> ``rotary_percent``;
- q/k/v biases -> ``add_qkv_bias`` (interleaved by KV group like the weights); optional q/k norm.

The expert bias is a buffer in both models. megatron would update it every step from the token
counts (``moe_router_bias_update_rate``, a pre-training load balancer); in RL post-training the engine
must route with the same bias the checkpoint has, so the rate is 0 and the bias stays as loaded.
"""

from __future__ import annotations

from typing import Any

from mrl.models.bridge import ParamMap, UnsupportedModelError, copy
from mrl.models.qwen3_moe import Qwen3MoeBridge


class Glm4MoeBridge(Qwen3MoeBridge):
    architectures = ("Glm4MoeForCausalLM",)
    family = "GLM-4.5 (Glm4MoeForCausalLM)"

    # -- config ---------------------------------------------------------------------------------
    def config_problems(self) -> list[str]:
        """Every config value the mapping does not cover, each naming its field."""
        c = self.hf_config
        problems = []
        if getattr(c, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={c.hidden_act!r} (only 'silu' is mapped)")
        return problems + self.attention_problems() + self.router_problems()

    def attention_problems(self) -> list[str]:
        rope_type = self._rope().get("rope_type", "default")
        if rope_type != "default":
            return [f"rope_scaling type {rope_type!r} (only 'default' rope is mapped for this family)"]
        return []

    def router_problems(self) -> list[str]:
        c = self.hf_config
        E, k = self.num_experts, int(c.num_experts_per_tok)
        n_group, topk_group = int(getattr(c, "n_group", 1) or 1), int(getattr(c, "topk_group", 1) or 1)
        problems = []
        if E % n_group:
            problems.append(f"n_group={n_group} does not divide n_routed_experts={E}")
        elif topk_group > n_group:
            problems.append(f"topk_group={topk_group} > n_group={n_group}")
        elif n_group > 1 and (k % topk_group or k // topk_group != 2):
            # HF scores a group by the sum of its top-2 experts, megatron by its top-(k / topk_group)
            problems.append(f"topk_group={topk_group} with num_experts_per_tok={k}: group scores are the "
                            "top-2 sum, which megatron computes only when num_experts_per_tok == 2 * topk_group")
        if k > 1 and not getattr(c, "norm_topk_prob", True):
            problems.append("norm_topk_prob=false with num_experts_per_tok > 1 (megatron's sigmoid router "
                            "always renormalises the top-k weights)")
        if k == 1 and getattr(c, "norm_topk_prob", True):
            problems.append("norm_topk_prob=true with num_experts_per_tok=1 (megatron does not renormalise one weight)")
        first = int(getattr(c, "first_k_dense_replace", 0) or 0)
        if not 0 <= first <= self.num_layers:
            problems.append(f"first_k_dense_replace={first} outside 0..num_hidden_layers={self.num_layers}")
        return problems

    def validate(self) -> None:
        problems = self.config_problems()
        if problems:
            raise UnsupportedModelError(f"{self.path or self.family}: unsupported settings: " + "; ".join(problems))

    @property
    def num_experts(self) -> int:
        return int(self.hf_config.n_routed_experts)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // self.num_heads)

    @property
    def qk_norm(self) -> bool:
        return bool(getattr(self.hf_config, "use_qk_norm", False))

    @property
    def qkv_bias(self) -> bool:
        return bool(getattr(self.hf_config, "attention_bias", False))

    @property
    def shared_intermediate(self) -> int:
        c = self.hf_config
        return int(getattr(c, "n_shared_experts", 0) or 0) * int(c.moe_intermediate_size)

    def moe_layer_pattern(self) -> list[int]:
        """Layers ``< first_k_dense_replace`` are dense, the rest MoE."""
        first = int(getattr(self.hf_config, "first_k_dense_replace", 0) or 0)
        return [int(i >= first) for i in range(self.num_layers)]

    def router_kwargs(self) -> dict[str, Any]:
        c = self.hf_config
        n_group = int(getattr(c, "n_group", 1) or 1)
        return dict(
            moe_router_topk=int(c.num_experts_per_tok),
            moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False,
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # the bias stays the checkpoint's (module docstring)
            moe_router_topk_scaling_factor=float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
            moe_router_num_groups=n_group if n_group > 1 else None,
            moe_router_group_topk=int(c.topk_group) if n_group > 1 else None,
            moe_router_dtype="fp32",
            moe_shared_expert_intermediate_size=self.shared_intermediate or None,
        )

    def transformer_config_kwargs(self) -> dict[str, Any]:
        kw = super().transformer_config_kwargs()
        kw.update(self.router_kwargs())
        kw.update(qk_layernorm=self.qk_norm, add_qkv_bias=self.qkv_bias)
        return kw

    def gpt_model_kwargs(self, padded_vocab: int) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(padded_vocab)
        kw["rotary_percent"] = float(self._rope().get("partial_rotary_factor",
                                                      getattr(self.hf_config, "partial_rotary_factor", 1.0)))
        return kw

    # -- parameters -----------------------------------------------------------------------------
    def attention_maps(self, h: str, m: str) -> list[ParamMap]:
        H, nq, d = self.hf_config.hidden_size, self.num_heads, self.head_dim
        maps = [ParamMap(m + "self_attention.linear_qkv.weight", (self.qkv_parts(h, "weight"),), H)]
        if self.qkv_bias:
            maps.append(ParamMap(m + "self_attention.linear_qkv.bias", (self.qkv_parts(h, "bias"),), None))
        if self.qk_norm:
            maps += [copy(m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight", (d,)),
                     copy(m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight", (d,))]
        maps.append(copy(m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight", (H, nq * d)))
        return maps

    def moe_maps(self, h: str, m: str) -> list[ParamMap]:
        maps = super().moe_maps(h, m)
        maps.insert(1, copy(m + "mlp.router.expert_bias", h + "mlp.gate.e_score_correction_bias", (self.num_experts,)))
        if self.shared_intermediate:
            maps += self.dense_mlp_maps(h, m, hf="mlp.shared_experts.", mc="mlp.shared_experts.",
                                        inter=self.shared_intermediate)
        return maps
