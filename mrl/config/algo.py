"""The RL algorithm: advantages, loss, off-policy corrections, KL."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from mrl.config.base import fail


class AdvEstimator(str, enum.Enum):
    """How scalar rewards become per-sample advantages (``mrl.algo.advantages``)."""

    grpo = "grpo"  # (r - group mean) / (group std + adv_eps); std division optional (Dr. GRPO)
    rloo = "rloo"  # r - mean of the other samples of the group (leave-one-out)


class LossType(str, enum.Enum):
    """Importance ratio of the clipped surrogate (``mrl.algo.losses``)."""

    grpo = "grpo"  # per-token ratio pi/pi_old, PPO clip
    dapo = "dapo"  # same surrogate as grpo; DAPO is its settings: clip-higher, token_mean, dynamic sampling, overlong
    gspo = "gspo"  # per-sequence ratio exp(mean_t log(pi/pi_old)), clipped per sequence


class Aggregation(str, enum.Enum):
    """How per-token losses reduce to one scalar (``mrl.algo.aggregation``)."""

    token_mean = "token_mean"  # sum over tokens / tokens in the batch (DAPO)
    seq_mean_token_mean = "seq_mean_token_mean"  # mean over sequences of each one's token mean (GRPO)
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"  # mean over seqs of token sum / max_response_len (Dr. GRPO)


class Correction(str, enum.Enum):
    """Off-policy correction with w = pi_old / pi_behav (``mrl.algo.correction``)."""

    none = "none"
    tis = "tis"  # truncated IS: loss_t * min(w, is_cap)
    mis = "mis"  # masked IS: loss_t * w if w in [mis_low, mis_high] else 0; token or sequence level
    icepop = "icepop"  # IcePop: loss_t * w if w in [icepop_low, icepop_high] else 0; token level


class CorrectionLevel(str, enum.Enum):
    token = "token"  # one w per token
    sequence = "sequence"  # one w per sequence: geometric mean exp(mean_t log w_t)


class KLEstimator(str, enum.Enum):
    """Schulman's per-token estimators of KL(pi || pi_ref) (``mrl.algo.kl``)."""

    k1 = "k1"  # log(pi / pi_ref)
    k2 = "k2"  # 0.5 * log(pi_ref / pi)^2
    k3 = "k3"  # pi_ref / pi - 1 - log(pi_ref / pi)


