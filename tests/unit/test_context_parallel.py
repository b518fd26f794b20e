"""Context parallelism's split and gather (mrl/megatron/context_parallel.py) against megatron-core's own split
of the same batch, the loss equal to CP=1's, and the layouts with CP in config validation and the preflight.

Unpacked rows: megatron's ``get_batch_on_this_cp_rank`` itself (per-sequence balancing), with a fake CP group
(``torch.distributed``'s size and rank getters patched). Packed THD rows: megatron's per-document path calls
Transformer Engine's ``thd_get_partitioned_indices``, a CUDA kernel; here it runs with that kernel replaced by
``_te_partitioned_indices``, a transcription of the kernel's per-token rule, so megatron's own code around it
(which cu_seqlens it passes, what it index-selects) is exercised, the kernel itself only on GPUs. The
attention is not run: megatron's local attention has no CP and TE's is GPU-only; the multi-rank gather and
megatron's schedule under a real CP=2 gloo group are tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mrl.megatron import context_parallel as cpm
from mrl.megatron.context_parallel import CPSplit, megatron_positions, next_tokens, padded_len, zigzag_positions
from mrl.routing.replay import RankSlice


def _fake_cp_group(monkeypatch, cp: int, rank: int):
    group = object()
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: cp if g is group else 1)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: rank if g is group else 0)
    return group


def _te_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """TE's ``thd_partition_indices_kernel`` (common/fused_attn/context_parallel.cu) per local token: find its
    sequence in cu_seqlens / world, index < half the local length -> chunk ``rank``, else chunk
    ``2 * world - 1 - rank``."""
    cu = (cu_seqlens.long() // world_size).tolist()
    out = []
    for token in range(total_tokens // world_size):
        seq = max(i for i in range(len(cu) - 1) if cu[i] <= token)
        local_len, index = cu[seq + 1] - cu[seq], token - cu[seq]
        offset = rank if index < local_len // 2 else 2 * world_size - 2 - rank
        out.append(index + cu[seq] * world_size + offset * local_len // 2)
    return torch.tensor(out, dtype=torch.int32)


def _batch(b: int, s: int, layers: int = 3, k: int = 2) -> dict[str, torch.Tensor]:
    """Every per-token tensor a micro-batch carries, in the input's position layout, each position distinct."""
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(b * s).view(b, s)
    return {"tokens": ids, "position_ids": torch.arange(s).expand(b, s).clone(), "labels": next_tokens(ids),
            "routes": torch.randint(0, 64, (b, s, layers, k), generator=g),
            "loss_mask": (torch.rand(b, s, generator=g) > 0.3).float(), "advantages": torch.randn(b, s, generator=g),
            "old_logprobs": -torch.rand(b, s, generator=g), "ref_logprobs": -torch.rand(b, s, generator=g),
            "engine_logprobs": -torch.rand(b, s, generator=g),
            "support": torch.randint(-1, 50, (b, s, 4), generator=g)}


@pytest.mark.parametrize("cp", [2, 4])
def test_unpacked_split_of_every_per_token_tensor_is_megatrons(monkeypatch, cp):
    from megatron.core.utils import get_batch_on_this_cp_rank

    b, s = 3, 32
    for rank in range(cp):
        group = _fake_cp_group(monkeypatch, cp, rank)
        batch = _batch(b, s)
        want = get_batch_on_this_cp_rank({**{k: v.clone() for k, v in batch.items()}, "cu_seqlens": None},
                                         is_hybrid_cp=False, cp_group=group)
        index = megatron_positions(s, None, group)
        monkeypatch.undo()
        assert index.tolist() == zigzag_positions(s, cp, rank).tolist()  # the documented rule, written out
        split = _splits(s, cp)[rank]
        for key, x in batch.items():
            assert torch.equal(split.split(x), want[key]), (cp, rank, key)


