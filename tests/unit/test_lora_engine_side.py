"""The engine side of LoRA without a server: launch flags, config refusals (field named), adapter checks,
the adapter router's unload rules and the rollout manager's use of it (duck-typed engine clients)."""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
from types import SimpleNamespace

import pytest
import torch

from mrl.config.schema import EngineConfig, LoraConfig, WeightSyncConfig, WeightTransport
from mrl.engine.launcher import Engine
from mrl.config.lora_engine import ATTENTION, MLP, LoraEngineSpec, hf_targets, lora_engine_spec
from tests.peek import adapters_in_use, wait_unloads
from mrl.rollout.lora import AdapterRouter
from mrl.sglang.wire import adapter_name, adapter_version
from mrl.rollout.manager import RolloutManager
from mrl.sglang.protocol import EngineHTTPError, EngineUnavailable, FinishReason, GenerateOutput
from mrl.rollout.sample import Sample, SamplingSpec
from mrl.weight_sync.adapter import (AdapterSync, AdapterSyncError, check_adapter_tensors, random_adapter,
                                    serialize_adapter)

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_hidden_layers=2, num_local_experts=4)


def _cfg(rank=8, targets=("attention",), transport=WeightTransport.distributed, **engine):
    return SimpleNamespace(model=SimpleNamespace(lora=LoraConfig(rank=rank, alpha=16, targets=list(targets))),
                           engine=EngineConfig(**engine), weight_sync=WeightSyncConfig(transport=transport))


def test_names_and_targets():
    assert adapter_name(7) == "policy@v7" and adapter_version("policy@v7") == 7
    assert hf_targets(["attention"]) == ATTENTION and hf_targets("all") == ATTENTION + MLP
    assert hf_targets(["linear_fc1", "linear_qkv"]) == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert hf_targets(LoraConfig(rank=4, targets=["attention", "dense_mlp"]).targets) == ATTENTION + MLP
    with pytest.raises(ValueError, match="model.lora.targets: 'router'.*router"):
        hf_targets(["attention", "router"])
    with pytest.raises(ValueError, match="model.lora.targets: unknown target 'qkv'"):
        hf_targets(["qkv"])


def test_launch_flags_cpu_and_gpu():
    spec = LoraEngineSpec(max_rank=16, targets=ATTENTION, slots=3)
    cmd = Engine(model_path="/m", port=1, lora=spec).command()
    i = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert cmd[i + 1:i + 5] == list(ATTENTION) and cmd[cmd.index("--max-loras-per-batch") + 1] == "3"
    assert cmd[cmd.index("--lora-backend") + 1] == "torch_native" and "--max-loaded-loras" not in cmd
    gpu = Engine(model_path="/m", port=1, cpu_mode=False, lora=LoraEngineSpec(max_rank=8, targets=ATTENTION + MLP))
    g = gpu.command()
    assert "--lora-backend" not in g and g[g.index("--moe-runner-backend") + 1] == "triton"
    assert "--moe-runner-backend" not in Engine(model_path="/m", port=1, cpu_mode=False, lora=spec).command()


@pytest.mark.parametrize("kw,field", [
    (dict(rank=32, lora_max_rank=16), "model.lora.rank: 32 > engine.lora_max_rank 16"),
    (dict(targets=["attention", "experts"]),
     r"model.lora.targets: \['gate_proj', 'up_proj', 'down_proj'\] on CPU engines"),
    (dict(targets=["experts"]), "model.lora.targets:.*no CPU path"),
    (dict(targets=["dense_mlp"]), "model.lora.targets:.*no CPU path"),
    (dict(targets=["attention", "router"]), "model.lora.targets: 'router'"),
    (dict(server_args={"max_loaded_loras": 4}), "engine.server_args.max_loaded_loras"),
    (dict(server_args={"max_lora_rank": 4}), r"engine.server_args: \['max_lora_rank'\] are set by mrl"),
    (dict(cpu_mode=False, targets=["experts"], server_args={"moe_runner_backend": "flashinfer_trtllm"}),
     "engine.server_args.moe_runner_backend"),
    (dict(cpu_mode=False, dp=2, server_args={"enable_dp_attention": True}), "engine.dp"),
])
def test_bad_lora_configs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        lora_engine_spec(_cfg(**kw))


@pytest.mark.parametrize("kw,field", [(dict(lora_slots=1), "engine.lora_slots"),
                                      (dict(lora_backend="triton"), "engine.lora_backend"),
                                      (dict(lora_backend="flashinfer", cpu_mode=False), "engine.lora_backend"),
                                      (dict(lora_max_rank=0), "engine.lora_max_rank")])
