"""GLM-4.5 and DeepSeek-V3 tiny models on a real SGLang CPU engine (one engine per family, started once).

For each family, in this order (the last test changes the engine's weights):
- the engine serves with routed experts, one row per token and MoE layer; greedy tokens equal
  transformers', logprobs within 1e-4, every recorded expert set equals transformers' router's;
- Keep Routing: sampled sequences and their recorded routes replayed in megatron training under
  TP2xEP2 (SP) and PP2 (uneven, full recompute), 2 micro-batches each, packed and unpacked: every router
  dispatches exactly the engine's experts (forward and recompute), the logprobs equal the single-process
  replay run, and those equal the engine's own (same weights: the gate weights of the replayed experts are
  computed as the engine computes them);
- weight sync: megatron (TP2xEP2, two senders) pushes a different checkpoint into the engine over gloo;
  the engine then scores a probe exactly as when it loads that checkpoint from disk, and as megatron does.

DeepSeek-V3's prefill on SGLang's CPU attention backend needs mrl's fix (``cpu_attention.extend_given_kv``,
docs/models.md): without it these equalities fail.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
import torch

from mrl.models import get_bridge
from mrl.sglang.client import EngineClient
from mrl.engine.launcher import Engine
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.sglang.keys import ensure_run_secrets
from mrl.routing.codec import RoutesCodec
from tests.conftest import run_torchrun
from tests.integration.test_keep_routing import _check_routers, _logprobs_by_seq, _run

FAMILIES = ["glm4_moe", "deepseek_v3"]
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5], [1, 11, 12, 13, 14, 15, 16], [1, 250, 251]]
REPLAY_LAYOUTS = {"tp2ep2": "tp=2,ep=2,etp=1,recompute=1", "pp2": "pp=2,pp_first=2,recompute=1"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, ckpt_dir, tmp_path_factory):
    """(name, checkpoint, engine): one family engine at a time (module scope, one parameter after the other)."""
    name = request.param
    logs = tmp_path_factory.mktemp(f"{name}_engine")
    # the session's keys ($MRL_ENGINE_KEYS_FILE, made here if no engine exported them yet): every client
    # and job here authenticates with them
    eng = Engine(model_path=ckpt_dir[name], tp=1, log_dir=str(logs), name=name, secrets=ensure_run_secrets())
    eng.start()
    try:
        eng.wait_healthy(timeout=600)
        yield name, ckpt_dir[name], eng
    finally:
        eng.stop()


def _hf_routes(path: str, ids: list[int]) -> tuple[torch.Tensor, list[np.ndarray]]:
    """transformers' log-softmax [S, V] and per MoE layer the sorted expert ids [S, K]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    routes = {}
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "route_tokens_to_experts"):
            layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, moe=layer.mlp, i=i: routes.__setitem__(i, moe.route_tokens_to_experts(out)[0]))
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return lp, [np.sort(routes[i].numpy(), -1) for i in sorted(routes)]


def test_engine_serves_with_routes(family):
    name, path, eng = family
    codec = RoutesCodec.from_bridge(get_bridge(path))
    out = _greedy(eng, name)
    routes = codec.decode(out.routed_experts, prompt_len=len(PROBE), response_len=len(out.output_ids))
    assert routes.shape == (len(PROBE) + len(out.output_ids) - 1, len(codec.moe_layers), codec.top_k)
    assert all(len(set(r)) == codec.top_k for r in routes.reshape(-1, codec.top_k).tolist())  # k distinct experts


def test_engine_equals_transformers(family):
    name, path, eng = family
    codec = RoutesCodec.from_bridge(get_bridge(path))
    out = _greedy(eng, name)
    tokens = PROBE + list(out.output_ids)
    lp, hf_routes = _hf_routes(path, tokens)
    routes = codec.decode(out.routed_experts, prompt_len=len(PROBE), response_len=len(out.output_ids))
    hf_lp = [lp[len(PROBE) - 1 + i, t].item() for i, t in enumerate(out.output_ids)]
    print(f"\n[{name}] engine vs transformers: max |logprob diff| "
          f"{np.abs(np.asarray(hf_lp) - np.asarray(out.output_logprobs)).max():.2e}")
    assert list(out.output_ids) == lp[len(PROBE) - 1:-1].argmax(-1).tolist()  # greedy equals transformers'
    assert np.abs(np.asarray(hf_lp) - np.asarray(out.output_logprobs)).max() < 1e-4
    for j in range(len(codec.moe_layers)):
        assert np.array_equal(np.sort(routes[:, j], -1), hf_routes[j][:-1]), (name, j)


PROBE = [1, 17, 42, 99, 7, 8, 9]


