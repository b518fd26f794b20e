"""The engine-vs-trainer logprob mismatch split by cause (``mismatch/*`` metrics; docs/keep_routing.md).

Every response token carries the weight version that sampled it (``Sample.versions``); the trainer knows
which version its own weights are (``Policy.version``, a ``WeightsVersion``). Its lag is the difference:

    numerics   lag 0: sampled by the very weights the trainer scores it with, routes replayed. What is
               left is kernels and precision only (fp32: zero up to rounding; bf16: set by the kernels).
               ``numerics_resumed``: those of its tokens in samples that hold older tokens too (partial
               rollouts resumed across a sync), whose prefix the engine recomputed under new weights.
    routing    the same lag-0 tokens scored with the trainer's own routing (replay off) minus replayed:
               what Keep Routing removes.
    staleness  lag > 0: sampled by older weights (overlap mode, partial rollouts resumed across a sync,
               or trainer steps not yet pushed), per lag, with the off-policy correction weights
               (TIS/MIS/ICEPOP, ``algo.correction``) that the loss gives them.

Each part as the mean |log pi_train - log pi_engine| and the k3 estimate of KL(pi_engine || pi_train)
over its tokens (token-weighted over the whole batch, every DP rank), with its token count.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mrl.algo.correction import importance_correction
from mrl.config.schema import AlgoConfig, Correction

PREFIX = "mismatch/"


class WeightsVersion:
    """Which engine weight version the trainer's weights are: the last one pushed (``synced``), or the
    next one once an optimizer step has changed them since (no token carries that one yet)."""

    def __init__(self) -> None:
        self.pushed: int | None = None
        self.changed = False

    def synced(self, version: int) -> None:
        """The engines now hold these weights as ``version`` (after each push, and at the start with
        the version the engines start from)."""
        self.pushed, self.changed = version, False

    def stepped(self, updated: bool) -> None:
        self.changed |= updated

    @property
    def current(self) -> int | None:
        """None: never told (no split)."""
        return None if self.pushed is None else self.pushed + int(self.changed)


def batch_lags(versions: Iterable[int], trainer_version: int) -> list[int]:
    """Lags of the versions present anywhere in the step's whole batch (``WholeBatch.versions``: every rank
    knows them, also when it holds only its DP rank's share, so every rank reports the same keys, zeros
    included, and the averages over ranks stay token-weighted)."""
    return sorted({trainer_version - v for v in versions})


def gap_sums(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor,
             lags: list[int], algo: AlgoConfig | None) -> dict[str, torch.Tensor]:
    """Sums (not means) of one micro-batch's [B, T] tensors, per cause: token counts, sum |d| and sum of
    k3 terms, d = log pi_train - log pi_engine. ``algo``: the correction the loss applies, evaluated on
    the whole mask (as the loss does: sequence-level weights span every token of a sequence), then
    summed over the stale tokens; None (a forward without a loss) leaves the correction out."""
    m = mask > 0
    # float64: a KL of 1e-7 is below float32's resolution of exp(d) near 1
    d = torch.where(m, logp.detach().double() - behav.double(), 0)
    k3 = torch.expm1(d) - d
    out = {}
    # lag-0 tokens of samples that hold older ones too: partial rollouts resumed across a sync (or later
    # turns of an episode), whose prefix the engine recomputed under the new weights
    resumed = (m & (lag > 0)).any(dim=-1, keepdim=True)
    for name, sel in (("numerics", m & (lag == 0)), ("stale", m & (lag > 0)),
                      ("numerics_resumed", m & (lag == 0) & resumed)):
        out[f"{name}_tokens"] = sel.sum()
        out[f"{name}_absdiff"] = torch.where(sel, d.abs(), 0).sum()
        out[f"{name}_k3"] = torch.where(sel, k3, 0).sum()
    for k in lags:
        if k > 0:
            sel = m & (lag == k)
            out[f"stale_lag{k}_tokens"] = sel.sum()
            out[f"stale_lag{k}_k3"] = torch.where(sel, k3, 0).sum()
    if algo is not None:
        stale = m & (lag > 0)
        corr = importance_correction(logp.detach(), behav, mask, algo)
        out["stale_weight"] = torch.where(stale, corr.weight, 0).sum()
        # cut: a weight truncated at the cap (tis) or a token rejected (mis, icepop)
        cut = stale & (corr.weight >= algo.is_cap) if algo.correction is Correction.tis else stale & ~corr.keep
        out["stale_cut"] = cut.sum()
    return out


def split_sums(versions: Iterable[int], outs: list[dict], mbs: list, version: int | None,
               replay: bool, algo: AlgoConfig | None) -> dict[str, float]:
    """This rank's sums of the split for one forward's outputs (``data["lag"]`` on each micro-batch);
    ``versions``: those of the whole batch's tokens; {} without any."""
    if version is None or not versions:
        return {}
    lags = batch_lags(versions, version)
    return finish([gap_sums(o["logprobs"], mb.data["behav"], mb.data["mask"], mb.data["lag"], lags, algo)
                   for o, mb in zip(outs, mbs)], replay)


