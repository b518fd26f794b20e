"""LoRA on a real SGLang 0.5.14 CPU engine (tiny Qwen3-MoE, TP1, started with the LoRA flags, once per module).

- an adapter pushed from tensors (random A, nonzero B on q/k/v/o, the tiny model's only non-expert
  linears) is served exactly as transformers serves the merged weights W + (alpha/r) B A, at engine TP1
  and TP2 (SGLang slices the full PEFT tensors itself); the base model stays reachable without an adapter;
- version lifecycle through the rollout manager: v2 loads while a v1 request runs, the v1 request ends
  on v1 (its tokens carry version 1 and equal the v1 model's logprobs), new requests go to v2, and v1 is
  unloaded only once that request is back; the disk transport loads a version by path;
- what the engine refuses (a rank above its --max-lora-rank, a module outside its pool) comes back
  naming the engine and the adapter, and mrl's own checks refuse it before anything is sent; a name is
  never loaded twice, and a request naming an unloaded or unknown version is refused, not served.

Payloads are built after ``import megatron.core``, as in a trainer process (megatron replaces torch's
storage unpickling function, which a plain pickle would then name and SGLang refuse).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import megatron.core  # noqa: F401  (see the module doc)
import pytest
import torch

from mrl.sglang.client import EngineClient
from mrl.engine.launcher import Engine
from mrl.config.lora_engine import ATTENTION, LoraEngineSpec
from tests.peek import adapters_in_use, wait_unloads
from mrl.rollout.lora import AdapterRouter
from mrl.sglang.wire import adapter_name
from mrl.rollout.manager import RolloutManager
from mrl.sglang.protocol import EngineHTTPError
from mrl.rollout.sample import Sample, SamplingSpec
from mrl.sglang.keys import ensure_run_secrets
from mrl.weight_sync.adapter import AdapterSync, AdapterSyncError, random_adapter, serialize_adapter

RANK, ALPHA, MAX_RANK = 4, 8.0, 8
PROBE = [1, 17, 42, 99, 7, 300, 5, 11, 12, 13, 250, 251, 64, 3, 77, 401]


@pytest.fixture(scope="module")
def lora_engine(ckpt_dir, tmp_path_factory):
    spec = LoraEngineSpec(max_rank=MAX_RANK, targets=ATTENTION, slots=4)
    eng = Engine(model_path=ckpt_dir["tiny"], tp=1, log_dir=str(tmp_path_factory.mktemp("lora_engine")),
                 name="lora_tp1", secrets=ensure_run_secrets(), lora=spec)
    eng.start()
    try:
        eng.wait_healthy(timeout=600)
        yield eng, spec
    finally:
        eng.stop()


def _hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _hf_logprobs(path: str, ids: list[int], adapter: tuple[dict, dict] | None) -> list[float]:
    """transformers' logprob of ids[1:], with W + (alpha/r) B A merged into every adapted linear."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter is not None:
        tensors, cfg = adapter
        params = dict(hf.named_parameters())
        with torch.no_grad():
            for k, a in tensors.items():
                if ".lora_A." in k:
                    module = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = tensors[k.replace(".lora_A.", ".lora_B.")]
                    params[module + ".weight"] += (cfg["lora_alpha"] / cfg["r"]) * (b @ a)
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def _engine_logprobs(url: str, ids: list[int], lora: str | None) -> list[float]:
    async def go():
        c = EngineClient(url)
        try:
            out = await c.generate(ids, {"max_new_tokens": 1, "temperature": 0.0}, rid=f"lp-{lora}-{time.time()}",
                                   logprob_start_len=0, lora_path=lora)
            return out.input_logprobs[1:]
        finally:
            await c.close()

    return asyncio.run(go())


def _adapters(url: str) -> list[str]:
    async def go():
        c = EngineClient(url)
        try:
            return await c.lora_adapters()
        finally:
            await c.close()

    return asyncio.run(go())


def _unload_all(url: str) -> None:
    async def go():
        c = EngineClient(url)
        try:
            for n in await c.lora_adapters():
                await c.unload_lora_adapter(n)
        finally:
            await c.close()

    asyncio.run(go())


