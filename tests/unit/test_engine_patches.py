"""Patches mrl applies inside the SGLang servers it starts (``mrl.engine.server.patches``): compact routes,
on GPU engines (``engine_shim``) and CPU engines (CPU mode's pyshim), without CPU mode's patches on GPUs.
The engines themselves: tests/integration/test_keep_routing.py (routes of a real CPU engine are uint8).
The bench's engine shim on top of them (baselines, per-bucket figures through ``patches.watch``): here too."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from mrl.engine import cpu_mode, gpu_mode
from mrl.engine.server import patches as engine_patches
from mrl.engine.server.patches import ROUTES_MODULE, RUNNER_MODULE, SHIM_DIR, compact_ids
from mrl.sglang.wire import COMPACT_ROUTES_MARK

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
BENCH_SHIM = os.path.join(BENCH, "_engine_shim")


@pytest.mark.parametrize("values,dtype", [([0, 5, 255], torch.uint8), ([0, 256, 32767], torch.int16),
                                          ([0, 32768], torch.int32), ([-1, 3], torch.int32)])
def test_compact_ids_takes_the_smallest_type_that_holds_every_id(values, dtype):
    ids = torch.tensor(values, dtype=torch.int32).reshape(-1, 1, 1)
    out = compact_ids(ids)
    assert out.dtype == dtype and torch.equal(out.to(torch.int64), ids.to(torch.int64))


def test_compact_ids_leaves_anything_else_alone():
    empty = torch.zeros((0, 3, 2), dtype=torch.int32)
    assert compact_ids(empty) is empty and compact_ids(None) is None
    wide = torch.zeros(3, dtype=torch.int64)
    assert compact_ids(wide) is wide


def test_a_missing_target_leaves_sglang_unpatched(capsys):
    engine_patches.compact_routes(types.ModuleType(ROUTES_MODULE))
    assert "routes stay int32" in capsys.readouterr().err


def test_launch_env_has_the_shim():
    assert gpu_mode.gpu_env(base={"PYTHONPATH": "/x"})["PYTHONPATH"] == f"{SHIM_DIR}:/x"


def _probe(code: str, pythonpath: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("BENCH_")}
    mrl_root = os.path.dirname(os.path.dirname(os.path.abspath(engine_patches.__file__)))
    mrl_root = os.path.dirname(os.path.dirname(mrl_root))  # the checkout whose mrl this test imports
    e.update(PYTHONPATH=f"{pythonpath}:{mrl_root}", OMP_NUM_THREADS="1", **env)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


_SGLANG_PROBE = """
import types, torch
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer
cap = object.__new__(RoutedExpertsCapturer)
cap.host_cache = types.SimpleNamespace(buffer=torch.arange(16 * 3 * 2, dtype=torch.int32).reshape(16, 3, 2) % 128)
pool = types.SimpleNamespace(req_to_token=torch.tensor([[9, 2, 7, 4, 0]]))
out = RoutedExpertsCapturer.get_topk(cap, req_pool_idx=0, seqlen=5, req_to_token_pool=pool)
assert out.dtype == torch.uint8, out.dtype
assert torch.equal(out.int(), cap.host_cache.buffer[[9, 2, 7, 4]])
assert type(torch.zeros).__name__ == "builtin_function_or_method"  # CPU mode's pin_memory shim is not here
import sglang.srt.platforms.cpu as p
assert "empty_cache" not in vars(p.CpuDeviceMixin) or p.CpuDeviceMixin.empty_cache.__name__ != "<lambda>"
print("ok")
"""


def test_gpu_engines_get_compact_routes_from_the_real_sglang_capturer_and_no_cpu_patch():
    out = _probe(_SGLANG_PROBE, SHIM_DIR)
    assert out.stdout.strip().endswith("ok") and out.stderr.count(COMPACT_ROUTES_MARK) == 1


_REGISTERED = f"""
import sys
targets = [getattr(f, "target", None) for f in sys.meta_path]
print(targets.count({ROUTES_MODULE!r}), targets.count({RUNNER_MODULE!r}))
"""


@pytest.mark.parametrize("shim", ["gpu", "cpu"])
def test_both_shims_register_the_patches(shim):
    path = SHIM_DIR if shim == "gpu" else cpu_mode.PYSHIM_DIR
    out = _probe(_REGISTERED, path)
    assert out.stdout.split()[-2:] == ["1", "1"]


def test_a_shadowed_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = True\n")
    out = _probe(_REGISTERED + "import builtins\nprint(getattr(builtins, 'SITE_RAN', False))\n",
                 f"{SHIM_DIR}:{tmp_path}")
    assert out.stdout.split()[-3:] == ["1", "1", "True"]


_BENCH_PROBE = _REGISTERED + """
from mrl.engine.server import patches
print(patches.load_stream(type("R", (), {"device": "cuda:0"})()), type(patches.watch).__name__)
"""


@pytest.mark.parametrize("shim", ["gpu", "cpu"])
def test_the_bench_shim_leaves_out_the_baselines_patches_and_installs_its_figures(shim, tmp_path):
    """``bench/_engine_shim`` runs mrl's shim first, then leaves out what ``BENCH_BASELINE`` names (compact routes
    and the load stream here; replayed loads stay) and installs the update figures as the patches' ``watch``."""
    path = SHIM_DIR if shim == "gpu" else cpu_mode.PYSHIM_DIR
    out = _probe(_BENCH_PROBE, f"{BENCH_SHIM}:{path}", BENCH_BASELINE="compact_routes,load_stream",
                 BENCH_SYNC_STATS_DIR=str(tmp_path))
    assert out.stdout.split()[-4:] == ["0", "1", "None", "UpdateStats"]
    plain = _probe(_REGISTERED, f"{BENCH_SHIM}:{path}", BENCH_BASELINE="replayed_load")
    assert plain.stdout.split()[-2:] == ["1", "0"]