@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (2, 2, True), (4, 2, True), (2, 2, False)])
def test_routes_reach_the_router_in_megatrons_token_order(monkeypatch, cp, tp, sp):
    """The router of CP rank c, TP rank t sees megatron's CP split of the batch, then the SP scatter of the
    ``[s, b]`` embeddings (``_split_along_first_dim``), flattened s-first: its routes come in that order."""
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim
    from megatron.core.utils import get_batch_on_this_cp_rank

    b, s = 3, 32
    ids = torch.arange(b * s).view(b, s)
    routes = torch.stack([ids, ids + 1000], -1)[:, :, None, :]  # [B, S, L=1, K=2], each position its own ids
    for c in range(cp):
        for t in range(tp):
            group = _fake_cp_group(monkeypatch, cp, c)
            local = get_batch_on_this_cp_rank({"tokens": ids.clone(), "cu_seqlens": None}, is_hybrid_cp=False,
                                              cp_group=group)["tokens"]
            index = megatron_positions(s, None, group)
            monkeypatch.undo()
            tp_group = SimpleNamespace(size=lambda: tp if sp else 1, rank=lambda: t)
            want = _split_along_first_dim(local.transpose(0, 1).contiguous(), tp_group).reshape(-1)
            rs = RankSlice(tp_rank=t, tp_size=tp, sequence_parallel=sp, moe_columns=(0,))
            assert torch.equal(rs.rows(ids, index), want), (c, t)
            assert torch.equal(rs.tokens(routes, index)[:, 0, 0], want) and \
                torch.equal(rs.tokens(routes, index)[:, 0, 1], want + 1000)


@pytest.fixture
def thd_packing(monkeypatch):
    """A THD packing as the trainer builds it under CP=2 (slots aligned to 2 * cp); megatron's PackedSeqParams
    is plain Python, so the THD layout builds without TE."""
    from mrl.megatron import packing

    monkeypatch.setattr(packing, "HAVE_TE", True)
    plans = packing.pack_micro_batches([7, 13, 4, 9, 2], dp_size=1, dp_rank=0, row_len=padded_len(16, tp=2, cp=2),
                                       rows_per_micro_batch=4, fmt="thd", align=4)
    monkeypatch.undo()
    assert len(plans) == 1
    return plans[0][1]


@pytest.mark.parametrize("cp", [2])
def test_packed_thd_split_is_megatrons_per_document_split(monkeypatch, thd_packing, cp):
    """megatron's per-document path (``_get_batch_on_this_cp_rank_per_document_balancing``), TE's kernel replaced
    by its rule (module docstring): per segment (sample slot, row tail) chunks r and 2cp-1-r, segments in order."""
    pk = thd_packing
    cu = pk.cu_seqlens_padded
    assert all(int(n) % (2 * cp) == 0 for n in (cu[1:] - cu[:-1]))  # every slot and tail aligned
    total = pk.grid[1]
    for rank in range(cp):
        group = _fake_cp_group(monkeypatch, cp, rank)
        monkeypatch.setattr(cpm, "HAVE_TE", True)
        import megatron.core.utils as mutils

        monkeypatch.setattr(mutils, "tex", SimpleNamespace(thd_get_partitioned_indices=_te_partitioned_indices))
        index = megatron_positions(total, cu, group)
        monkeypatch.undo()
        assert index.tolist() == zigzag_positions(total, cp, rank, cu).tolist()
        group = _fake_cp_group(monkeypatch, cp, rank)  # without TE: the rule itself, the same positions
        assert megatron_positions(total, cu, group).tolist() == index.tolist()
        monkeypatch.undo()
        for (start, slot, _) in pk.segments():  # each rank holds half a chunk pair of every segment
            mine = [p for p in index.tolist() if start <= p < start + slot]
            chunk = slot // (2 * cp)
            assert mine == [*range(start + rank * chunk, start + (rank + 1) * chunk),
                            *range(start + (2 * cp - 1 - rank) * chunk, start + (2 * cp - rank) * chunk)]


def test_a_segment_that_does_not_split_is_named(monkeypatch):
    group = _fake_cp_group(monkeypatch, 2, 0)
    with pytest.raises(cpm.ContextParallelError, match="segment of 6 positions not divisible by 2\\*cp=4"):
        megatron_positions(16, torch.tensor([0, 6, 16]), group)
    with pytest.raises(cpm.ContextParallelError, match="not divisible by 2\\*cp=4"):
        CPSplit.build(18, None, cpm.GroupInfo(group, 0, 2))


