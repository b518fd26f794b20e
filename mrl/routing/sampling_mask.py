"""Keep Sampling Mask: train on the support the engine sampled from (top-k / top-p / min-p), no SGLang patch.

    mask_NV = support_mask(logits_NV, temperature=1.0, top_k=20, top_p=0.95, min_p=0.0)    # trainer side
    ids = support_from_top_logprobs(out.output_top_logprobs, temperature=1.0, top_k=20, top_p=0.95, min_p=0.0)
    mask_NV = mask_from_support_ids(ids, vocab_size)                                          # engine side
    logprobs_N, outside_N = masked_logprobs(logits_NV, tokens_N, mask_NV, 1.0, on_outside="drop")

    ids_NK = support_tensor(ids)                                                              # in the loss
    logprobs_N, outside_N = support_logprobs(logits_NV, tokens_N, ids_NK, 1.0, on_outside="drop")

What SGLang does (read from 0.5.10, unchanged in 0.5.14: ``sglang/srt/layers/sampler.py`` ``Sampler.forward``,
``top_k_top_p_min_p_sampling_from_probs_torch``, ``sampling/sampling_params.py`` ``SamplingParams.__init__``,
``sampling/sampling_batch_info.py`` ``SamplingBatchInfo.from_schedule_batch``, flashinfer ``sampling.cuh``):

- Request params: ``0 <= temperature < 1e-6`` becomes temperature 1 with top_k 1 (greedy); ``top_k == -1``
  becomes ``TOP_K_ALL = 1 << 30`` (whole vocabulary). Penalties, logit_bias, grammar masks and
  min_new_tokens are applied to the logits before the sampler (``apply_logits_bias``).
- Sampler: ``probs = softmax(logits / temperature)`` (fp32), then the support. Backend ``pytorch`` (CPU
  engines, ``--enable-deterministic-inference``, ``--sampling-backend pytorch``): sort descending, keep
  sorted position ``i`` iff ``i < top_k`` and ``cumsum(p)_i - p_i <= top_p`` (exclusive mass of the
  *un-renormalized* probs, so the token that crosses top_p is kept) and ``p_i >= p_max * min_p``.
  Backend ``flashinfer`` (GPU default): keep ``j`` iff ``#{p > p_j} < top_k`` and ``sum{p > p_j} < top_p``
  (joint, strict); when any request of the batch has ``min_p > 0`` it instead renormalizes over the top-k
  first and applies top-p to the renormalized probs, then min-p (``p >= p_max * min_p``).
- Reported logprobs (``output_token_logprobs``, ``output_top_logprobs``; ``Sampler._attach_logprobs_to_output``):
  ``log(softmax(biased_logits / temperature))`` over the full vocabulary: temperature applied, top-k /
  top-p / min-p **not** applied (no renormalization). Exceptions: ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
  returns ``log_softmax(logits)`` without temperature (then the support cannot be rebuilt from the top
  logprobs: refuse that env var); a batch where every request is greedy returns ``log_softmax(logits)``.
  Prompt logprobs (``input_*``) are raw ``log_softmax(logits)`` (``logits_processor.py``; the temp/top-p
  flags are always False in 0.5.10).
- ``sampling_seed`` is used only with ``--enable-deterministic-inference`` (else ``torch.multinomial``). That
  path samples ``argmax(log(p_masked) + gumbel)`` with gumbel from a 32-bit hash; a hash of exactly
  ``2**32 - 1`` gives ``+inf`` noise, ``-inf + inf = NaN`` and ``argmax`` picks the NaN: an out-of-support
  token with probability ~``V / 2**32`` per step (3.5e-5 for V = 151936). ``on_outside="drop"`` covers it.

Support = ``{j : p_j >= p_last_kept, p_j > 0}``: a tie at the boundary keeps every tied token (the pytorch
backend keeps a sort-order-dependent subset, flashinfer keeps all of them), so the mask is the engine's
support or a superset by tokens of exactly the boundary probability. Shape legend: N positions, V vocab,
K candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

SAMPLING_EPS = 1e-6  # sglang SamplingParams: temperatures below this mean greedy
SamplingBackend = Literal["pytorch", "flashinfer"]
OnOutside = Literal["raise", "drop"]


@dataclass(frozen=True)
class SupportSpec:
    """How the training loss applies the engine's sampling support (``train_step.forward_backward``)."""

    temperature: float
    """The rollout temperature: the support's distribution is ``softmax(logits / temperature)``."""
    on_outside: "OnOutside" = "raise"
    """A sampled token outside its support: raise, or drop it from the loss (counted)."""


class OutsideSupportError(ValueError):
    """A sampled token lies outside the sampling support: the engine could not have sampled it."""


