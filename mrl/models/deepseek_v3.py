"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``) <-> megatron-core GPTModel with MLA.

The MoE side is GLM-4.5's (whose bridge this extends): sigmoid router with ``e_score_correction_bias``
for the selection only, ``routed_scaling_factor``, group-limited top-k (``n_group`` / ``topk_group``
-> ``moe_router_num_groups`` / ``moe_router_group_topk``), one shared expert, first dense layers.
Attention is multi-latent (megatron's ``MLATransformerConfig``, ``multi_latent_attention``):

- ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` -> ``linear_q_down_proj`` / ``q_layernorm`` /
  ``linear_q_up_proj`` (``q_lora_rank`` null: ``q_proj`` -> ``linear_q_proj``);
- ``kv_a_proj_with_mqa`` [kv_lora + rope, H] -> ``linear_kv_down_proj`` (same rows: latent, then the
  shared rope key); ``kv_a_layernorm`` -> ``kv_layernorm``; ``kv_b_proj`` [heads * (nope + v), kv_lora]
  -> ``linear_kv_up_proj`` (per head [nope; v] in both);
- ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim`` -> ``qk_head_dim`` (megatron's is the
  no-rope part) / ``qk_pos_emb_head_dim`` / ``v_head_dim``.

All copies: the rope part of DeepSeek checkpoints is stored interleaved (``rope_interleave``:
transformers de-interleaves q/k at run time), and megatron's MLA rope de-interleaves the same way
(``rope_utils._apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``). YaRN maps field by field
onto megatron's ``YarnRotaryEmbedding``; the attention factor and the softmax scale follow transformers'
rule (``mscale`` counts only together with ``mscale_all_dim``). MTP layers (``num_nextn_predict_layers``,
stored as layers >= ``num_hidden_layers``) are not part of the model: their tensors are skipped on
import, with a log line.
"""

from __future__ import annotations

import re
from typing import Any

from mrl.models.bridge import ParamMap, copy
from mrl.models.glm4_moe import Glm4MoeBridge

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3Bridge(Glm4MoeBridge):
    architectures = ("DeepseekV3ForCausalLM",)
    family = "DeepSeek-V3 (DeepseekV3ForCausalLM)"

    # -- config ---------------------------------------------------------------------------------
    def attention_problems(self) -> list[str]:
        c = self.hf_config
        problems = []
        if getattr(c, "attention_bias", False):
            problems.append("attention_bias=true (DeepSeek-V3 has no attention biases; not mapped)")
        if not getattr(c, "rope_interleave", True):
            problems.append("rope_interleave=false (megatron's MLA rope always de-interleaves the rope dims)")
        rope = self._rope()
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            problems.append(f"rope_scaling type {rope_type!r} (mapped: 'default', 'yarn')")
        if rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if not rope.get(key):
                    problems.append(f"rope_scaling.{key} missing (yarn needs it)")
            if rope.get("attention_factor") is not None:
                problems.append("rope_scaling.attention_factor (an explicit yarn attention factor is not mapped)")
            if rope.get("truncate", True) is not True:
                problems.append("rope_scaling.truncate=false (megatron rounds the yarn correction range)")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(c, key, None):
                problems.append(f"{key} missing or 0 (multi-latent attention needs it)")
        if getattr(c, "qk_rope_head_dim", 0) and c.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={c.qk_rope_head_dim} is odd (rope rotates pairs)")
        return problems

    def router_problems(self) -> list[str]:
        c = self.hf_config
        problems = []
        # DeepSeek-V2-style routers (softmax, "greedy" / "group_limited_greedy") are another model
        if getattr(c, "scoring_func", "sigmoid") != "sigmoid":
            problems.append(f"scoring_func={c.scoring_func!r} (mapped: 'sigmoid')")
        if getattr(c, "topk_method", "noaux_tc") != "noaux_tc":
            problems.append(f"topk_method={c.topk_method!r} (mapped: 'noaux_tc')")
        return problems + super().router_problems()

    def engine_config(self) -> dict[str, Any]:
        """config.json keys SGLang reads that transformers' DeepseekV3Config does not keep: every layer from
        ``first_k_dense_replace`` on is MoE, routing is sigmoid + bias ("noaux_tc")."""
        return {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

    @property
    def num_query_groups(self) -> int:
        return self.num_heads  # MLA: every head has its own key and value

    @property
    def q_lora_rank(self) -> int | None:
        return getattr(self.hf_config, "q_lora_rank", None) or None

    def transformer_config_kwargs(self) -> dict[str, Any]:
        c = self.hf_config
        kw = super().transformer_config_kwargs()
        rope = self._rope()
        yarn = rope.get("rope_type", "default") == "yarn"
        # transformers: the attention factor uses mscale only with mscale_all_dim (else mscale = 1)
        both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
        kw.update(
            multi_latent_attention=True,
            num_query_groups=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=int(c.kv_lora_rank),
            qk_head_dim=int(c.qk_nope_head_dim),
            qk_pos_emb_head_dim=int(c.qk_rope_head_dim),
            v_head_dim=int(c.v_head_dim),
            kv_channels=int(c.v_head_dim),  # the local core attention's output width per head
            qk_layernorm=True,  # megatron builds the q/kv latent norms only with it
            add_qkv_bias=False,
            rope_type="yarn" if yarn else "rope",
            rotary_base=float(rope["rope_theta"]),
            rotary_percent=1.0,
            rotary_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings") or
                                                 c.max_position_embeddings),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope["mscale"]) if yarn and both else 1.0,
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0) if yarn else 0.0,
        )
        return kw

    def gpt_model_kwargs(self, padded_vocab: int) -> dict[str, Any]:
        kw = super().gpt_model_kwargs(padded_vocab)
        kw["rotary_percent"] = 1.0  # MLA builds its own rope from the config (GPTModel's is unused)
        return kw

    # -- parameters -----------------------------------------------------------------------------
    def attention_maps(self, h: str, m: str) -> list[ParamMap]:
        c = self.hf_config
        H, nh = c.hidden_size, self.num_heads
        nope, rope, v, kv = int(c.qk_nope_head_dim), int(c.qk_rope_head_dim), int(c.v_head_dim), int(c.kv_lora_rank)
        a, s = h + "self_attn.", m + "self_attention."
        q = self.q_lora_rank
        if q is None:
            maps = [copy(s + "linear_q_proj.weight", a + "q_proj.weight", (nh * (nope + rope), H))]
        else:
            maps = [copy(s + "linear_q_down_proj.weight", a + "q_a_proj.weight", (q, H)),
                    copy(s + "q_layernorm.weight", a + "q_a_layernorm.weight", (q,)),
                    copy(s + "linear_q_up_proj.weight", a + "q_b_proj.weight", (nh * (nope + rope), q))]
        return maps + [
            copy(s + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight", (kv + rope, H)),
            copy(s + "kv_layernorm.weight", a + "kv_a_layernorm.weight", (kv,)),
            copy(s + "linear_kv_up_proj.weight", a + "kv_b_proj.weight", (nh * (nope + v), kv)),
            copy(s + "linear_proj.weight", a + "o_proj.weight", (H, nh * v)),
        ]

    def skipped_hf_tensors(self, names) -> list[str]:
        """MTP layers: stored as ``model.layers.<i>`` with i >= num_hidden_layers."""
        return sorted(n for n in names if (mt := _LAYER.match(n)) and int(mt.group(1)) >= self.num_layers)
