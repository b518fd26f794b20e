"""bench/cp2_vs_cp1.py (issue 59's GPU job, scripts/gpu/cp2.sh) on a CPU box: both scripts import without a GPU,
refuse bad arguments naming them, plan the two torchrun runs with arguments their worker accepts, and compute
the report's figures from the workers' results."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import _cp_worker  # noqa: E402
import cp2_vs_cp1  # noqa: E402


@pytest.mark.parametrize("argv,says", [
    (["--cp", "1"], "--cp must be >= 2"),
    (["--ep", "3"], "--ep 3 must divide the 2 GPUs"),
    (["--samples", "3"], "--samples 3 must split over the reference's DP of 2"),
    (["--response", "0"], "--response must be >= 1"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--out", "/tmp/report.json"], "the report's file name must contain 'cp2'"),
])
def test_bad_arguments_are_named(capsys, argv, says):
    with pytest.raises(SystemExit):
        cp2_vs_cp1.parse_args(["--work", "/tmp/w", *argv])
    assert says in capsys.readouterr().err


def test_the_plan_is_cp1_then_cp2_on_the_same_gpus_and_batch(capsys):
    a = cp2_vs_cp1.parse_args(["--work", "/tmp/w", "--response", "8192", "--check"])
    (n1, ref), (n2, cp) = cp2_vs_cp1.plan(a, "/m")
    assert n1 == n2 == 2
    r, c = _cp_worker.parse_args(ref), _cp_worker.parse_args(cp)
    assert (r.mode, r.cp, r.ep) == ("reference", 1, 2) and (c.mode, c.cp, c.ep) == ("cp", 2, 2)
    assert r.batch == c.batch and r.response == c.response == 8192 and r.out != c.out
    cp2_vs_cp1.main(["--work", "/tmp/w", "--check"])
    assert capsys.readouterr().out.count("torchrun --nproc-per-node=2 bench/_cp_worker.py") == 2


def test_the_worker_refuses_a_reference_with_cp(capsys):
    with pytest.raises(SystemExit):
        _cp_worker.parse_args(["--hf", "m", "--mode", "reference", "--cp", "2", "--batch", "b", "--out", "o"])
    assert "--mode reference runs CP=1" in capsys.readouterr().err


def test_report_figures_from_the_runs():
    a = cp2_vs_cp1.parse_args(["--work", "/tmp/w"])
    ref = {"route_agreement_replay_on": 1.0, "step_s": 10.0, "peak_memory_gib": 60.0,
           "first_step": {"pg_loss": 0.5, "grad_norm": 2.0}}
    cp = {"route_agreement_replay_on": 0.998, "step_s": 7.0, "peak_memory_gib": 41.0,
          "first_step": {"pg_loss": 0.503, "grad_norm": 2.0}}
    lp_ref = {0: torch.tensor([-1.0, -2.0]), 1: torch.tensor([-0.5])}
    lp_cp = {0: torch.tensor([-1.0, -2.25]), 1: torch.tensor([-0.625])}
    r = cp2_vs_cp1.compare(a, ref, cp, lp_ref, lp_cp)
    assert r["max_abs_logprob_diff_vs_cp1"] == 0.25 and r["mean_abs_logprob_diff_vs_cp1"] == 0.125
    assert r["response_tokens_compared"] == 3
    assert (r["route_agreement_replay_on"], r["step_s"], r["peak_memory_gib"]) == (0.998, 7.0, 41.0)
    assert (r["step_s_cp1"], r["peak_memory_gib_cp1"]) == (10.0, 60.0)
    assert r["first_step_vs_cp1"]["pg_loss"]["abs_diff"] == pytest.approx(0.003)
    with pytest.raises(SystemExit, match="different samples"):
        cp2_vs_cp1.compare(a, ref, cp, lp_ref, {0: lp_cp[0]})