# -- every bucket of a sync in one request (patches.BATCHED_BUCKETS_FORMAT) ----------------------------
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            getattr(self, name).data.copy_(w)


class _Runner:
    """What the patch touches of SGLang's ModelRunner: its groups, device, model and the two methods."""

    def __init__(self):
        self._model_update_group = {"g0": None, "g1": None}
        self.device, self.model = "cpu", _Model()

    def init_weights_update_group(self, *args, **kwargs):
        return kwargs.get("ok", True), "Succeeded to initialize custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        return True, "SGLang's own path"

    def _update_bucketed_weights_from_distributed(self, *a):
        raise AssertionError("the patch replaces this path")


def _patched_runner(monkeypatch, arriving):
    """A runner class patched as in an engine; ``arriving``: the flat buffers the broadcasts deliver, in order
    (the collective itself runs in tests/integration/test_weight_sync.py, against real engines)."""
    from mrl.sglang.wire import BATCHED_BUCKETS_FORMAT

    cls = type("ModelRunner", (_Runner,), {})
    engine_patches.replayed_load(types.SimpleNamespace(__name__="fake", ModelRunner=cls))
    received = []

    def receive(runner, dtypes, shapes, group):
        received.append(group)
        return arriving.pop(0)

    monkeypatch.setattr(engine_patches, "_receive", receive)
    return cls(), received, BATCHED_BUCKETS_FORMAT


def _flat(*tensors):
    return torch.cat([t.flatten().view(torch.uint8) for t in tensors])


def test_one_request_loads_every_bucket_in_order(monkeypatch):
    a, b = torch.arange(4.0), torch.arange(6.0).reshape(2, 3) + 10
    runner, received, fmt = _patched_runner(monkeypatch, [_flat(a), _flat(b)])
    ok, msg = runner.update_weights_from_distributed(["a", "b"], ["float32", "float32"], [[4], [2, 3]], "g0",
                                                     load_format=fmt + '[["g0", 1], ["g1", 1]]')
    assert ok and "2 buckets in one request" in msg, msg
    assert received == ["g0", "g1"]
    assert torch.equal(runner.model.a, a) and torch.equal(runner.model.b, b)
    # SGLang's other formats still take SGLang's path
    assert runner.update_weights_from_distributed(["a"], ["float32"], [[4]], "g0") == (True, "SGLang's own path")


def test_a_bucket_that_fails_to_load_still_lets_the_later_ones_arrive(monkeypatch):
    runner, received, fmt = _patched_runner(monkeypatch, [_flat(torch.ones(3)), _flat(torch.ones(6))])
    ok, msg = runner.update_weights_from_distributed(["a", "b"], ["float32", "float32"], [[3], [2, 3]], "g0",
                                                     load_format=fmt + '[["g0", 1], ["g1", 1]]')
    assert not ok and "bucket 0 over g0" in msg and "partially updated" in msg, msg
    assert received == ["g0", "g1"]  # every broadcast was still received: the senders are not left waiting
    assert torch.equal(runner.model.b, torch.ones(2, 3))


