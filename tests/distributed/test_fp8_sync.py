"""FP8 weight sync over gloo with real megatron-core on CPU (the ``tiny_gpu`` preset: hidden 256, so 128x128
blocks fit): every bucket each sender fills is, byte for byte, the tensors ``mrl export-fp8`` writes for the
same weights (a bf16 copy of the checkpoint exported), in the plan's entry order, for TP1 (data-parallel
over both ranks), TP2 (expert-TP2) and EP2.

The worker is this file run under torchrun (``python -m tests.distributed.test_fp8_sync``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests.conftest import run_torchrun, write_every_ranks_rows

pytestmark = pytest.mark.dist

LAYOUTS = ["tp=1", "tp=2", "ep=2"]


@pytest.fixture(scope="module")
def rows(ckpt_dir, tmp_path_factory) -> list[dict]:
    from safetensors.torch import load_file, save_file

    from mrl.quant.export import export_fp8

    root = tmp_path_factory.mktemp("fp8_sync")
    src, bf16 = ckpt_dir["tiny_gpu"], root / "bf16"
    shutil.copytree(src, bf16, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(bf16 / "model.safetensors"))
    export_fp8(str(bf16), str(root / "fp8"), log=lambda *_: None)
    out = root / "rows.json"
    r = run_torchrun("tests.distributed.test_fp8_sync", ["--hf", src, "--fp8", str(root / "fp8"), "--out", str(out),
                                                         "--layouts", *LAYOUTS], 2, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sender_buckets_are_the_fp8_exports_tensors(rows, layout):
    mine = [r for r in rows if r["layout"] == layout]
    assert mine and all(r["equal"] for r in mine), [r for r in mine if not r["equal"]][:3]
    assert any(r["fp8"] for r in mine) and not any(r["inplace"] for r in mine if r["fp8"])
    sent = {n for r in mine for n in r["names"]}
    from safetensors import safe_open

    with safe_open(mine[0]["fp8_file"], "pt") as f:
        assert sent == set(f.keys())  # every tensor of the export, once (both senders together under EP2)
    assert sum(len(r["names"]) for r in mine) == len(sent)
    if layout == "ep=2":
        assert len({r["sender"] for r in mine}) == 2


def check_layout(a, text: str, fp8_dir: str) -> list[dict]:
    from safetensors.torch import load_file

    from mrl.jobs.common import load_model
    from mrl.weight_sync.executor import BucketExecutor
    from tests.jobs.parity import parse_layout

    m = load_model(parse_layout(text, a.hf))
    ex = BucketExecutor(model=m.model, layout=m.layout, bridge=m.bridge, padded_vocab=m.padded_vocab,
                        engines=[], bucket_bytes=256 << 10, dtype="bfloat16", fp8=True)
    ex.place_buckets()  # collective; nothing of an FP8 bucket may go in place
    ref = load_file(os.path.join(fp8_dir, "model.safetensors"))
    out = []
    for step in ex.steps():
        step.fill()
        if step.flat is None:
            continue
        want = torch.cat([ref[t.name].contiguous().view(-1).view(torch.uint8) for t in step.bucket.tensors])
        out.append(dict(layout=text, bucket=step.bucket.index, sender=step.bucket.sender,
                        fp8=step.quantize is not None, inplace=step.in_place,
                        names=[t.name for t in step.bucket.tensors],
                        fp8_file=os.path.join(fp8_dir, "model.safetensors"),
                        equal=bool(want.numel() == step.flat.numel() and torch.equal(want, step.flat))))
    ex.release_buffers()
    return out


def main() -> None:
    import argparse

    from mrl.megatron.parallel import destroy

    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--fp8", required=True)
    ap.add_argument("--layouts", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows: list[dict] = []
    for text in a.layouts:
        rows += check_layout(a, text, a.fp8)
    write_every_ranks_rows(rows, a.out)
    destroy()


if __name__ == "__main__":
    sys.exit(main())
