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
    tis = "tis"  # truncated IS: loss_t * min(w, is_cap); w per correction_level
    mis = "mis"  # masked IS (Liu et al. 2025): sequence w; w > mis_high rejects the sequence (out of the normalizer)
    icepop = "icepop"  # IcePop: loss_t * w if w in [icepop_low, icepop_high] else 0; token level


class CorrectionLevel(str, enum.Enum):
    """Which w the correction weighs: one per token, or one per sequence from its tokens' ratios."""

    token = "token"  # w_t = pi_old(y_t) / pi_behav(y_t)
    sequence_product = "sequence_product"  # prod_t w_t = pi_old(y) / pi_behav(y): the unbiased sequence weight
    sequence_geomean = "sequence_geomean"  # exp(mean_t log w_t): length-normalised (GSPO's form), biased


class OldLogprobs(str, enum.Enum):
    """Where pi_old, the policy the PPO ratio pi / pi_old is taken against, comes from."""

    recompute = "recompute"  # the trainer's forward before the batch's first optimizer step (decoupled PPO)
    engine = "engine"  # the engine's logprobs (pi_old = pi_behav: PPO against the sampling policy)


class KLEstimator(str, enum.Enum):
    """Schulman's per-token estimators of KL(pi || pi_ref) (``mrl.algo.kl``)."""

    k1 = "k1"  # log(pi / pi_ref)
    k2 = "k2"  # 0.5 * log(pi_ref / pi)^2
    k3 = "k3"  # pi_ref / pi - 1 - log(pi_ref / pi)


@dataclass(kw_only=True)
class AlgoConfig:
    """RL algorithm: advantage estimator, policy loss, off-policy correction, KL; defaults are GRPO.

    Logprob names used below: ``logp`` = current trainer policy pi; ``old_logp`` = pi_old, the trainer's
    forward before the rollout batch's first optimizer step (``old_logprobs=recompute``) or the engine's
    (``engine``); ``behav_logp`` = the SGLang engine's logprobs of the tokens it sampled (pi_behav,
    possibly several weight versions old and numerically different from the trainer). The PPO ratio is
    pi/pi_old; the correction weight w = pi_old/pi_behav covers staleness and train/inference mismatch
    (decoupled PPO). A rollout batch feeds ``mini_batches * ppo_epochs`` optimizer steps.
    conf/algo/{grpo,dapo,gspo}.yaml hold the presets.
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
    mini_batches: int = 1
    """Optimizer steps per pass over a rollout batch: the batch splits into this many mini-batches (each DP
    rank's share into equal consecutive parts). verl: train_batch_size / ppo_mini_batch_size; slime:
    rollout_batch_size * n_samples_per_prompt / global_batch_size; AReaL: ppo_n_minibatches."""
    ppo_epochs: int = 1
    """Passes over the rollout batch (verl's ppo_epochs); optimizer steps per batch: mini_batches * ppo_epochs."""
    old_logprobs: OldLogprobs = OldLogprobs.recompute
    """pi_old of the PPO ratio: ``recompute`` (one forward of the batch before its first optimizer step; the
    correction then weighs pi_old / pi_behav: AReaL's decoupled PPO) or ``engine`` (pi_old = pi_behav; no
    correction to make, ``correction`` must be none)."""
    old_logprob_micro_batch_size: Optional[int] = None
    """Samples per micro-batch per DP rank (packed: rows) of the pi_old pass (``old_logprobs=recompute``, over
    every mini-batch after the first, or all of them with ``correction=mis``); null: ``train.micro_batch_size``.
    A forward-only pass keeps no activations for a backward, so it can take larger micro-batches than training
    and run faster (verl's ``log_prob_micro_batch_size_per_gpu``)."""
    correction: Correction = Correction.tis
    """Off-policy correction against the engine's (behaviour) logprobs."""
    correction_level: CorrectionLevel = CorrectionLevel.token
    """The weight w of tis and mis: per token, or per sequence as the product of its token ratios (unbiased)
    or their geometric mean (length-normalised); mis is per sequence, icepop per token."""
    is_cap: float = 2.0
    """TIS truncation C: weight = min(w, C)."""
    mis_high: float = 2.0
    """MIS threshold C: a sequence with w > C is rejected (no gradient, out of the loss normalizer)."""
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

    def check_mini_batches(self, samples: int, dp: int) -> None:
        """Raise naming ``algo.mini_batches`` when a step's ``samples`` over ``dp`` DP ranks do not split into
        that many equal mini-batches per rank (a batch that does not split over DP is another error)."""
        if samples % dp == 0 and (samples // dp) % self.mini_batches:
            fail("algo.mini_batches", f"is {self.mini_batches}, but a step's {samples} samples "
                 f"(train.prompts_per_step * rollout.n_samples_per_prompt) over {dp} DP rank(s) do not split into "
                 f"{self.mini_batches} equal mini-batches per rank; choose a divisor of {samples // dp}")

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
        if self.mis_high < 1.0:
            fail("algo.mis_high", f"must be >= 1, got {self.mis_high}")
        if not 0.0 <= self.icepop_low <= 1.0 <= self.icepop_high:
            fail("algo.icepop_low/icepop_high",
                 f"must satisfy 0 <= low <= 1 <= high, got [{self.icepop_low}, {self.icepop_high}]")
        if self.correction is Correction.icepop and self.correction_level is not CorrectionLevel.token:
            fail("algo.correction_level", "icepop is per token; correction=mis masks whole sequences")
        if self.correction is Correction.mis and self.correction_level is CorrectionLevel.token:
            fail("algo.correction_level", "correction=mis (masked IS) rejects whole sequences: set sequence_product "
                 "(its paper's ratio) or sequence_geomean; a per-token band is correction=icepop")
        for name in ("mini_batches", "ppo_epochs"):
            if getattr(self, name) < 1:
                fail(f"algo.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.old_logprob_micro_batch_size is not None:
            if self.old_logprob_micro_batch_size < 1:
                fail("algo.old_logprob_micro_batch_size",
                     f"must be >= 1 or null, got {self.old_logprob_micro_batch_size}")
            if self.old_logprobs is OldLogprobs.engine:
                fail("algo.old_logprob_micro_batch_size", "sizes the pi_old pass, which algo.old_logprobs=engine does "
                     "not run: leave it null, or set algo.old_logprobs=recompute")
        if self.old_logprobs is OldLogprobs.engine and self.correction is not Correction.none:
            fail("algo.correction", f"{self.correction.value} weighs pi_old / pi_engine, which is 1 when "
                 "algo.old_logprobs=engine (pi_old is the engine's policy): set algo.correction=none, or "
                 "algo.old_logprobs=recompute for decoupled PPO")
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