def test_adapter_logprobs_equal_merged_weights_tp2(ckpt_dir, tmp_path):
    """At engine TP2 (its own engine, started and stopped here; first in the module, so it runs before the
    module's TP1 engine starts: one engine at a time)."""
    path = ckpt_dir["tiny"]
    spec = LoraEngineSpec(max_rank=MAX_RANK, targets=ATTENTION, slots=2)
    adapter = random_adapter(_hf_config(path), targets=ATTENTION, r=RANK, alpha=ALPHA, seed=2)
    with Engine(model_path=path, tp=2, log_dir=str(tmp_path), name="lora_tp2", secrets=ensure_run_secrets(),
                lora=spec) as eng:
        eng.wait_healthy(timeout=600)
        AdapterSync([eng.url], spec=spec, timeout_s=60).push(*adapter, version=1)
        got = _engine_logprobs(eng.url, PROBE, "policy@v1")
    diff = max(abs(a - b) for a, b in zip(got, _hf_logprobs(path, PROBE, adapter)))
    print(f"engine TP2 with an adapter vs transformers merged: max |logprob diff| {diff:.2e}")
    assert diff <= 1e-5, diff


def test_adapter_logprobs_equal_merged_weights(lora_engine, ckpt_dir):
    eng, spec = lora_engine
    path = ckpt_dir["tiny"]
    adapter = random_adapter(_hf_config(path), targets=ATTENTION, r=RANK, alpha=ALPHA, seed=1)
    sync = AdapterSync([eng.url], spec=spec, timeout_s=60)
    rep = sync.push(*adapter, version=1)
    assert rep.name == "policy@v1" and rep.engines == [eng.url] and rep.payload_bytes > rep.tensor_bytes > 0
    assert _adapters(eng.url) == ["policy@v1"]

    got = _engine_logprobs(eng.url, PROBE, "policy@v1")
    want = _hf_logprobs(path, PROBE, adapter)
    diff = max(abs(a - b) for a, b in zip(got, want))
    print(f"engine TP1 with an adapter vs transformers merged: max |logprob diff| {diff:.2e}")
    assert diff <= 1e-5, diff
    base = _engine_logprobs(eng.url, PROBE, None)
    assert max(abs(a - b) for a, b in zip(base, _hf_logprobs(path, PROBE, None))) <= 1e-5
    assert max(abs(a - b) for a, b in zip(base, got)) > 1e-2  # the adapter changes the model
    _unload_all(eng.url)


def test_version_lifecycle_through_the_manager(lora_engine, ckpt_dir, tmp_path):
    eng, spec = lora_engine
    path = ckpt_dir["tiny"]
    v1 = random_adapter(_hf_config(path), targets=ATTENTION, r=RANK, alpha=ALPHA, seed=11)
    v2 = random_adapter(_hf_config(path), targets=ATTENTION, r=RANK, alpha=ALPHA, seed=12)
    v3 = random_adapter(_hf_config(path), targets=ATTENTION, r=RANK, alpha=ALPHA, seed=13)
    sync = AdapterSync([eng.url], spec=spec, timeout_s=60)
    sync.push(*v1, version=1)
    seen: dict = {}

    async def go():
        router = AdapterRouter()
        client = EngineClient(eng.url)
        mgr = RolloutManager([client], sampling=SamplingSpec(max_new_tokens=400, temperature=1.0, ignore_eos=True),
                             adapters=router)
        mgr.set_adapter("policy@v1", 1)
        long = asyncio.create_task(mgr.run_sample(Sample(prompt_ids=PROBE, group_id=0, index=0, max_new_tokens=400)))
        while adapters_in_use(router).get("policy@v1", 0) == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # inside the engine, decoding
        t = time.perf_counter()
        await asyncio.to_thread(sync.push, *v2, version=2)
        seen["load_s"] = time.perf_counter() - t
        mgr.set_adapter("policy@v2", 2)
        seen["running_after_switch"] = not long.done()
        seen["held_after_switch"] = await client.lora_adapters()
        short = await mgr.run_sample(Sample(prompt_ids=PROBE, group_id=1, index=0, max_new_tokens=8))
        seen["unloaded_while_v1_runs"] = list(router.unloaded)
        seen["v1_running_after_v2_sample"] = not long.done()
        first = await long
        await wait_unloads(router)
        seen["unloaded"] = list(router.unloaded)
        seen["held_at_end"] = await client.lora_adapters()
        seen["errors"] = list(router.errors)
        # a drained manager unloads nothing until it resumes (engines may be paused during a sync)
        await mgr.drain()
        await asyncio.to_thread(sync.push, *v3, version=3)
        mgr.set_adapter("policy@v3", 3)
        await asyncio.sleep(0.2)
        seen["unloaded_while_drained"] = len(router.unloaded) - len(seen["unloaded"])
        mgr.undrain()
        await wait_unloads(router)
        seen["held_after_undrain"] = await client.lora_adapters()
        await client.close()
        return first, short

    first, short = asyncio.run(go())
    assert seen["running_after_switch"] and seen["v1_running_after_v2_sample"], seen
    assert seen["held_after_switch"] == ["policy@v1", "policy@v2"], seen
    assert seen["unloaded_while_v1_runs"] == [] and seen["unloaded"] == [(eng.url, "policy@v1")], seen
    assert seen["held_at_end"] == ["policy@v2"] and seen["errors"] == [], seen
    assert seen["unloaded_while_drained"] == 0 and seen["held_after_undrain"] == ["policy@v3"], seen
    assert first.error is None and len(first.response_ids) == 400 and set(first.versions) == {1}
    assert short.error is None and set(short.versions) == {2}
    # each sample was generated by its own version: the engine's logprobs are that model's
    for sample, adapter in ((first, v1), (short, v2)):
        want = _hf_logprobs(path, sample.prompt_ids + sample.response_ids, adapter)[len(sample.prompt_ids) - 1:]
        assert max(abs(a - b) for a, b in zip(sample.response_logprobs, want)) <= 1e-4

    # the disk transport: the same version by path, older version directories removed
    disk = AdapterSync([eng.url], spec=spec, timeout_s=60, export_dir=str(tmp_path))
    rep = disk.push(*v1, version=4)  # first contact: the earlier adapters of this engine are unloaded
    assert rep.mode == "disk" and rep.stale_unloaded == {eng.url: ["policy@v3"]}
    assert _adapters(eng.url) == ["policy@v4"] and os.listdir(tmp_path / "lora") == ["v4"]
    got = _engine_logprobs(eng.url, PROBE, "policy@v4")
    assert max(abs(a - b) for a, b in zip(got, _hf_logprobs(path, PROBE, v1))) <= 1e-5
    disk.push(*v2, version=5)
    assert os.listdir(tmp_path / "lora") == ["v5"]
    _unload_all(eng.url)


