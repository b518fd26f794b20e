"""Megatron (TP1, TP2+SP, EP2, TP2xEP2, PP2 uneven) -> real SGLang CPU engines (TP1 and TP2 at once) over gloo.

The trainer loads a different checkpoint (tiny, seed 1) than the engines serve (seed 0); after the
sync each engine's teacher-forced logprobs on a probe equal Megatron's and its version is stamped.
The engines are put back on their own weights through update_weights_from_disk (the disk transport).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mrl.models.tiny import make_tiny_model
from mrl.sglang.wire import REPLAYED_LOAD_MARK
from mrl.sglang.client import EngineClient
from tests.conftest import run_torchrun

# PP2 on the 3-layer tiny model: megatron's uneven split (2 layers on stage 0, 1 on stage 1)
LAYOUTS = [(1, []), (2, ["--tp", "2"]), (2, ["--ep", "2"]), (2, ["--tp", "2", "--ep", "2", "--etp", "1"]),
           (2, ["--pp", "2", "--pp-first", "2"])]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("seed1") / "tiny"), seed=1)


def _reload_original(engines, path):
    async def go():
        for e in engines.values():
            c = EngineClient(e.url)
            await c.pause("abort")
            await c.update_weights_from_disk(path, weight_version="0")
            await c.resume()
            await c.close()

    asyncio.run(go())


@pytest.fixture
def restore(engines, ckpt_dir):
    """Each sync starts from (and the module ends with) the engines' own seed-0 weights."""
    _reload_original(engines, ckpt_dir["tiny"])
    yield
    _reload_original(engines, ckpt_dir["tiny"])


@pytest.mark.parametrize("nproc,args", LAYOUTS, ids=["tp1", "tp2", "ep2", "tp2ep2", "pp2"])
def test_sync_into_tp1_and_tp2_engines(engines, other_weights, restore, tmp_path, nproc, args):
    out = tmp_path / "sync.json"
    eng = ",".join(f"{engines[n].url}@{engines[n].tp}" for n in ("tp1", "tp2"))
    version = str(10 + len(args))
    r = run_torchrun("mrl.jobs.sync_weights", ["--hf", other_weights, "--engines", eng, "--version", version,
                                               "--out", str(out), *args], nproc)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["engine_versions"] == [version, version]
    # mrl's engines take every bucket of the sync in one request, the version with it
    assert sorted(rep["batched_engines"]) == sorted(engines[n].url for n in ("tp1", "tp2")), rep
    assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-3, rep
    assert min(rep["probe_max_abs_logprob_diff_before"]) > 0.05, rep  # the engines really changed
    assert rep["bytes"] > 0 and rep["senders"] == (2 if "--ep" in args or "--pp" in args else 1)


def _load_lines(engine) -> list[str]:
    with open(engine.log_path) as f:
        return [ln for ln in f if ln.startswith("mrl: bucket layout")]


def test_later_syncs_replay_the_recorded_loads(engines, other_weights, ckpt_dir, restore, tmp_path):
    """The engines record each bucket layout's load once (``mrl.engine.server.replayed_load``) and replay it as
    copies afterwards: a second sync of the same layout adds no load line to the engine logs, and the
    engines still end on exactly the trainer's weights (their probe logprobs equal megatron's). Each job
    syncs twice: the second request carries only the key of the tensor lists the engines kept."""
    eng = ",".join(f"{engines[n].url}@{engines[n].tp}" for n in ("tp1", "tp2"))
    before = {n: len(_load_lines(engines[n])) for n in ("tp1", "tp2")}
    for i, hf in enumerate((other_weights, ckpt_dir["tiny"], other_weights)):
        out = tmp_path / f"sync{i}.json"
        r = run_torchrun("mrl.jobs.sync_weights", ["--hf", hf, "--engines", eng, "--version", f"4{i}",
                                                   "--out", str(out), "--bucket-mb", "0.1", "--repeat", "2"], 1)
        assert r.returncode == 0, r.stderr[-4000:]
        rep = json.loads(out.read_text())
        assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-3, rep
        # the second sync of the job named the engines' kept tensor lists by key, and both took it whole
        assert rep["request_forms"] == {engines[n].url: "kept" for n in ("tp1", "tp2")}, rep
        assert rep["engine_versions"] == [f"4{i}"] * 2 and sorted(rep["batched_engines"]) == sorted(
            engines[n].url for n in ("tp1", "tp2")), rep
        assert min(rep["probe_max_abs_logprob_diff_before"]) > 0.05, rep
        lines = {n: _load_lines(engines[n]) for n in ("tp1", "tp2")}
        if i == 0:
            recorded = lines
            assert all(len(lines[n]) > before[n] for n in lines), lines
            assert all(REPLAYED_LOAD_MARK in ln for n in lines for ln in lines[n][before[n]:]), lines
        else:
            assert lines == recorded  # nothing recorded again: the buckets were replayed


def test_disk_transport_tp2(engines, other_weights, restore, tmp_path):
    """The same sequence over the disk transport (safetensors export + update_weights_from_disk)."""
    out = tmp_path / "sync.json"
    eng = ",".join(f"{engines[n].url}@{engines[n].tp}" for n in ("tp1", "tp2"))
    r = run_torchrun("mrl.jobs.sync_weights", ["--hf", other_weights, "--engines", eng, "--version", "31",
                                               "--out", str(out), "--transport", "disk", "--tp", "2",
                                               "--repair-dir", str(tmp_path / "export")], 2)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["transport"] == "disk" and rep["engine_versions"] == ["31", "31"]
    assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-3 and min(rep["probe_max_abs_logprob_diff_before"]) > 0.05
    assert (tmp_path / "export" / "v31" / "model.safetensors").is_file()


def test_rejected_bucket_is_detected_and_repaired_from_disk(engines, other_weights, restore, tmp_path):
    """Bucket 1 goes out one row short (``tests/jobs/sync_weights_fault.py``): both engines reject it
    ("partially updated"); the job reloads them through the disk path, so they end on exactly the trainer's
    weights -- never a partial update."""
    out = tmp_path / "sync.json"
    eng = ",".join(f"{engines[n].url}@{engines[n].tp}" for n in ("tp1", "tp2"))
    r = run_torchrun("tests.jobs.sync_weights_fault", ["--short-bucket", "1", "--hf", other_weights, "--engines", eng,
                                                     "--version", "21", "--out", str(out), "--tp", "2"], 2)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert set(rep["failed_engines"]) == {engines["tp1"].url, engines["tp2"].url}
    assert all("partially updated" in m for m in rep["failed_engines"].values())
    assert sorted(rep["repaired_from_disk"]) == sorted(rep["failed_engines"])
    assert rep["batched_engines"] == []  # a failed batch stamps no version: the repair's finish does
    assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-3 and rep["engine_versions"] == ["21", "21"]


def test_disk_restore_puts_engines_back(engines, ckpt_dir, other_weights):
    _reload_original(engines, other_weights)
    _reload_original(engines, ckpt_dir["tiny"])

    async def go():
        outs = []
        for e in engines.values():
            c = EngineClient(e.url)
            outs.append((await c.generate([1, 17, 42, 99, 7], {"max_new_tokens": 6, "temperature": 0.0,
                                                              "ignore_eos": True}, rid=f"restore-{e.name}"),
                         await c.weight_version()))
            await c.close()
        return outs

    for out, version in asyncio.run(go()):
        assert out.output_ids == [68, 214, 151, 157, 214, 157] and version == "0"  # the recorded greedy output
