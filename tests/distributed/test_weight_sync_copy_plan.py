"""The executor's static copy plan writes, bit for bit, the bytes of the per-tensor path (gather the
full tensor, ``split_full``, cast, concatenate) for every bucket, in TP1 / TP2 (expert-TP2) / EP2 /
TP2xEP2 / PP2 layouts over gloo -- on first use, when replayed after the weights changed in place,
and after a param's storage moved (the plan is rebuilt) -- with the shards sent point to point, one
transfer per group and in several chunks per bucket. Then
with the params in megatron's DDP parameter buffer (as the trainer holds them): the in-place buckets
are views of that buffer (no copy) with the same bytes, and copies again once the params moved.

The worker is this file run under torchrun (``python -m tests.distributed.test_weight_sync_copy_plan``), every
layout in turn within one 2-process launch (TP1 runs data-parallel over both).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import pytest
import torch

from tests.conftest import run_torchrun, write_every_ranks_rows

pytestmark = pytest.mark.dist

LAYOUTS = {"tp1": "tp=1", "tp2": "tp=2", "ep2": "ep=2", "tp2ep2": "tp=2,ep=2,etp=1", "pp2": "pp=2"}


@pytest.fixture(scope="module")
def rows_by_layout(ckpt_dir, tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("copy_plan") / "rows.json"
    r = run_torchrun("tests.distributed.test_weight_sync_copy_plan",
                     ["--hf", ckpt_dir["stress_a"], "--out", str(out), "--layouts", *LAYOUTS.values()], 2, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {name: [row for row in rows if row["layout"] == text] for name, text in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_copy_plan_bytes_equal_the_per_tensor_path(rows_by_layout, name):
    rows = rows_by_layout[name]
    assert rows and all(row["equal"] for row in rows), [row for row in rows if not row["equal"]][:3]
    checked = {(row["config"], row["dtype"], row["phase"]) for row in rows if row["config"] != "ddp"}
    assert checked == {(f"chunk/{c}", d, p) for c in CHUNK_KIB for d in ("float32", "bfloat16")
                       for p in ("first", "changed", "moved")}
    if name in ("tp2", "tp2ep2"):  # TP shards travel (EP2, PP2 gather nothing): in chunks where asked
        most = {}
        for row in rows:
            most[row["config"]] = max(most.get(row["config"], 0), row["max_transfers"])
        assert most["chunk/8"] > most["chunk/0"] >= 1, most
    buckets = {row["bucket"] for row in rows}
    assert len(buckets) >= 4  # several buckets per sender: both send buffers are used
    ddp = [row for row in rows if row["config"] == "ddp"]
    assert {(row["dtype"], row["phase"]) for row in ddp} == {(d, p) for d in ("float32", "bfloat16")
                                                            for p in ("first", "changed", "moved")}
    # fp32 params in the DDP buffer: whole buckets of them go out as views of it; bf16 needs a cast.
    # TP2 (expert-TP2): every big param is TP-split, only small norms are whole on the sender
    inplace = [row for row in ddp if row["inplace"]]
    assert all(row["dtype"] == "float32" for row in inplace)
    if name == "tp2":
        assert not inplace
        return
    assert inplace
    assert all(row["view"] for row in inplace if row["phase"] != "moved")
    assert not any(row["view"] for row in ddp if not row["inplace"])
    # every 3rd param moved to storage of its own: the buckets holding one are copied again
    assert any(not row["view"] for row in inplace if row["phase"] == "moved")
    assert sum(row["nbytes"] for row in inplace if row["phase"] == "first") > 0.4 * sum(
        row["nbytes"] for row in ddp if row["phase"] == "first" and row["dtype"] == "float32"), \
        "the experts at least go in place"


# chunk size of the shard transfers in KiB (0 = one transfer per group and bucket): 8 KiB chunks split
# each 48 KiB bucket into several transfers
CHUNK_KIB = [8, 0]


def _reference(ex, bucket, dtype):
    """The per-tensor path (the executor before the copy plan): full tensors -> HF tensors -> bytes."""
    from mrl.models.bridge import split_full

    gathered = ex.gather_bucket(bucket)
    if gathered is None:
        return None
    return torch.cat([split_full(pm, full)[t.name].to(dtype).contiguous().view(-1).view(torch.uint8)
                      for p, pm, full in gathered for t in p.tensors])


def _check(ex, dtype, phase, rows):
    refs = {b.index * 1000 + b.sender: _reference(ex, b, dtype) for b in ex.order}  # collective, global order
    storages = {lp.param.untyped_storage().data_ptr() for lp in ex.local.values()}
    for step in ex.steps():  # collective too
        step.fill()
        if step.flat is not None:
            ref = refs[step.bucket.index * 1000 + step.bucket.sender]
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), phase=phase, bucket=step.bucket.index,
                             sender=step.bucket.sender, nbytes=step.bucket.nbytes, inplace=step.bucket.inplace,
                             view=step.flat.untyped_storage().data_ptr() in storages,  # no copy: the params' memory
                             equal=bool(ref is not None and ref.numel() == step.flat.numel()
                                        and torch.equal(ref.cpu(), step.flat.cpu()))))


def _phases(ex, tdtype, rows):
    _check(ex, tdtype, "first", rows)
    with torch.no_grad():  # an optimizer step: in place, the cached views see it
        for lp in ex.local.values():
            lp.param.mul_(1.5).add_(0.25)
    _check(ex, tdtype, "changed", rows)
    with torch.no_grad():  # offload and reload: new storage, the plan must notice
        for lp in list(ex.local.values())[::3]:
            lp.param.data = lp.param.data.clone() - 1
    _check(ex, tdtype, "moved", rows)


def check_layout(a, rows: list[dict]) -> None:
    from mrl.jobs.common import load_model
    from mrl.megatron.optim import wrap_ddp
    from mrl.weight_sync.executor import BucketExecutor

    m = load_model(a)  # fresh weights: the phases change them
    for chunk_kib in CHUNK_KIB:
        for dtype in ("float32", "bfloat16"):
            ex = BucketExecutor(model=m.model, layout=m.layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
                                engines=[], bucket_bytes=48 << 10, dtype=dtype, chunk_bytes=chunk_kib << 10)
            phase_rows: list[dict] = []
            _phases(ex, getattr(torch, dtype), phase_rows)
            chunks = max((len(st.gathers) for st in ex.steps()), default=0)
            rows += [dict(r, config=f"chunk/{chunk_kib}", max_transfers=chunks) for r in phase_rows]
            ex.release_buffers()
    model = m.model
    for dtype in ("float32", "bfloat16"):  # the params in a fresh DDP buffer (the trainer's), planned in place
        ddp = wrap_ddp(model, m.cfg)
        ex = BucketExecutor(model=ddp, layout=m.layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
                            engines=[], bucket_bytes=48 << 10, dtype=dtype)
        ex.place_buckets()
        phase_rows = []
        _phases(ex, getattr(torch, dtype), phase_rows)
        rows += [dict(r, config="ddp", max_transfers=0) for r in phase_rows]
        ex.release_buffers()


def main() -> None:
    import argparse

    from mrl.megatron.parallel import destroy
    from tests.jobs.parity import parse_layout

    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--layouts", nargs="+", required=True, help="tp=2,ep=2,... each (tests.jobs.parity)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if os.environ.get("MRL_DUMP_AFTER"):  # diagnosing hangs: every thread's stack, then exit
        faulthandler.dump_traceback_later(int(os.environ["MRL_DUMP_AFTER"]), exit=True)
    rows: list[dict] = []
    for text in a.layouts:
        mine: list[dict] = []
        check_layout(parse_layout(text, a.hf), mine)
        rows += [dict(r, layout=text) for r in mine]
    write_every_ranks_rows(rows, a.out)
    destroy()


if __name__ == "__main__":
    sys.exit(main())
