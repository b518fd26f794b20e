"""mrl's own messages (``mrl.log``): on rank 0's console only, info on stdout and warnings on stderr, every
rank's in its own log file; the console line shows ``-`` for a figure without a value and which side bounds
the run."""

from __future__ import annotations

import math
import os
import subprocess
import sys

_PROBE = """
import sys
from mrl.console import route_library_output
from mrl.log import get_logger
route_library_output(sys.argv[1], int(sys.argv[2]))
log = get_logger("mrl.trainer.loop")
log.info("INFO-LINE %d", 7)
log.warning("WARN-LINE")
"""


def _run(tmp_path, rank: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | {"RANK": str(rank)}
    return subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), str(rank)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_rank_zero_shows_info_on_stdout_and_warnings_on_stderr(tmp_path):
    p = _run(tmp_path, 0)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["[mrl] INFO-LINE 7"]
    assert p.stderr.splitlines() == ["[mrl] WARN-LINE"]
    log = open(tmp_path / "logs" / "rank0.log").read()
    assert "INFO mrl.trainer.loop: INFO-LINE 7" in log and "WARNING mrl.trainer.loop: WARN-LINE" in log


def test_other_ranks_are_silent_on_the_console_but_keep_their_messages_in_their_file(tmp_path):
    p = _run(tmp_path, 1)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == "" and p.stderr == ""
    log = open(tmp_path / "logs" / "rank1.log").read()
    assert "INFO-LINE 7" in log and "WARN-LINE" in log
    assert not (tmp_path / "logs" / "rank0.log").exists()


def test_the_rank_of_an_initialised_process_group_wins_over_the_environment(monkeypatch):
    import types

    from mrl import log

    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 3)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setenv("RANK", "0")
    assert log.console_rank() == 3
    fake.is_initialized = lambda: False
    assert log.console_rank() == 0
    monkeypatch.delenv("RANK")
    assert log.console_rank() == 0


def test_a_figure_without_a_value_shows_as_a_dash():
    from mrl.metrics import shown

    assert shown(float("nan"), ".1e") == "-" and shown(None, ".3f") == "-"
    assert shown(0.0, ".3f") == "0.000" and shown(2.5e-3, ".1e") == "2.5e-03" and shown(math.inf, ".2f") == "inf"


def test_the_progress_line_has_dashes_for_empty_categories_and_names_the_bound(tmp_path, capsys):
    """Without a terminal the line is logged every ``PLAIN_EVERY`` steps and at the last."""
    from mrl.metrics import MISMATCH_KL, MetricsLog

    log = MetricsLog(str(tmp_path), total=2)
    log.plain = True
    row = {"reward": 0.5, "version": 2, "step_seconds": 1.0, "wait_seconds": 0.5,
           MISMATCH_KL[0]: 1e-13, MISMATCH_KL[1]: float("nan")}  # routing: no tokens; stale: not logged
    try:
        log.step(2, row)
    finally:
        log.jsonl.close()
        for lg in log.loggers:
            lg.close()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[mrl] step 2/2")]
    assert "dis -" in line and "kl num/rt/stale 1.0e-13/-/-" in line and "nan" not in line
    assert line.endswith("engine-bound  step 1.00s"), line


def test_which_side_bounds_the_run():
    from mrl.metrics import BOUND_STEPS, bound_by

    def rows(wait: float, n: int = BOUND_STEPS) -> list[dict]:
        return [{"step": i, "step_seconds": 1.0, "wait_seconds": wait} for i in range(n)]

    assert bound_by([]) is None and bound_by([{"step": 1, "eval/accuracy": 0.5}]) is None
    assert bound_by(rows(0.01)) == "trainer-bound"  # the batch was ready: taking it cost 1% of the step
    assert bound_by(rows(0.3)) == "engine-bound"
    assert bound_by(rows(0.9, 50) + rows(0.0)) == "trainer-bound"  # only the recent steps count
    assert bound_by(rows(0.3), "sync") == "trainer-bound"  # sync mode: generation took under half the step
    assert bound_by(rows(0.6), "sync") == "engine-bound"