@pytest.mark.parametrize("layout", ['[["g0", 2]]', '[["nope", 1]]', "not json"])
def test_a_batch_that_does_not_add_up_is_refused_before_any_receive(monkeypatch, layout):
    runner, received, fmt = _patched_runner(monkeypatch, [])
    ok, msg = runner.update_weights_from_distributed(["a"], ["float32"], [[4]], "g0", load_format=fmt + layout)
    assert not ok and "Failed to update parameter online" in msg and received == []


def test_the_group_answer_announces_batched_buckets_and_kept_layouts(monkeypatch):
    from mrl.sglang.wire import BATCHED_BUCKETS_MARK, KEEPS_LAYOUTS_MARK

    runner, _, _ = _patched_runner(monkeypatch, [])
    answer = runner.init_weights_update_group()[1]
    assert BATCHED_BUCKETS_MARK in answer and KEEPS_LAYOUTS_MARK in answer
    failed = runner.init_weights_update_group(ok=False)[1]
    assert BATCHED_BUCKETS_MARK not in failed and KEEPS_LAYOUTS_MARK not in failed


def test_a_kept_layout_is_sent_once_and_named_by_its_key_after(monkeypatch):
    """``{"key", "layout"}`` keeps the request's lists (the answer says so); ``{"key"}`` with empty lists
    loads the next sync's buckets by them; a key the engine does not hold is refused before any receive."""
    from mrl.sglang.wire import LAYOUT_KEPT_MARK

    a, b = torch.arange(4.0), torch.arange(6.0).reshape(2, 3) + 10
    runner, received, fmt = _patched_runner(monkeypatch, [_flat(a), _flat(b), _flat(a + 1), _flat(b + 1)])
    keep = fmt + json.dumps({"key": "k1", "layout": [["g0", 1], ["g1", 1]]})
    ok, msg = runner.update_weights_from_distributed(["a", "b"], ["float32", "float32"], [[4], [2, 3]], "g0",
                                                     load_format=keep)
    assert ok and msg.endswith(f"{LAYOUT_KEPT_MARK}k1]"), msg
    ok, msg = runner.update_weights_from_distributed([], [], [], "g0", load_format=fmt + '{"key": "k1"}')
    assert ok and LAYOUT_KEPT_MARK not in msg, msg
    assert received == ["g0", "g1", "g0", "g1"]
    assert torch.equal(runner.model.a, a + 1) and torch.equal(runner.model.b, b + 1)
    ok, msg = runner.update_weights_from_distributed([], [], [], "g0", load_format=fmt + '{"key": "other"}')
    assert not ok and "no kept layout 'other'" in msg and received == ["g0", "g1", "g0", "g1"], msg


