"""The statistic bench/rl_step_vs_megatron.py reports, fixed in advance: per layout, the median of per-pair
ratios over ABBA pairs (timed step i of an mrl process against timed step i of its neighbouring megatron
process), with p25-p75 and every ratio; too few pairs refused before anything runs."""

import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from rl_step_vs_megatron import (abba_pairs, check_pair_count, expected_pairs, host_state,  # noqa: E402
                                 pair_line)


def _runs(rounds, meg, mrl):
    """Synthetic runs in ABBA order; ``meg(r, j, i)`` / ``mrl(r, j, i)``: step i of the j-th process of
    that side in round r."""
    out = []
    for r in range(rounds):
        for pos, side in enumerate(("megatron", "mrl", "mrl", "megatron")):
            j = 0 if pos in (0, 1) else 1
            f = meg if side == "megatron" else mrl
            out.append({"round": r, "side": side, "step_s": [f(r, j, i) for i in range(4)]})
    return out


def test_pairs_neighbouring_processes_step_by_step():
    # megatron step = 1 + r + j/10 + i/100; mrl = 2x that of its neighbour in the first half of a round,
    # 4x in the second: a pairing across neighbours or steps would give other ratios
    runs = _runs(2, lambda r, j, i: 1 + r + j / 10 + i / 100,
                 lambda r, j, i: (1 + r + j / 10 + i / 100) * (2 if j == 0 else 4))
    s = abba_pairs(runs)
    assert s["n_pairs"] == 16 == expected_pairs(4, 2)
    assert sorted(set(round(p, 12) for p in s["pairs"])) == [0.25, 0.5]
    assert s["index"][:5] == [[0, 1, 0], [0, 1, 1], [0, 1, 2], [0, 1, 3], [3, 2, 0]]
    assert s["index"][8] == [4, 5, 0]  # second round
    assert s["median"] == pytest.approx(0.375)  # half the pairs at 0.5, half at 0.25
    assert s["p25"] == pytest.approx(0.25) and s["p75"] == pytest.approx(0.5)
    assert pair_line(s) == "ratio 0.375 (p25-p75 0.250-0.500, 16 pairs)"


def test_one_slow_step_is_one_pair():
    meg = lambda r, j, i: 1.0  # noqa: E731
    mrl = lambda r, j, i: 3.0 if (r, j, i) == (0, 1, 2) else 1.1 + 0.01 * i  # noqa: E731
    runs = _runs(1, meg, mrl)
    s = abba_pairs(runs)
    assert len(s["pairs"]) == 8 and min(s["pairs"]) == pytest.approx(1 / 3)
    assert s["median"] == pytest.approx(statistics.median([1 / (1.1 + 0.01 * i) for i in (0, 1, 2, 3)] +
                                                          [1 / 1.1, 1 / 1.11, 1 / 3.0, 1 / 1.13]))


def test_wrong_order_uneven_steps_and_too_few_pairs_are_refused():
    runs = _runs(1, lambda *_: 1.0, lambda *_: 1.0)
    with pytest.raises(ValueError, match="not in ABBA order"):
        abba_pairs(runs[1:] + runs[:1])
    uneven = [dict(r) for r in runs]
    uneven[2]["step_s"] = uneven[2]["step_s"][:3]
    with pytest.raises(ValueError, match="megatron run 3 timed 4 steps, its mrl neighbour 2 3"):
        abba_pairs(uneven)
    short = [dict(r, step_s=r["step_s"][:3]) for r in runs]  # 6 pairs
    with pytest.raises(ValueError, match="6 ABBA pairs, the statistic needs at least 8"):
        abba_pairs(short)
    assert abba_pairs(short, min_pairs=6)["n_pairs"] == 6


def test_repetition_plan_checked_before_anything_runs():
    check_pair_count(4, 1)  # 8 pairs
    check_pair_count(2, 2)
    with pytest.raises(SystemExit, match="--reps 3 --rounds 1 give 6 ABBA pairs.*at least 8"):
        check_pair_count(3, 1)


def test_host_state_without_cuda_has_the_load_average():
    h = host_state(cuda=False)
    assert len(h["loadavg"]) == 3 and h["gpu_processes"] is None


def test_shape_checkpoint_is_reused_only_when_complete(tmp_path):
    from rl_step_vs_megatron import shape_checkpoint

    path = shape_checkpoint(str(tmp_path), "tiny")
    cfg = os.path.join(path, "config.json")
    first = os.stat(cfg).st_mtime_ns
    assert shape_checkpoint(str(tmp_path), "tiny") == path and os.stat(cfg).st_mtime_ns == first
    os.remove(tmp_path / "tiny.complete")  # as if the run had died while writing it
    open(os.path.join(path, "stray"), "w").close()
    shape_checkpoint(str(tmp_path), "tiny")
    assert not os.path.exists(os.path.join(path, "stray")) and os.path.exists(tmp_path / "tiny.complete")


def test_host_lead_marks_without_cuda_are_ignored_and_with_cuda_ordered():
    import torch
    from _bench_common import HostLead

    lead = HostLead()
    lead.mark("before start")  # ignored
    lead.start()
    if not torch.cuda.is_available():
        lead.mark("forward 0")
        assert lead.stop() == []
        return
    x = torch.randn(2048, 2048, device="cuda")
    lead.mark("forward 0")
    for _ in range(20):  # queued work: the next mark is reached well after the host queued it
        x = x @ x / 2048
    lead.mark("optimizer.step")
    marks = lead.stop()
    assert [m["at"] for m in marks] == ["forward 0", "optimizer.step", "end"]
    assert marks[1]["gpu_ms"] >= marks[0]["gpu_ms"] and marks[1]["lead_ms"] > marks[0]["lead_ms"] - 1.0


def test_spread_quotes_the_median_the_quartiles_and_the_range():
    from _bench_common import spread

    assert spread([4.0, 1.0, 3.0, 2.0, 5.0]) == {"median": 3.0, "p25": 1.5, "p75": 4.5, "min": 1.0, "max": 5.0}
    assert spread([2.0]) == {"median": 2.0, "p25": 2.0, "p75": 2.0, "min": 2.0, "max": 2.0}
