"""bench/export_time.py's whole flow on CPU with the tiny model: a trainer process loads the random HF checkpoint
into ``Policy``, initializes Adam's states and saves as the loop does; ``mrl export`` of that checkpoint gives
back the HF checkpoint's tensors exactly (fp32 trainer: bf16's exact widening), and the report records it."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.dist


def test_the_bench_round_trips_the_tiny_model_bit_for_bit(tmp_path):
    r = subprocess.run([sys.executable, "bench/export_time.py", "--cpu", "--shape", "tiny", "--shard-gb", "0.0001",
                        "--reps", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=400,
                       env=dict(os.environ, OMP_NUM_THREADS="1",
                                PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)))
    assert r.returncode == 0, r.stderr[-4000:]
    (report,) = glob.glob(str(tmp_path / "*_export_time_tiny_l3_adam_cpu*.json"))
    d = json.loads(open(report).read())
    assert d["round_trip_bitwise"] and d["goal"]["met"] is None  # the goal is the 30B slice's on a GPU
    (rep,) = d["reps"]
    assert rep["check"]["tensors"] == 102 and rep["check"]["dtypes"] == ["bfloat16->float32"]
    assert rep["bytes"] == 2 * d["model"]["hf_tensor_bytes"]  # fp32 out of a bf16 source
    assert rep["launcher_s"] + rep["ranks_s"] + rep["exit_s"] == pytest.approx(rep["wall_s"])
    # Adam's states are in the checkpoint: two fp32 moments and the fp32 param per weight, beside the weights
    assert d["trainer"]["checkpoint_bytes"] > 3.5 * rep["bytes"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("export_", "copy_")) and not p.endswith(".log")]