def _greedy(eng, name):
    async def go():
        c = EngineClient(eng.url)
        try:
            return await c.generate(PROBE, {"max_new_tokens": 8, "temperature": 0.0}, rid=f"{name}-greedy",
                                    return_routed_experts=True)
        finally:
            await c.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def samples(family, tmp_path_factory):
    name, path, eng = family
    codec = RoutesCodec.from_bridge(get_bridge(path))

    async def go():
        mgr = RolloutManager([EngineClient(eng.url)], codec=codec,
                             sampling=SamplingSpec(max_new_tokens=10, temperature=1.0, ignore_eos=True))
        groups = await asyncio.gather(*(mgr.generate_group(p, n=1, group_id=i) for i, p in enumerate(PROMPTS)))
        return [g[0] for g in groups]

    out = asyncio.run(go())
    f = tmp_path_factory.mktemp(f"{name}_replay") / "samples.json"
    f.write_text(json.dumps({"sequences": [s.tokens for s in out], "routes": [s.routes.tolist() for s in out],
                             "engine_logprobs": [s.response_logprobs for s in out],
                             "prompt_lens": [len(s.prompt_ids) for s in out]}))
    return f


@pytest.fixture(scope="module")
def reference(family, samples, tmp_path_factory):
    """The single-process replay run (the layouts' reference)."""
    return _run(family[1], samples, tmp_path_factory.mktemp(f"{family[0]}_ref"), 1, [])[0]


def test_keep_routing_replays_the_engine_routes(family, samples, reference, tmp_path):
    name, path, _ = family
    sj = json.loads(samples.read_text())
    routed = sum(len(x) - 1 for x in sj["sequences"]) * len(reference["moe_columns"])
    for layout, reps in _run(path, samples, tmp_path, 2, [], REPLAY_LAYOUTS).items():
        for packed, prefix in ((False, ""), (True, "packed_")):
            # every (engine-routed token, MoE layer) exactly once over the ranks, forward and recompute
            assert sum(_check_routers(sj, rep, rep[prefix + "forward_calls"], packed) for rep in reps) == routed
            assert all(_check_routers(sj, rep, rep[prefix + "recompute_calls"], packed) for rep in reps)
        for key in ("logprobs_replay", "logprobs_packed"):
            got, ref = _logprobs_by_seq(reps, key), _logprobs_by_seq([reference], key)
            assert sorted(got) == sorted(ref) == list(range(len(PROMPTS)))
            for i in ref:
                n = len(sj["sequences"][i]) - 1
                assert np.abs(got[i][:n] - ref[i][:n]).max() < 2e-5, (name, layout, key, i)


def test_replayed_logprobs_equal_the_engines(family, samples, reference):
    """Same weights, fp32, the engine's experts: the trainer's logprobs are the engine's (the gate
    weights computed for the replayed experts as the engine computes them)."""
    name, path, _ = family
    sj = json.loads(samples.read_text())
    lps = _logprobs_by_seq([reference], "logprobs_replay")
    for i, eng_lp in enumerate(sj["engine_logprobs"]):
        p = sj["prompt_lens"][i]
        assert np.abs(lps[i][p - 1:p - 1 + len(eng_lp)] - np.asarray(eng_lp)).max() < 1e-4, (name, i)


def _probe_logprobs(eng, name, tokens, rid):
    async def go():
        c = EngineClient(eng.url)
        try:
            out = await c.generate(tokens, {"max_new_tokens": 1, "temperature": 0.0}, rid=f"{name}-{rid}",
                                   logprob_start_len=0, return_routed_experts=True)
            return np.asarray(out.input_logprobs[1:], dtype=np.float64)
        finally:
            await c.close()

    return asyncio.run(go())


def _reload_from_disk(eng, path, version):
    async def go():
        c = EngineClient(eng.url)
        try:
            await c.pause("abort")
            await c.update_weights_from_disk(path, weight_version=version)
            await c.resume()
        finally:
            await c.close()

    asyncio.run(go())


def test_weight_sync_delivers_the_trainers_weights(family, tmp_path):
    """Runs last for the family: the engine keeps the pushed weights."""
    from safetensors.torch import load_file, save_file

    name, path, eng = family
    other = tmp_path / "other"
    other.mkdir()
    g = torch.Generator().manual_seed(1)
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v for k, v in sd.items()}
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    for fn in os.listdir(path):
        if fn.endswith(".json"):
            (other / fn).write_bytes(open(os.path.join(path, fn), "rb").read())
    probe = PROBE + [5, 6, 300, 301, 7]
    before = _probe_logprobs(eng, name, probe, "before")
    out = tmp_path / "sync.json"
    r = run_torchrun("mrl.jobs.sync_weights", ["--hf", str(other), "--engines", f"{eng.url}@1", "--version", "7",
                                               "--out", str(out), "--tp", "2", "--ep", "2", "--etp", "1"], 2)
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["engine_versions"] == ["7"] and rep["senders"] == 2
    synced = _probe_logprobs(eng, name, probe, "synced")
    _reload_from_disk(eng, str(other), "8")
    from_disk = _probe_logprobs(eng, name, probe, "disk")
    print(f"\n[{name}] weight sync: engine probe moved by {np.abs(synced - before).max():.2e}; synced vs "
          f"loaded from disk {np.abs(synced - from_disk).max():.2e}; engine vs megatron "
          f"{max(rep['probe_max_abs_logprob_diff']):.2e}")
    assert np.abs(synced - before).max() > 0.05  # the engine really changed
    assert np.abs(synced - from_disk).max() < 1e-6  # ... to exactly the checkpoint's weights
    assert max(rep["probe_max_abs_logprob_diff"]) <= 1e-4, rep  # ... which megatron holds