def test_padded_lengths_split_over_cp_and_then_tp():
    assert padded_len(30, tp=1, cp=1) == 30 and padded_len(30, tp=2, cp=1) == 30
    assert padded_len(30, tp=1, cp=2) == 32 and padded_len(30, tp=2, cp=2) == 32 and padded_len(33, tp=2, cp=2) == 40
    for n, tp, cp in [(37, 2, 2), (100, 4, 2), (17, 1, 4), (64, 2, 4)]:
        s = padded_len(n, tp=tp, cp=cp)
        assert s >= n and s % (2 * cp) == 0 and (s // cp) % tp == 0


# -- the gather, in one process: every rank's all_gather answered with the ranks' locals -----------------------

class _Ranks:
    """``dist.all_gather`` for simulated CP ranks: the parts are the ranks' values, the caller's own tensor in
    its own slot (so autograd sees exactly what a real rank would)."""

    def __init__(self, locals_by_rank: list[torch.Tensor], rank: int):
        self.locals, self.rank = locals_by_rank, rank

    def __call__(self, parts, x, group=None):
        for r, p in enumerate(parts):
            p.copy_(x if r == self.rank else self.locals[r].to(x.dtype))


def _splits(s: int, cp: int, cu=None) -> list[CPSplit]:
    """Every simulated rank's split (what ``CPSplit.build`` makes on that rank)."""
    pos = [zigzag_positions(s, cp, r, cu) for r in range(cp)]
    return [CPSplit(index=pos[r], order=torch.cat(pos), group=None, size=cp, rank=r) for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3])
def test_gather_puts_every_rank_back_in_sequence_order(monkeypatch, cp):
    b, s = 2, 24
    full = torch.randn(b, s, 5)
    splits = _splits(s, cp)
    locals_ = [sp.split(full) for sp in splits]
    for r, sp in enumerate(splits):
        mask = full[..., 0] > 0
        monkeypatch.setattr(dist, "all_gather", _Ranks([q.split(mask) for q in splits], r))
        assert torch.equal(sp.gather(sp.split(mask)), mask)  # bool, as uint8 on the wire
        monkeypatch.setattr(dist, "all_gather", _Ranks(locals_, r))
        assert torch.equal(sp.gather(locals_[r]), full)
        x = locals_[r].clone().requires_grad_(True)
        upstream = torch.randn(b, s, 5)
        (sp.gather(x) * upstream).sum().backward()
        assert torch.equal(x.grad, sp.split(upstream))  # this rank's positions of the gradient, nothing else


def _policy_case():
    """A hand batch: 3 sequences of different lengths in a [3, 16] row layout, a position-wise model (token
    and position embeddings into a 12-word vocabulary) so that a CP rank's logits depend on its positions
    only, as they do through CP attention."""
    g = torch.Generator().manual_seed(3)
    b, s, v = 3, 16, 12
    ids = torch.randint(0, v, (b, s), generator=g)
    mask = torch.zeros(b, s - 1)
    for row, (p, n) in enumerate([(3, 12), (5, 15), (2, 6)]):  # prompt tokens, sequence length
        mask[row, p - 1:n - 1] = 1.0
    mask[1, 8] = 0.0  # a tool-output token inside a response
    data = {"mask": mask, "behav": -torch.rand(b, s - 1, generator=g) - 1.0,
            "adv": torch.tensor([1.0, -0.5, 2.0]), "ref": -torch.rand(b, s - 1, generator=g) - 1.0}
    params = (torch.randn(v, v, generator=g), torch.randn(s, v, generator=g))
    return ids, data, params, v


def _logprobs_at(params, ids, positions, targets):
    emb, pos = params
    return torch.log_softmax(emb[ids] + pos[positions], -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


CASES = {
    "grpo token_mean": dict(),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean"),
    "dr_grpo seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm", max_response_len=16),
    "gspo": dict(loss="gspo", aggregation="seq_mean_token_mean"),
    "mis sequence_product + kl": dict(correction="mis", correction_level="sequence_product", mis_high=1.0,
                                      kl_coef=0.1),
    "tis sequence_geomean": dict(correction="tis", correction_level="sequence_geomean"),
}
ENUMS = {"aggregation": "Aggregation", "loss": "LossType", "correction": "Correction",
         "correction_level": "CorrectionLevel"}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cp", [2, 4])