class IncompleteSupportError(ValueError):
    """The engine's top logprobs are too few to tell where its support ends."""


def _normalize(temperature: float, top_k: int, top_p: float, min_p: float) -> tuple[float, int | None]:
    """(temperature, top_k or None for all) as SGLang's SamplingParams.__init__/verify turn them."""
    if temperature < 0.0:
        raise ValueError(f"temperature must be non-negative, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"top_k must be -1 (all) or at least 1, got {top_k}")
    if temperature < SAMPLING_EPS:
        return 1.0, 1
    return float(temperature), None if top_k == -1 else int(top_k)


def _keep_sorted(probs_sort_NK: torch.Tensor, *, top_k: int | None, top_p: float, min_p: float,
                 backend: SamplingBackend) -> torch.Tensor:
    """Engine decision per sorted (descending) probability; row i uses only entries <= i (and, for the
    flashinfer min-p path, the top-k mass). Follows sampler.py::top_k_top_p_min_p_sampling_from_probs_torch
    and flashinfer TopKTopPSamplingFromProbKernel / TopPRenormProbKernel / MinPSamplingFromProbKernel."""
    k_dim = probs_sort_NK.shape[-1]
    pos_K = torch.arange(k_dim, device=probs_sort_NK.device)
    keep_NK = pos_K < (top_k if top_k is not None else k_dim)
    excl_NK = probs_sort_NK.cumsum(-1) - probs_sort_NK  # mass strictly before each sorted position
    if backend == "pytorch":
        keep_NK = keep_NK & (excl_NK <= top_p)
    elif backend == "flashinfer" and min_p > 0:  # top_k_renorm_prob -> top_p_renorm_prob -> min_p
        mass_N1 = 1.0 if top_k is None else (probs_sort_NK * keep_NK).sum(-1, keepdim=True)
        keep_NK = keep_NK & (excl_NK < top_p * mass_N1)
    elif backend == "flashinfer":  # top_k_top_p_sampling_from_probs(filter_apply_order="joint")
        keep_NK = keep_NK & (excl_NK < top_p)
    else:
        raise ValueError(f"backend must be 'pytorch' or 'flashinfer', got {backend!r}")
    if min_p > 0:
        keep_NK = keep_NK & (probs_sort_NK >= probs_sort_NK[..., :1] * min_p)
    return keep_NK


def _threshold(probs_sort_NK: torch.Tensor, keep_NK: torch.Tensor) -> torch.Tensor:
    """Smallest kept probability per row [N, 1] (the top entry is always kept: top_k >= 1, top_p > 0)."""
    return probs_sort_NK.masked_fill(~keep_NK, float("inf")).amin(-1, keepdim=True)


def support_mask(logits_NV: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float,
                 backend: SamplingBackend = "pytorch") -> torch.Tensor:
    """bool [N, V]: the tokens SGLang's sampler may draw from these logits.

    Penalties, logit_bias, grammars and min_new_tokens are not modelled: with those, use the engine's
    support (``support_from_top_logprobs``), which sees the biased logits."""
    temperature, k = _normalize(temperature, top_k, top_p, min_p)
    probs_NV = torch.softmax(logits_NV.detach().float() / temperature, dim=-1)
    probs_sort_NV = probs_NV.sort(dim=-1, descending=True).values
    keep_NV = _keep_sorted(probs_sort_NV, top_k=k, top_p=top_p, min_p=min_p, backend=backend)
    return (probs_NV >= _threshold(probs_sort_NV, keep_NV)) & (probs_NV > 0)


def masked_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, mask_NV: torch.Tensor, temperature: float,
                    *, on_outside: OnOutside) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N], outside [N]): log-softmax of ``logits / temperature`` over the support only, at the
    sampled tokens. Off-support logits get no gradient. A sampled token outside its support raises
    ``OutsideSupportError`` (``on_outside="raise"``) or gets logprob ``-inf`` with no gradient and
    ``outside = True`` (``"drop"``): the loss must then drop it (``logprobs.masked_fill(outside, 0)``)."""
    if on_outside not in ("raise", "drop"):
        raise ValueError(f"on_outside must be 'raise' or 'drop', got {on_outside!r}")
    if mask_NV.shape != logits_NV.shape:
        raise ValueError(f"mask shape {tuple(mask_NV.shape)} != logits shape {tuple(logits_NV.shape)}")
    if not bool(mask_NV.any(-1).all()):
        raise ValueError("every position needs a non-empty support (the engine always keeps its top token)")
    temperature, _ = _normalize(temperature, -1, 1.0, 0.0)
    x_NV = logits_NV.float() / temperature
    logz_N = torch.logsumexp(x_NV.masked_fill(~mask_NV, float("-inf")), dim=-1)
    idx_N1 = tokens_N.long().unsqueeze(-1)
    outside_N = ~mask_NV.gather(-1, idx_N1).squeeze(-1)
    if on_outside == "raise" and bool(outside_N.any()):
        where = outside_N.nonzero().flatten()
        raise OutsideSupportError(f"{where.numel()} sampled token(s) outside the sampling support, at positions "
                                  f"{where[:8].tolist()}; tokens {tokens_N[where[:8]].tolist()}")
    # the outside branch is a constant: those rows carry no gradient even if the caller forgets to drop them
    lp_N = x_NV.gather(-1, idx_N1).squeeze(-1) - logz_N
    return torch.where(outside_N, torch.full_like(lp_N, float("-inf")), lp_N), outside_N


def support_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, support_NK: torch.Tensor, temperature: float,
                     *, on_outside: OnOutside) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_logprobs`` with the support as token ids ``[N, K]`` (-1 = empty slot) instead of a
    ``[N, V]`` mask: what the training loss uses (K is top_k-sized, V is the vocabulary). A row with
    no id at all is not masked: plain log-softmax of ``logits / temperature`` (prompt, padding, and
    positions whose support could not be rebuilt, which the caller keeps out of the loss).
    Gradients reach only the support's logits; an outside token's row gets none."""
    if on_outside not in ("raise", "drop"):
        raise ValueError(f"on_outside must be 'raise' or 'drop', got {on_outside!r}")
    if support_NK.shape[:-1] != tokens_N.shape:
        raise ValueError(f"support shape {tuple(support_NK.shape)} does not match tokens {tuple(tokens_N.shape)}")
    if support_NK.numel() and int(support_NK.max()) >= logits_NV.shape[-1]:
        raise ValueError(f"support id {int(support_NK.max())} >= vocabulary {logits_NV.shape[-1]}")
    temperature, _ = _normalize(temperature, -1, 1.0, 0.0)
    x_NV = logits_NV.float() / temperature
    slot_NK = support_NK >= 0
    has_N = slot_NK.any(-1)
    # rows without a support get a finite dummy (zeros): an all -inf logsumexp would put NaN in backward
    sup_NK = x_NV.gather(-1, support_NK.clamp(min=0)).masked_fill(~slot_NK, float("-inf"))
    sup_NK = sup_NK.masked_fill(~has_N[..., None], 0.0)
    logz_N = torch.where(has_N, torch.logsumexp(sup_NK, -1), torch.logsumexp(x_NV, -1))
    tok_N1 = tokens_N.long().unsqueeze(-1)
    outside_N = has_N & ~(support_NK == tok_N1).any(-1)
    if on_outside == "raise" and bool(outside_N.any()):
        where = outside_N.nonzero()
        raise OutsideSupportError(f"{where.shape[0]} sampled token(s) outside the sampling support, at positions "
                                  f"{where[:8].tolist()}; tokens {tokens_N[outside_N][:8].tolist()}")
    lp_N = x_NV.gather(-1, tok_N1).squeeze(-1) - logz_N
    return torch.where(outside_N, torch.full_like(lp_N, float("-inf")), lp_N), outside_N