def test_updates_report_per_bucket_figures_and_profile_on_request(monkeypatch, tmp_path):
    """The bench's figures (``bench/_update_stats.py`` as ``patches.watch``): one JSON line per update with when
    it entered and every bucket's phases, load path and bytes; a ``profile_next.tp0`` file there puts the next
    update under torch.profiler (and is used up); a ``stats_off`` file there turns the figures off."""
    monkeypatch.syspath_prepend(BENCH)
    from _update_stats import STATS_OFF, UpdateStats

    a, b = torch.arange(4.0), torch.arange(6.0).reshape(2, 3) + 10
    runner, _, fmt = _patched_runner(monkeypatch, [_flat(a), _flat(b), _flat(a), _flat(b), _flat(a), _flat(b)])
    monkeypatch.setattr(engine_patches, "watch", UpdateStats(str(tmp_path)))
    (tmp_path / "profile_next.tp0").touch()
    for _ in range(2):
        ok, msg = runner.update_weights_from_distributed(["a", "b"], ["float32", "float32"], [[4], [2, 3]], "g0",
                                                         load_format=fmt + '[["g0", 1], ["g1", 1]]')
        assert ok, msg
    lines = [json.loads(x) for x in (tmp_path / "tp0.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and [x["group"] for x in lines[0]["buckets"]] == ["g0", "g1"]
    first, later = lines[0]["buckets"][1], lines[1]["buckets"][1]
    assert first["bytes"] == 24 and first["tensors"] == 1 and first["path"] == "recorded"
    assert later["path"] == "replayed" and later["copies"] == 1 and later["calls"] == 1
    assert all(later[f"{p}_s"] >= 0 for p in ("wait_free", "receive", "load"))
    assert not (tmp_path / "profile_next.tp0").exists()
    ops = json.loads((tmp_path / "engine_tp0_ops.json").read_text())
    assert ops and (tmp_path / "engine_tp0_trace.json").exists()
    assert lines[0]["entered_at"] <= lines[1]["entered_at"]  # wall clock, paired with the trainer's post
    (tmp_path / STATS_OFF).touch()  # figures off: the update runs, nothing is written
    ok, msg = runner.update_weights_from_distributed(["a", "b"], ["float32", "float32"], [[4], [2, 3]], "g0",
                                                     load_format=fmt + '[["g0", 1], ["g1", 1]]')
    assert ok and len((tmp_path / "tp0.jsonl").read_text().splitlines()) == 2, msg


# -- CUDA IPC buckets as one flat buffer (patches.FLAT_TENSOR_FORMAT) ------------------------------------
class _TensorRunner(_Runner):
    tp_rank = 0

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        if load_format is not None:
            raise NotImplementedError(f"Unknown load_format={load_format}")  # what SGLang does
        self.model.load_weights(named_tensors)
        return True, "Success"


def _tensor_runner():
    cls = type("ModelRunner", (_TensorRunner,), {})
    unwrap = lambda tensor, tp_rank, device: tensor  # noqa: E731  SGLang's unwraps an IPC payload's rank
    engine_patches.replayed_load(types.SimpleNamespace(__name__="fake", ModelRunner=cls, _unwrap_tensor=unwrap))
    return cls()


def _flat_format(key, names, dtypes, shapes):
    import json

    from mrl.sglang.wire import FLAT_TENSOR_FORMAT

    return FLAT_TENSOR_FORMAT + json.dumps(dict(key=key, names=names, dtypes=dtypes, shapes=shapes))


def test_flat_ipc_buckets_load_by_replayed_copies_and_per_tensor_answers_announce_them(capsys):
    from mrl.sglang.wire import FLAT_TENSOR_MARK, REPLAYED_LOAD_MARK

    runner = _tensor_runner()
    ok, msg = runner.update_weights_from_tensor([("a", torch.ones(4))])  # SGLang's own path, marked
    assert ok and msg.endswith(FLAT_TENSOR_MARK) and torch.equal(runner.model.a, torch.ones(4))
    fmt = _flat_format("ipc-0", ["a", "b"], ["float32", "float32"], [[4], [2, 3]])
    for i in range(3):  # recorded once, then replayed: the buffer's new bytes land every time
        a, b = torch.arange(4.0) + i, torch.arange(6.0).reshape(2, 3) * (i + 2)
        ok, msg = runner.update_weights_from_tensor([("bucket", _flat(a, b))], load_format=fmt)
        assert ok, msg
        assert torch.equal(runner.model.a, a) and torch.equal(runner.model.b, b)
    assert "replayed" in msg and REPLAYED_LOAD_MARK in capsys.readouterr().err


@pytest.mark.parametrize("tensors, shapes", [([("x", torch.zeros(10, dtype=torch.uint8))], [[4]]),  # wrong size
                                              ([("x", torch.zeros(16, dtype=torch.uint8))] * 2, [[4]]),  # 2 tensors
                                              ([("x", torch.zeros(4))], [[4]])])  # not a uint8 buffer
def test_a_flat_bucket_that_does_not_match_its_layout_is_refused(tensors, shapes):
    runner = _tensor_runner()
    ok, msg = runner.update_weights_from_tensor(tensors, load_format=_flat_format("k", ["a"], ["float32"], shapes))
    assert not ok and "partially updated" in msg, msg
    assert torch.equal(runner.model.a, torch.zeros(4))


def test_the_trainers_flat_bucket_format_loads_in_a_patched_engine():
    """The wire between ``mrl.weight_sync.tensor.flat_format`` and the engine's patch."""
    from mrl.weight_sync.planner import HFTensor
    from mrl.weight_sync.tensor import flat_format

    bucket = types.SimpleNamespace(index=3, tensors=[HFTensor("a", (4,), "float32"), HFTensor("b", (2, 3), "float32")])
    a, b = torch.arange(4.0) - 1, torch.arange(6.0).reshape(2, 3) / 7
    runner = _tensor_runner()
    ok, msg = runner.update_weights_from_tensor([("bucket", _flat(a, b))], load_format=flat_format(bucket))
    assert ok, msg
    assert torch.equal(runner.model.a, a) and torch.equal(runner.model.b, b)