def test_bad_adapters_are_refused_naming_engine_and_adapter(lora_engine, ckpt_dir):
    eng, spec = lora_engine
    cfg = _hf_config(ckpt_dir["tiny"])
    too_big = random_adapter(cfg, targets=ATTENTION, r=MAX_RANK * 2, alpha=ALPHA)
    mlp = random_adapter(cfg, targets=("q_proj", "gate_proj"), r=RANK, alpha=ALPHA)
    # mrl's own checks, before anything is sent
    with pytest.raises(ValueError, match=r"adapter policy@v1: rank r=16 > the engines' --max-lora-rank 8"):
        AdapterSync([eng.url], spec=spec).push(*too_big, version=1)
    with pytest.raises(ValueError, match=r"target_modules \['gate_proj'\] are outside"):
        AdapterSync([eng.url], spec=spec).push(*mlp, version=1)
    # the engine's, when mrl does not know its spec
    for adapter, msg in ((too_big, "incompatible"), (mlp, "incompatible")):
        with pytest.raises(AdapterSyncError) as e:
            AdapterSync([eng.url], timeout_s=60).push(*adapter, version=7)
        assert e.value.failed.keys() == {eng.url} and e.value.loaded == []
        assert str(e.value).startswith(f"adapter {adapter_name(7)}: engine {eng.url}") and msg in str(e.value)
    assert _adapters(eng.url) == []  # nothing half-loaded; the engine still serves
    assert len(_engine_logprobs(eng.url, PROBE, None)) == len(PROBE) - 1

    ok = random_adapter(cfg, targets=ATTENTION, r=RANK, alpha=ALPHA)

    async def go():
        c = EngineClient(eng.url)
        try:
            await c.load_lora_adapter_from_tensors("policy@v9", ok[1], serialize_adapter(ok[0]))
            with pytest.raises(EngineHTTPError, match="already loaded"):  # no in-place update: one name per version
                await c.load_lora_adapter_from_tensors("policy@v9", ok[1], serialize_adapter(ok[0]))
            await c.unload_lora_adapter("policy@v9")
            # SGLang tries to load an unloaded name again from its path ("__tensor__": the Hub), so the
            # rollout side never names a retired version
            with pytest.raises(EngineHTTPError, match="Failed to implicitly load LoRA adapter policy@v9"):
                await c.generate(PROBE, {"max_new_tokens": 1}, rid="retired", lora_path="policy@v9")
            with pytest.raises(EngineHTTPError, match="never been loaded"):
                await c.generate(PROBE, {"max_new_tokens": 1}, rid="unknown", lora_path="policy@v10")
        finally:
            await c.close()

    asyncio.run(go())
    assert _adapters(eng.url) == []