def support_tensor(support_ids: Sequence[Sequence[int]], width: int | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Per-position id lists -> ``[N, K]`` int64, -1 padded (K = the longest list, or ``width``)."""
    k = max([len(ids) for ids in support_ids] + [1]) if width is None else width
    out = torch.full((len(support_ids), k), -1, dtype=torch.long)
    for t, ids in enumerate(support_ids):
        out[t, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return out.to(device) if device is not None else out


def top_logprobs_to_request(*, temperature: float, top_k: int, top_logprobs_num: int | None) -> int:
    """How many top logprobs per response token the engine must return (``top_logprobs_num``) for the
    support to be rebuilt: the configured number, else top_k (1 when greedy)."""
    if top_logprobs_num is not None:
        return int(top_logprobs_num)
    if temperature < SAMPLING_EPS:
        return 1
    if top_k == -1:
        raise ValueError("rollout.top_logprobs_num: must be set for train.sampling_mask when rollout.top_k=-1 "
                         "(the top_p / min_p support is rebuilt only where its cut falls inside the returned top)")
    return int(top_k)


def engine_support(output_top_logprobs: Sequence[Sequence[Sequence[float]]], *, temperature: float, top_k: int,
                   top_p: float, min_p: float, backend: SamplingBackend = "pytorch"
                   ) -> tuple[list[list[int]], list[float]]:
    """Per response position: the engine's support ids and the log of its probability mass there
    (``log sum exp(engine logprob)`` over the support: the engine reports logprobs over the whole
    vocabulary, so ``engine logprob - log mass`` is the logprob under the distribution it sampled).
    A position whose support cannot be rebuilt (too few top logprobs) gets ``([], 0.0)``: the trainer
    errors or masks it out (``train.bad_support``)."""
    try:
        ids = support_from_top_logprobs(output_top_logprobs, temperature=temperature, top_k=top_k, top_p=top_p,
                                        min_p=min_p, backend=backend)
    except IncompleteSupportError:
        ids = [_position_support(step, temperature, top_k, top_p, min_p, backend) for step in output_top_logprobs]
    mass = []
    for step, kept in zip(output_top_logprobs, ids):
        lp = {int(c[1]): float(c[0]) for c in step}
        mass.append(float(torch.logsumexp(torch.tensor([lp[i] for i in kept]), 0)) if kept else 0.0)
    return ids, mass


def _position_support(step, temperature, top_k, top_p, min_p, backend) -> list[int]:
    try:
        return support_from_top_logprobs([step], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                         backend=backend)[0]
    except IncompleteSupportError:
        return []


def support_from_top_logprobs(output_top_logprobs: Sequence[Sequence[Sequence[float]]], *, temperature: float,
                              top_k: int, top_p: float, min_p: float,
                              backend: SamplingBackend = "pytorch") -> list[list[int]]:
    """Per response position, the token ids of the engine's support, rebuilt from its own top logprobs.

    ``output_top_logprobs``: ``meta_info.output_top_logprobs`` ([logprob, id, text] triples) or
    ``GenerateOutput.output_top_logprobs`` ((logprob, id) pairs), requested with ``top_logprobs_num >= top_k``.
    The engine's logprobs are ``log(softmax(biased_logits / T))`` over the full vocabulary, so their exp are
    the very probabilities its sampler thresholded. Raises ``IncompleteSupportError`` where the support may
    extend past the returned candidates (top_k = -1 or top_logprobs_num < top_k, and no candidate cut)."""
    _, k = _normalize(temperature, top_k, top_p, min_p)
    if not output_top_logprobs:
        return []
    width = max(len(step) for step in output_top_logprobs)
    if width == 0:
        raise IncompleteSupportError("no top logprobs in the response: request top_logprobs_num >= top_k")
    lp_NK = torch.full((len(output_top_logprobs), width), float("-inf"), dtype=torch.float32)
    ids_NK = torch.full((len(output_top_logprobs), width), -1, dtype=torch.long)
    for t, step in enumerate(output_top_logprobs):
        for j, cand in enumerate(step):
            lp_NK[t, j], ids_NK[t, j] = float(cand[0]), int(cand[1])
    valid_NK = ids_NK >= 0
    if bool((lp_NK[:, 1:] > lp_NK[:, :-1]).any()):
        raise ValueError("top logprobs are not sorted in descending order (SGLang returns torch.topk order)")
    probs_sort_NK = lp_NK.exp()  # the engine's fp32 probs (it returned log(probs), clamped at finfo.min)
    keep_NK = _keep_sorted(probs_sort_NK, top_k=k, top_p=top_p, min_p=min_p, backend=backend) & valid_NK
    n_valid_N = valid_NK.sum(-1)
    # decided: the top-k cut is inside the list, or some candidate is already cut by top-p / min-p
    decided_N = keep_NK.sum(-1) < n_valid_N
    if k is not None:
        decided_N |= n_valid_N >= k
        if backend == "flashinfer" and min_p > 0:  # the renormalization needs the whole top-k mass
            decided_N &= n_valid_N >= k
    if not bool(decided_N.all()):
        t = int((~decided_N).nonzero()[0])
        raise IncompleteSupportError(
            f"position {t}: all {int(n_valid_N[t])} returned candidates are in the support (top_k={top_k}, "
            f"top_p={top_p}, min_p={min_p}), so it may extend further; request top_logprobs_num >= top_k")
    in_NK = (probs_sort_NK >= _threshold(probs_sort_NK, keep_NK)) & (probs_sort_NK > 0) & valid_NK
    return [ids_NK[t, in_NK[t]].tolist() for t in range(ids_NK.shape[0])]


def mask_from_support_ids(support_ids: Sequence[Sequence[int]], vocab_size: int,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """bool [N, V] from per-position token-id lists."""
    mask_NV = torch.zeros(len(support_ids), vocab_size, dtype=torch.bool, device=device)
    for t, ids in enumerate(support_ids):
        mask_NV[t, list(ids)] = True
    return mask_NV