def test_engine_lora_fields_are_checked(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_spec_follows_the_config_and_every_transport_is_accepted():
    assert lora_engine_spec(_cfg(rank=0)) is None
    assert lora_engine_spec(SimpleNamespace(model=SimpleNamespace(), engine=EngineConfig())) is None
    for t in WeightTransport:  # adapters always go over HTTP; the transport is the base weights' path
        spec = lora_engine_spec(_cfg(rank=8, transport=t, lora_slots=3))
        assert spec == LoraEngineSpec(max_rank=8, targets=ATTENTION, slots=3)
    gpu = lora_engine_spec(_cfg(rank=8, targets=["attention", "experts"], cpu_mode=False, lora_max_rank=64))
    assert gpu.max_rank == 64 and gpu.experts


def test_adapter_checks():
    spec = LoraEngineSpec(max_rank=8, targets=ATTENTION)
    tensors, config = random_adapter(TINY, targets=ATTENTION, r=4, alpha=8)
    spec.check_adapter(config)
    assert check_adapter_tensors(tensors, config) == sum(t.numel() * 4 for t in tensors.values())
    for change, msg in [({"use_rslora": True}, "use_rslora=True: SGLang ignores it"),
                        ({"use_dora": True}, "use_dora"), ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
                        ({"target_modules": "all-linear"}, "list the modules"),
                        ({"target_modules": ["q_proj", "gate_proj"]}, r"\['gate_proj'\] are outside"),
                        ({"r": 16}, "r=16 > the engines' --max-lora-rank 8"), ({"peft_type": "IA3"}, "LORA only")]:
        with pytest.raises(ValueError, match=msg):
            spec.check_adapter({**config, **change}, where="adapter policy@v3")
    k = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for bad, msg in [({**tensors, "model.layers.0.q_proj.weight": tensors[k]}, "not a PEFT LoRA name"),
                     ({n: t for n, t in tensors.items() if n != k}, "q_proj has lora_B without lora_A"),
                     ({**tensors, k: tensors[k][:2]}, "do not have rank r=4"),
                     ({**tensors, k: tensors[k] * float("nan")}, "non-finite"),
                     ({**tensors, k.replace("q_proj", "up_proj"): tensors[k]}, "'up_proj' is not in target_modules")]:
        with pytest.raises(ValueError, match=msg):
            check_adapter_tensors(bad, config)
    with pytest.raises(ValueError, match="version 2 is older than the engines' current policy@v3"):
        s = AdapterSync([])
        s.current = ("policy@v3", 3)
        s.push(tensors, config, 2)


class _SGLangUnpickler(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` rule (0.5.14 ``srt/utils/common.py``), for the modules a payload may name."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
               "weakref.", "torch.")

    def find_class(self, module, name):
        if not (module + ".").startswith(self.ALLOWED):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


def test_payload_names_only_what_sglang_unpickles_even_after_megatron_import():
    import megatron.core  # noqa: F401  replaces torch.storage._load_from_bytes, as in every trainer process

    t = {"base_model.model.x.lora_A.weight": torch.arange(6.0).reshape(2, 3).t(),  # non-contiguous
         "base_model.model.x.lora_B.weight": torch.randn(4, 2).to(torch.bfloat16)}
    with pytest.raises(RuntimeError, match="megatron.core.safe_globals"):  # why a plain pickle cannot be sent
        _SGLangUnpickler(io.BytesIO(pickle.dumps(t))).load()
    raw = base64.b64decode(serialize_adapter(t))
    assert b"multiprocessing" not in raw and b"megatron" not in raw
    back = _SGLangUnpickler(io.BytesIO(raw)).load()
    assert back.keys() == t.keys() and all(torch.equal(back[k], t[k]) and back[k].dtype == t[k].dtype for k in t)


class FakeClient:
    """What the router and the manager call on an engine client."""

    def __init__(self, url: str, *, lost: bool = False, unload_error: Exception | None = None):
        self.url, self.lost, self.unload_error = url, lost, unload_error
        self.requests: list[str | None] = []
        self.unloaded: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, ids, params, *, rid, lora_path=None, **kw):
        self.requests.append(lora_path)
        if self.lost and lora_path:
            raise EngineHTTPError(self.url, "/generate", 400,
                                  f"Got LoRA adapter that has never been loaded: {lora_path}")
        await self.release.wait()
        n = params["max_new_tokens"]
        return GenerateOutput(rid=rid, output_ids=[5] * n, output_logprobs=[-0.5] * n,
                              finish=FinishReason("length"), weight_version="0", prompt_tokens=len(ids),
                              completion_tokens=n, cached_tokens=0, total_retractions=0, routed_experts=None,
                              output_top_logprobs=None)

    async def unload_lora_adapter(self, name):
        if self.unload_error is not None:
            raise self.unload_error
        self.unloaded.append(name)
        return []

    async def abort(self, rid=None, *, abort_all=False):
        pass


def test_router_unloads_only_idle_versions_and_never_while_held():
    async def go():
        a, b = FakeClient("http://a"), FakeClient("http://b")
        r = AdapterRouter()
        r.set_current("policy@v1", 1, [a, b])
        assert r.acquire("http://a") == ("policy@v1", 1)
        r.set_current("policy@v2", 2, [a, b])
        await wait_unloads(r)
        assert a.unloaded == [] and b.unloaded == ["policy@v1"]  # b had no v1 request; a still has one
        assert r.live() == ["policy@v2", "policy@v1"] and adapters_in_use(r) == {"policy@v1": 1}
        r.hold()
        r.release("http://a", ("policy@v1", 1))
        await asyncio.sleep(0)
        await wait_unloads(r)
        assert a.unloaded == []  # drained for a sync: engines may be paused
        r.resume()
        await wait_unloads(r)
        assert a.unloaded == ["policy@v1"] and r.live() == ["policy@v2"]
        c = FakeClient("http://c", unload_error=EngineUnavailable("http://c", "/unload_lora_adapter", "refused"))
        r.add_engine(c)
        r.set_current("policy@v3", 3, [a, b, c])
        await wait_unloads(r)
        assert r.errors == ["unloading adapter policy@v2 from http://c: http://c/unload_lora_adapter: refused"]
        gone = FakeClient("http://d", unload_error=EngineHTTPError("http://d", "/x", 400, "LoRA with name policy@v3 "
                                                                   "does not exist"))
        r.add_engine(gone)
        r.set_current("policy@v4", 4, [gone])
        await wait_unloads(r)
        assert not any("http://d" in e for e in r.errors)  # a restarted engine never had it: not an error

    asyncio.run(go())


def test_manager_names_the_current_adapter_and_versions_tokens_by_it():
    async def go():
        lost, ok = FakeClient("http://lost", lost=True), FakeClient("http://ok")
        lost.release.set()
        ok.release.set()
        router = AdapterRouter()
        mgr = RolloutManager([lost, ok], sampling=SamplingSpec(max_new_tokens=3), adapters=router)
        base = await mgr.run_sample(Sample(prompt_ids=[1, 2], group_id=0, index=0, max_new_tokens=3))
        assert base.versions == [0, 0, 0] and lost.requests + ok.requests == [None]  # no adapter yet: the base
        mgr.set_adapter("policy@v4", 4)
        s = await mgr.run_sample(Sample(prompt_ids=[1, 2], group_id=0, index=1, max_new_tokens=3))
        assert s.error is None and s.versions == [4, 4, 4] and s.num_retries == 1
        # the engine that lost its adapters (restarted behind its address) is out of rotation
        assert not mgr.slots[0].healthy and lost.requests[-1] == "policy@v4" and ok.requests[-1] == "policy@v4"
        assert adapters_in_use(router) == {}

    asyncio.run(go())


class _Pusher:
    """``AdapterSync`` on rank 0 as ``AdapterChannel`` drives it: engines in ``refuse`` fail every load."""

    def __init__(self, urls, refuse):
        self.urls, self.refuse, self.calls = list(urls), refuse, []

    def push(self, tensors, config, version):
        self.calls.append(("push", tuple(self.urls)))
        if failed := {u: why for u, why in self.refuse.items() if u in self.urls}:
            raise AdapterSyncError(adapter_name(version), failed, [u for u in self.urls if u not in failed])
        return SimpleNamespace(name=adapter_name(version), mode="tensors", seconds=0.01, tensor_bytes=64)

    def add_engines(self, urls):
        self.calls.append(("add", tuple(urls)))

    def remove_engines(self, urls):
        self.urls = [u for u in self.urls if u not in urls]


@pytest.mark.parametrize("dead", [True, False])
def test_adapter_channel_drops_dead_engines_and_stops_on_a_live_refusal(monkeypatch, dead):
    """Rank 0's push (``AdapterChannel._push``): an engine that fails the load and a liveness probe is dropped
    and the others get the version; one that answers the probe stops the sync before the rollout side
    switches (it would serve another policy). A joining engine gets the version once it is current."""
    import mrl.weight_sync.adapter as wl
    import mrl.weight_sync.channel as channel
    from mrl.sglang.endpoint import EngineEndpoint

    spec = LoraEngineSpec(max_rank=8, targets=ATTENTION)
    ch = wl.AdapterChannel(None, SimpleNamespace(world_rank=0), [EngineEndpoint("http://a"), EngineEndpoint("http://b")],
                           spec=spec, timeout_s=5.0)
    ch._pusher = pusher = _Pusher(["http://a", "http://b"], refuse={"http://b": "HTTP 500"})
    monkeypatch.setattr(channel, "dead_engines", lambda urls, _t: {u: "refused" for u in urls} if dead else {})
    switched = []
    ch.on_loaded = lambda name, version: switched.append((name, version))
    ch.add([EngineEndpoint("http://c")])
    if not dead:
        with pytest.raises(AdapterSyncError, match="engine http://b: HTTP 500"):
            ch._push({}, {}, 3)
        assert switched == [] and pusher.urls == ["http://a", "http://b"]
        return
    out = ch._push({}, {}, 3)
    assert out["dead"] == {"http://b": "refused"} and out["name"] == "policy@v3"
    assert pusher.calls == [("push", ("http://a", "http://b")), ("push", ("http://a",)), ("add", ("http://c",))]
    assert switched == [("policy@v3", 3)]