def test_loss_and_gradient_equal_cp1(monkeypatch, case, cp):
    """Every rank scores its positions, gathers, and computes the loss of the whole batch: the loss and every
    metric equal CP=1's on every rank, and the ranks' gradients sum to CP=1's (megatron's schedule times cp
    and DDP's mean over DP x CP make that sum)."""
    from mrl.algo import compute_policy_loss
    from mrl.config import schema

    algo = schema.AlgoConfig(**{k: getattr(schema, ENUMS[k])(v) if k in ENUMS else v for k, v in CASES[case].items()})
    ids, data, params, v = _policy_case()
    b, s = ids.shape
    old = data["behav"] + 0.05 * torch.randn(b, s - 1, generator=torch.Generator().manual_seed(1))

    def loss_of(lp):
        return compute_policy_loss(lp, old, data["behav"], data["adv"], data["mask"], algo, ref_logp=data["ref"])

    ref_params = [p.clone().requires_grad_(True) for p in params]
    positions = torch.arange(s).expand(b, s)
    want_loss, want_metrics = loss_of(_logprobs_at(ref_params, ids, positions, next_tokens(ids))[:, :-1])
    want_loss.backward()

    splits = _splits(s, cp)
    with torch.no_grad():
        locals_ = [_logprobs_at(params, sp.split(ids), sp.split(positions), sp.split(next_tokens(ids)))
                   for sp in splits]
    grads = [torch.zeros_like(p) for p in params]
    for r, sp in enumerate(splits):
        monkeypatch.setattr(dist, "all_gather", _Ranks(locals_, r))
        mine = [p.clone().requires_grad_(True) for p in params]
        lp = sp.gather(_logprobs_at(mine, sp.split(ids), sp.split(positions), sp.split(next_tokens(ids))))[:, :-1]
        loss, metrics = loss_of(lp)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
        assert metrics.keys() == want_metrics.keys()
        for k in metrics:
            torch.testing.assert_close(metrics[k], want_metrics[k], rtol=0, atol=1e-6, msg=k)
        loss.backward()
        for acc, p in zip(grads, mine):
            acc += p.grad
    for got, p in zip(grads, ref_params):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)


# -- layouts with CP: config validation and the preflight -------------------------------------------------------

GOOD_LAYOUTS = {  # (overrides of ParallelConfig, world size): dense tp*cp*pp*dp, experts ep*etp*pp*edp
    "cp2": (dict(cp=2), 2),
    "cp2 x dp2": (dict(cp=2), 4),
    "cp2 x tp2": (dict(cp=2, tp=2), 4),
    "cp2 x ep2 (EP across the CP ranks)": (dict(cp=2, ep=2), 2),
    "cp2 x ep4": (dict(cp=2, ep=4), 4),
    "cp2 x pp2": (dict(cp=2, pp=2), 4),
    "cp2 x tp2 x ep2 x etp1 x pp2": (dict(cp=2, tp=2, ep=2, etp=1, pp=2), 8),
    "cp4 x tp2 x ep8 x etp1": (dict(cp=4, tp=2, ep=8, etp=1), 8),
}

BAD_LAYOUTS = {  # (overrides, world size, the key named, what the line says)
    "cp2 x tp2 on 2 ranks": (dict(cp=2, tp=2), 2, "parallel.tp/pp/cp", "tp*pp*cp = 2*1*2 = 4"),
    "cp2 on 3 ranks": (dict(cp=2), 3, "parallel.tp/pp/cp", "world size 3 is not divisible by tp*pp*cp"),
    "cp2 x pp2 on 2 ranks": (dict(cp=2, pp=2), 2, "parallel.tp/pp/cp", "tp*pp*cp = 1*2*2 = 4"),
    "cp2 x ep4 on 2 ranks": (dict(cp=2, ep=4), 2, "parallel.ep/etp/pp", "ep*etp*pp = 4*1*1 = 4"),
    "cp2 x ep2 x pp2 on 6 ranks": (dict(cp=2, ep=2, pp=2), 6, "parallel.tp/pp/cp", "tp*pp*cp = 1*2*2 = 4"),
    "cp2 x tp2 without sequence parallelism": (dict(cp=2, tp=2, sequence_parallel=False), 4,
                                               "parallel.sequence_parallel", "must be true"),
    "cp0": (dict(cp=0), 1, "parallel.cp", "must be >= 1"),
}


@pytest.mark.parametrize("name", sorted(GOOD_LAYOUTS))
def test_layouts_with_cp_that_megatron_builds_pass(name):
    from mrl.config.schema import ParallelConfig

    kw, world = GOOD_LAYOUTS[name]
    p = ParallelConfig(**kw, world_size=world)
    p.check_world_size(world)
    assert world % p.model_parallel_size == 0 and p.local_world_size == world
    assert p.check_model(num_experts=8, num_layers=4, num_query_groups=4) is None


