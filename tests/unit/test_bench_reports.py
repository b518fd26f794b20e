"""Benchmark reports land in their topic's folder: ``bench/reports/<topic>/<date>_<name>.json``, the topic
taken from the report's name by one table (``bench/_bench_common.TOPICS``)."""

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import _bench_common  # noqa: E402


@pytest.mark.parametrize("name,topic", [
    ("rl_step_vs_megatron_qwen3_30b_a3b_l12_2xH200", "rl_step"), ("rl_step_vs_bare_cpu2core", "rl_step"),
    ("micro_batches", "rl_step"), ("gc_pause", "rl_step"), ("batch_delivery_cpu2core", "rl_step"),
    ("fwd_bwd_layouts_cpu2core", "rl_step"), ("async_vs_sync_cpu", "loop"), ("rollout_throughput_cpu", "rollouts"),
    ("routes_decode_cpu", "rollouts"), ("weight_sync_4xH200_gpu", "weight_sync"), ("lora_sync_cpu", "weight_sync"),
    ("weight_sync_inflight_1xH100", "weight_sync"),
    ("replay_overhead_2xH200", "keep_routing"), ("packing_cpu2core", "keep_routing"),
    ("routing_mismatch_1xH200", "keep_routing"), ("sampling_mask_payload", "keep_routing"),
    ("image_build_cpu", "image"),
])
def test_topic_of_a_report_name(name, topic):
    assert _bench_common.topic(name) == topic


def test_a_name_without_a_topic_is_refused():
    with pytest.raises(ValueError, match="TOPICS"):
        _bench_common.topic("something_new")


def _dump_names():
    """The name each bench passes to ``dump(..., name=...)``: its literal text up to the first ``{...}``."""
    bench = os.path.join(ROOT, "bench")
    for f in sorted(os.listdir(bench)):
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(bench, f)).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dump":
                (kw,) = [k for k in node.keywords if k.arg == "name"]
                v = kw.value
                if isinstance(v, ast.JoinedStr):
                    v = v.values[0]
                assert isinstance(v, ast.Constant), f"{f}: dump's name must start with literal text"
                yield f, v.value


def test_every_bench_report_name_has_a_topic():
    names = list(_dump_names())
    assert len(names) >= 14
    for f, name in names:
        assert _bench_common.topic(name), f


def test_dump_writes_into_the_topic_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_bench_common, "REPORTS", str(tmp_path))
    path = _bench_common.dump({"bench": "gc_pause", "x": 1}, None, name="gc_pause")
    assert os.path.dirname(path) == str(tmp_path / "rl_step")
    assert os.path.basename(path).endswith("_gc_pause.json")


def test_every_report_lies_in_a_topic_folder():
    reports = os.path.join(ROOT, "bench", "reports")
    loose = [f for f in os.listdir(reports) if os.path.isfile(os.path.join(reports, f))]
    assert loose == [], f"reports outside a topic folder: {loose}"


def test_the_inflight_pause_counts_only_requests_generating_across_the_sync():
    """A request's pause is its longest wait for a token around the sync, less one decode step; one that had
    ended before the sync (or began after it) saw none and is left out, not counted as an error."""
    from _inflight_worker import Stream

    s = Stream(None, [1], 8, "r")
    s.arrivals = [(0.0, 1), (0.1, 2), (0.2, 3), (1.2, 4), (1.3, 5)]  # a 1 s wait across the sync at [0.5, 0.9]
    assert s.pause(0.5, 0.9) == pytest.approx(1.0 - 0.1)
    done = Stream(None, [1], 3, "d")
    done.arrivals = [(0.0, 1), (0.1, 2), (0.2, 3)]  # ended before the sync
    assert done.pause(0.5, 0.9) is None