@dataclass(kw_only=True)
class AlgoConfig:
    """RL algorithm: advantage estimator, policy loss, off-policy correction, KL; defaults are GRPO.

    Logprob names used below: ``logp`` = current trainer policy pi; ``old_logp`` = trainer recompute
    before this step's updates (pi_old); ``behav_logp`` = the SGLang engine's logprobs of the tokens it
    sampled (pi_behav, possibly several weight versions old and numerically different from the
    trainer). The PPO ratio is pi/pi_old; the correction weight w = pi_old/pi_behav covers staleness
    and train/inference mismatch. conf/algo/{grpo,dapo,gspo}.yaml hold the presets.
    """

    adv_estimator: AdvEstimator = AdvEstimator.grpo
    """Advantage estimator."""
    std_normalize: bool = True
    """GRPO only: divide by the group std; false = Dr. GRPO (centred rewards only)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    loss: LossType = LossType.grpo
    """Policy-loss ratio: per token (grpo, dapo) or per sequence (gspo)."""
    clip_low: float = 0.2
    """Ratio lower clip: 1 - clip_low (GRPO/DAPO 0.2; GSPO 3e-4)."""
    clip_high: float = 0.2
    """Ratio upper clip: 1 + clip_high (GRPO 0.2; DAPO clip-higher 0.28; GSPO 4e-4)."""
    dual_clip: Optional[float] = None
    """Dual-clip c > 1: for A < 0 the per-token loss is capped at -c*A; null = off."""
    aggregation: Aggregation = Aggregation.seq_mean_token_mean
    """Reduction of per-token losses (GRPO: seq_mean_token_mean; DAPO: token_mean)."""
    max_response_len: Optional[int] = None
    """L_max for seq_mean_token_sum_norm and overlong shaping; the presets set ${rollout.max_new_tokens}."""
    correction: Correction = Correction.tis
    """Off-policy correction against the engine's (behaviour) logprobs."""
    correction_level: CorrectionLevel = CorrectionLevel.token
    """Per-token or per-sequence (geometric mean) weight for tis and mis; icepop is per token."""
    is_cap: float = 2.0
    """TIS truncation C: weight = min(w, C)."""
    mis_low: float = 0.5
    """MIS band: tokens (or sequences) with w outside [mis_low, mis_high] get weight 0."""
    mis_high: float = 2.0
    icepop_low: float = 0.5
    """IcePop band [alpha, beta]: tokens with w outside it get weight 0 (zero gradient)."""
    icepop_high: float = 2.0
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term; > 0 needs the reference model's logprobs."""
    kl_estimator: KLEstimator = KLEstimator.k3
    """Per-token KL estimator for the reference term."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (zero advantage) and sample more."""
    overlong_shaping: bool = False
    """DAPO soft overlong punishment added to the reward: 0 up to max_response_len - overlong_buffer_len,
    linear to -1 at max_response_len, -1 beyond."""
    overlong_buffer_len: int = 8
    """DAPO's L_cache (the paper: 4096 of 20480)."""
    token_reward_discount: float = 0.0
    """Token-level rewards (a teacher's per-token reverse KL, process rewards; ``scoring:``) add to each token's
    advantage their discounted sum from that token on (``mrl.algo.token_advantages``): 0 = the token's own
    reward (on-policy distillation), 1 = the reward-to-go (process rewards)."""
    lr: float = 1e-5
    """Adam learning rate of the trainer."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_low < 1.0:
            fail("algo.clip_low", f"must be in (0, 1), got {self.clip_low}")
        if self.clip_high <= 0.0:
            fail("algo.clip_high", f"must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            fail("algo.dual_clip", f"must be > 1 or null, got {self.dual_clip}")
        if self.adv_eps < 0.0:
            fail("algo.adv_eps", f"must be >= 0, got {self.adv_eps}")
        if self.max_response_len is not None and self.max_response_len < 1:
            fail("algo.max_response_len", f"must be >= 1 or null, got {self.max_response_len}")
        if self.is_cap <= 0.0:
            fail("algo.is_cap", f"must be > 0, got {self.is_cap}")
        for name in ("mis", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0.0 <= low <= 1.0 <= high:
                fail(f"algo.{name}_low/{name}_high", f"must satisfy 0 <= low <= 1 <= high, got [{low}, {high}]")
        if self.correction is Correction.icepop and self.correction_level is CorrectionLevel.sequence:
            fail("algo.correction_level", "icepop is per token; use correction=mis for a per-sequence mask")
        if self.kl_coef < 0.0:
            fail("algo.kl_coef", f"must be >= 0, got {self.kl_coef}")
        if self.aggregation is Aggregation.seq_mean_token_sum_norm and self.max_response_len is None:
            fail("algo.max_response_len", "must be set for aggregation=seq_mean_token_sum_norm")
        if self.overlong_shaping:
            if self.max_response_len is None:
                fail("algo.max_response_len", "must be set for overlong_shaping")
            if not 0 < self.overlong_buffer_len <= self.max_response_len:
                fail(
                    "algo.overlong_buffer_len",
                    f"must be in [1, max_response_len={self.max_response_len}], got {self.overlong_buffer_len}",
                )
        if not 0.0 <= self.token_reward_discount <= 1.0:
            fail("algo.token_reward_discount", f"must be in [0, 1], got {self.token_reward_discount}")
        if self.lr <= 0.0:
            fail("algo.lr", f"must be > 0, got {self.lr}")
