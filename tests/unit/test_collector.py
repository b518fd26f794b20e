"""train.gc_freeze / train.gc_interval: what the trainer does to Python's garbage collector. Each case
runs in its own interpreter: freezing and disabling the collector are process-wide."""

import json
import subprocess
import sys

import pytest

from mrl.config.load import compose

_PROBE = r"""
import gc, json, sys
from mrl.megatron.collector import StepCollector

freeze, interval = sys.argv[1] == "1", int(sys.argv[2])
junk = [[i] for i in range(50000)]  # alive at setup: frozen with freeze, scanned by every full collection without
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
c = StepCollector(freeze=freeze, interval=interval)
c.after_setup()
setup = {"frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}
full.clear()
steps = []
for _ in range(6):
    before = len(full)
    c.after_step()
    steps.append(len(full) - before)
print(json.dumps({**setup, "full_collections_per_step": steps}))
"""


def _probe(freeze: bool, interval: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, "1" if freeze else "0", str(interval)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_defaults_freeze_the_setup_heap_and_keep_pythons_schedule():
    cfg = compose([])
    assert cfg.train.gc_freeze is True and cfg.train.gc_interval == 0
    out = _probe(True, 0)
    assert out["frozen"] >= 50000  # the setup's objects left every later collection
    assert out["enabled"] and out["full_collections_per_step"] == [0] * 6


def test_an_interval_collects_between_steps_on_schedule_only():
    out = _probe(False, 3)
    assert out["frozen"] < 50000 and not out["enabled"]  # nothing of the setup's frozen
    assert out["full_collections_per_step"] == [0, 0, 1, 0, 0, 1]


def test_a_negative_interval_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="train.gc_interval: must be >= 0"):
        compose(["train.gc_interval=-1"])
