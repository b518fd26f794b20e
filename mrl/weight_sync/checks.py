"""The checks around a weight sync: no non-finite weight leaves the trainer (``check_finite_weights``, before
every sync and checkpoint), and the engines' logprobs equal the trainer's after one (``verify_engines``,
``weight_sync.verify``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mrl.megatron.collectives import named
from mrl.megatron.parallel import Layout
from mrl.sglang.client import ClientTimeouts, EngineClient
from mrl.sglang.endpoint import EngineEndpoint
from mrl.weight_sync.transport import run_on


class NonFiniteWeights(RuntimeError):
    """Weights with a NaN or Inf, refused before they reach an engine or a checkpoint."""


def check_finite_weights(module: torch.nn.Module, what: str) -> None:
    """Raise ``NonFiniteWeights`` on every rank, naming the parameters, when any rank holds a non-finite
    weight: nothing non-finite is synced or checkpointed. The optimizer step skips non-finite updates
    (``Policy._step_if_finite``); this catches the rest (a weight corrupted in place, a loaded one).
    Collective: one MAX all-reduce (every rank checks its own shards); only when a norm was non-finite
    somewhere, a second one after the element-wise recheck and, when that confirms it, a gather of names."""
    named_params = list(module.named_parameters())
    # A NaN or Inf makes a tensor's L2 norm non-finite. The fused multi-tensor norm launches a handful of
    # kernels for the whole model, where a reduction per parameter launches one per tensor (an MoE layer
    # holds a weight per local expert): milliseconds of launches on a GPU at every sync. The norm also
    # overflows for finite values beyond about 1e19, so a tensor it flags is checked element by element.
    params = [p.detach() for _, p in named_params]
    norms = torch._foreach_norm(params, 2, dtype=torch.float32) if params else []
    suspect = torch.stack(norms).isfinite().logical_not() if norms else torch.zeros(0, dtype=torch.bool)
    flag = suspect.any().float().reshape(1)
    with named(f"the finite-weights check before {what}"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    mine = [n for (n, p), s in zip(named_params, suspect.tolist()) if s and not bool(p.isfinite().all())]
    bad = torch.tensor([float(bool(mine))], device=flag.device)
    with named(f"the finite-weights recheck before {what}"):
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    everyone: list = [None] * dist.get_world_size()
    with named(f"the gather of non-finite weight names before {what}"):
        dist.all_gather_object(everyone, mine)
    names = {f"rank {r}: {n}" for r, ns in enumerate(everyone) for n in ns}
    raise NonFiniteWeights(f"{what} refused: the trainer holds non-finite (NaN/Inf) weights, "
                           f"{sorted(names)[:8]}{' ...' if len(names) > 8 else ''}; nothing was sent or written")


class SyncMismatch(RuntimeError):
    """After a sync, an engine's logprobs of the probe are not the trainer's (``weight_sync.verify``)."""


def verify_engines(module: torch.nn.Module, layout: Layout, engines: list[EngineEndpoint], *, vocab_size: int,
                   tol: float, version: str, seed: int = 0, probe_len: int = 32,
                   lora_path: str | None = None, timeout_s: float = 300.0) -> tuple[dict[str, float], dict]:
    """``weight_sync.verify``: teacher-forced logprobs of a fixed random probe, each engine's against the
    trainer's (both route naturally), after a sync. Collective. Returns ({url: max abs difference}, {url:
    error} of engines that could not be asked: a dead one is the next sync's to drop); raises
    ``SyncMismatch`` on every rank when an engine differs by more than ``tol``: it would generate every
    later sample from weights that are not the trainer's, and nothing else would show it. LoRA runs pass
    ``lora_path``, the adapter name of ``version`` (``mrl.sglang.wire.adapter_name``). An engine that
    does not answer its probe within ``timeout_s`` counts as unreachable (a one-token request: a hung
    engine must not hold every rank for the client's generation limit of an hour)."""
    from mrl.megatron import compat
    from mrl.megatron.forward import forward_logits, token_logprobs

    probe = torch.randint(0, vocab_size, (1, probe_len), generator=torch.Generator().manual_seed(seed))
    was_training = module.training
    module.eval()
    try:
        logits = forward_logits(module, layout, probe.to(compat.DEVICE))
    finally:
        module.train(was_training)
    mine = token_logprobs(logits, probe.to(logits.device), vocab_size)[0].tolist() if logits is not None else None
    box: list = [None] * dist.get_world_size()
    with named(f"the gather of the probe logprobs verifying weight sync v{version}"):
        dist.all_gather_object(box, mine)
    mine = next(x for x in box if x is not None)  # the last pipeline stage's
    result: list = [None]
    if layout.world_rank == 0:
        got: dict[str, list[float]] = {}

        async def probe_one(c: EngineClient) -> None:
            out = await c.generate(probe[0].tolist(), {"max_new_tokens": 1, "temperature": 0.0},
                                   rid=f"mrl-verify-v{version}-{abs(hash(c.url)):x}", logprob_start_len=0,
                                   lora_path=lora_path)
            got[c.url] = out.input_logprobs[1:]  # the first token has none

        errs = run_on(engines, probe_one, timeouts=ClientTimeouts(control=timeout_s, generate=timeout_s))
        result = [({url: max(abs(a - b) for a, b in zip(lps, mine)) for url, lps in got.items()}, errs)]
    with named(f"broadcast of the probe differences verifying weight sync v{version}", src=0):
        dist.broadcast_object_list(result, src=0)
    diffs, errs = result[0]
    bad = {url: d for url, d in diffs.items() if not d <= tol}
    if bad:
        raise SyncMismatch(f"weight sync v{version}: engines {sorted(bad)} disagree with the trainer on a fixed "
                           f"probe: max |logprob difference| {', '.join(f'{d:.3g}' for d in bad.values())} > "
                           f"weight_sync.verify_tol={tol} (every engine: {diffs}); their weights are not the "
                           "trainer's")
    return diffs, errs