@pytest.mark.parametrize("name", sorted(BAD_LAYOUTS))
def test_layouts_with_cp_that_cannot_be_built_name_the_keys(name):
    from mrl.config.schema import ParallelConfig

    kw, world, key, says = BAD_LAYOUTS[name]
    with pytest.raises(ValueError) as e:
        ParallelConfig(**kw, world_size=world)
    assert str(e.value).startswith(key + ":") and says in str(e.value), str(e.value)


def test_cp_with_fp32_is_refused_by_the_config():
    from mrl.config.load import compose

    with pytest.raises(ValueError, match="parallel.cp: =2 with model.dtype=fp32: .*bf16 only"):
        compose(["parallel.cp=2", "parallel.world_size=2"])
    assert compose(["parallel.cp=2", "parallel.world_size=2", "model.dtype=bf16"]).parallel.cp == 2


def test_the_preflight_refuses_cp_where_it_cannot_run(monkeypatch):
    """No Transformer Engine, or TE and no GPU: one line naming parallel.cp, from the cheap checks (no torch
    import); TE and a GPU pass; under ``mrl launch`` the nodes check."""
    import glob
    import importlib.util

    from mrl import preflight
    from mrl.config.load import compose

    cfg = compose(["parallel.cp=2", "parallel.world_size=2", "model.dtype=bf16"])
    real = importlib.util.find_spec

    def host(te: bool, gpu: bool):
        def find_spec(name, *a):
            return (object() if te else None) if name == "transformer_engine" else real(name, *a)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if gpu and "nvidia" in pattern else [])

    host(te=False, gpu=True)
    assert preflight.check_context_parallel(cfg, preflight.LOCAL) == (
        "parallel.cp=2: context parallelism needs Transformer Engine attention (megatron's local attention "
        "supports parallel.cp=1 only) and transformer_engine is not installed; install it (pip install -e "
        "'.[gpu]') or set parallel.cp=1")
    assert preflight.check_context_parallel(cfg, preflight.SUBMIT) is None
    host(te=True, gpu=False)
    assert preflight.check_context_parallel(cfg, preflight.LOCAL).startswith(
        "parallel.cp=2: context parallelism runs Transformer Engine's attention on GPUs and this host has none")
    host(te=True, gpu=True)
    assert preflight.check_context_parallel(cfg, preflight.LOCAL) is None
    assert preflight.check_context_parallel(compose([]), preflight.LOCAL) is None
    host(te=False, gpu=False)
    assert preflight.check_context_parallel in preflight.CHEAP
    lines = [m for c in preflight.CHEAP[:3] if (m := c(cfg, preflight.LOCAL))]
    assert len(lines) == 1 and lines[0].startswith("parallel.cp=2: "), lines


def test_mrl_check_refuses_cp_in_seconds(tmp_path):
    """The issue's example: ``mrl check parallel.cp=2 parallel.world_size=2`` passed and the refusal came at the
    first train step; now the config names parallel.cp (fp32, the default) and nothing is written."""
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    mrl = os.path.join(os.path.dirname(sys.executable), "mrl")
    t0 = time.perf_counter()
    p = subprocess.run([mrl, "check", "parallel.cp=2", "parallel.world_size=2", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 1, p.stderr[-2000:]
    assert "parallel.cp: =2 with model.dtype=fp32" in p.stderr, p.stderr[-2000:]
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "run").exists()


def test_the_trainer_refuses_cp_where_te_attention_cannot_run(monkeypatch):
    """The process that would build megatron's config (``model.transformer_config``) refuses as the preflight
    does: without TE, or without a GPU; with both it builds."""
    from mrl.config.schema import ParallelConfig

    p = ParallelConfig(cp=2, world_size=2)
    for te, gpu, says in [(False, True, "transformer_engine is not installed"), (True, False, "this host has none")]:
        monkeypatch.setattr(cpm, "HAVE_TE", te)
        monkeypatch.setattr(cpm.compat, "HAS_CUDA", gpu)
        with pytest.raises(cpm.ContextParallelError, match=says):
            cpm.check_runnable(p)
        cpm.check_runnable(ParallelConfig())
    monkeypatch.setattr(cpm, "HAVE_TE", True)
    monkeypatch.setattr(cpm.compat, "HAS_CUDA", True)
    assert cpm.check_runnable(p) is None