def finish(rows: list[dict[str, torch.Tensor]], replay: bool) -> dict[str, float]:
    """The micro-batches' sums added up (one host sync), as this rank's sums: ``mismatch/_sum/*``.
    ``replay``: the forward replayed the engine's routes (else the lag-0 sums are replay-off ones)."""
    if not rows:
        return {}
    keys = list(rows[0])
    vals = torch.stack([torch.stack([r[k].double().reshape(()) for k in keys]) for r in rows]).sum(0).tolist()
    tag = "on" if replay else "off"
    return {f"{PREFIX}_sum/{k}_{tag}": v for k, v in zip(keys, vals)}


def ratios(summed: dict[str, float], dp: int) -> dict[str, float]:
    """The reported metrics from the sums averaged over ranks (``Policy._reduce``): every DP rank counts
    once per TP/CP replica, so averaged sums divide like totals; counts are scaled back to totals. A
    part without tokens reports its count (0) only: no mean, never a false 0."""
    head = PREFIX + "_sum/"
    s = {k[len(head):]: v for k, v in summed.items() if k.startswith(head)}
    out = {k: v for k, v in summed.items() if not k.startswith(head)}

    def part(name: str, tag: str, label: str) -> dict[str, float]:
        n = s[f"{name}_tokens_{tag}"]
        got = {f"{PREFIX}{label}_tokens": n * dp}
        if n > 0:
            got |= {f"{PREFIX}{label}_logprob_diff": s[f"{name}_absdiff_{tag}"] / n,
                    f"{PREFIX}{label}_kl": s[f"{name}_k3_{tag}"] / n}
        return got

    on, off = "numerics_tokens_on" in s, "numerics_tokens_off" in s
    if on:
        out |= part("numerics", "on", "numerics") | part("numerics_resumed", "on", "numerics_resumed")
        if off and s["numerics_tokens_on"] > 0:
            out[PREFIX + "routing_logprob_diff"] = (s["numerics_absdiff_off"] - s["numerics_absdiff_on"]) \
                / s["numerics_tokens_on"]
            out[PREFIX + "routing_kl"] = (s["numerics_k3_off"] - s["numerics_k3_on"]) / s["numerics_tokens_on"]
    elif off:  # train.replay=false: the lag-0 part holds the routing mismatch too
        out |= part("numerics", "off", "numerics_replay_off") \
            | part("numerics_resumed", "off", "numerics_resumed_replay_off")
    if not (on or off):
        return out
    tag = "on" if on else "off"
    out |= part("stale", tag, "stale")
    n = s[f"stale_tokens_{tag}"]
    for key, v in s.items():
        if key.startswith("stale_lag") and key.endswith(f"_tokens_{tag}"):
            lag = key[len("stale_lag"):-len(f"_tokens_{tag}")]
            out[f"{PREFIX}stale_lag{lag}_tokens"] = v * dp
            if v > 0:
                out[f"{PREFIX}stale_lag{lag}_kl"] = s[f"stale_lag{lag}_k3_{tag}"] / v
    if f"stale_weight_{tag}" in s and n > 0:
        out[PREFIX + "stale_is_weight_mean"] = s[f"stale_weight_{tag}"] / n
        out[PREFIX + "stale_is_cut_frac"] = s[f"stale_cut_{tag}"] / n
    return out
