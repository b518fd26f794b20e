"""Synthetic weights end to end, with no checkpoint on disk: a real SGLang engine started without weights
(``load_format=dummy``, config.json only) gets them pushed from a generator in buckets
(``mrl.weight_sync.named``, the disk transport's update), and megatron imports the same generator
(``--synthetic-seed``). Then:
- the engine's logprobs equal megatron's on the sampled tokens (fp32, 1e-3 as for a checkpoint both read);
- megatron replaying the engine's experts dispatches exactly them, and its natural routing agrees too (the
  two hold the same weights);
- before the push the engine's weights were SGLang's dummy ones (its logprobs far from megatron's), and it
  reports the pushed version (an integer, as mrl numbers versions) after the push.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import numpy as np
import pytest

from mrl.engine.launcher import Engine
from mrl.models import get_bridge
from mrl.models.synthetic import SyntheticWeights
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec
from mrl.sglang.client import EngineClient
from mrl.sglang.keys import ENV_VAR, ensure_run_secrets
from mrl.weight_sync.named import push_named
from tests.conftest import run_torchrun
from tests.jobs.replay_check import agreement, logprob_diffs

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5], [1, 11, 12, 13, 14, 15, 16], [1, 250, 251]]
SEED = 7


@pytest.fixture(scope="module")
def config_only(ckpt_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "model"
    os.makedirs(path)
    shutil.copy(os.path.join(ckpt_dir["tiny"], "config.json"), path)
    return str(path)


@pytest.fixture(scope="module")
def dummy_engine(config_only, tmp_path_factory):
    before = os.environ.get(ENV_VAR)
    keys = ensure_run_secrets(str(tmp_path_factory.mktemp("run")))
    e = Engine(model_path=config_only, tp=1, log_dir=str(tmp_path_factory.mktemp("logs")), name="dummy",
               load_format="dummy", secrets=keys)
    e.start()
    try:
        e.wait_healthy(timeout=600)
        yield e
    finally:
        e.stop()
        if before is None:
            os.environ.pop(ENV_VAR, None)


def _prompt_logprobs(url: str, tokens: list[int]) -> list[float]:
    async def go():
        c = EngineClient(url)
        try:
            out = await c.generate(tokens, {"max_new_tokens": 1, "temperature": 0.0}, rid="probe",
                                   logprob_start_len=0)
            return out.input_logprobs[1:]
        finally:
            await c.close()
    return asyncio.run(go())


def _version(url: str) -> str:
    async def go():
        c = EngineClient(url)
        try:
            return await c.weight_version()
        finally:
            await c.close()
    return asyncio.run(go())


def test_engine_with_pushed_synthetic_weights_matches_megatron_importing_them(dummy_engine, config_only,
                                                                             tmp_path):
    url = dummy_engine.url
    probe = PROMPTS[2]
    dummy_lp = _prompt_logprobs(url, probe)
    weights = SyntheticWeights(config_only, seed=SEED)
    stats = push_named([dummy_engine.endpoint], weights.tensors(), version="1", transport="disk",
                       bucket_mb=0.25, export_dir=str(tmp_path / "buckets"))
    assert stats.buckets > 1 and stats.tensors == len(weights.shapes) and stats.bytes_sent == weights.num_bytes
    assert not os.listdir(tmp_path / "buckets")  # each bucket removed once loaded
    assert _version(url) == "1"

    codec = RoutesCodec.from_bridge(get_bridge(config_only))

    async def sample():
        c = EngineClient(url)
        mgr = RolloutManager([c], codec=codec, sampling=SamplingSpec(max_new_tokens=10, temperature=1.0,
                                                                       ignore_eos=True))
        try:
            groups = await asyncio.gather(*(mgr.generate_group(p, n=1, group_id=i) for i, p in enumerate(PROMPTS)))
        finally:
            await c.close()
        return [g[0] for g in groups]

    out = asyncio.run(sample())
    sj = {"sequences": [s.tokens for s in out], "routes": [s.routes.tolist() for s in out],
          "engine_logprobs": [s.response_logprobs for s in out], "prompt_lens": [len(s.prompt_ids) for s in out]}
    (tmp_path / "samples.json").write_text(json.dumps(sj))
    run_torchrun("tests.jobs.replay_check", ["--hf", config_only, "--synthetic-seed", str(SEED), "--input",
                                            str(tmp_path / "samples.json"), "--micro-batches", "1",
                                            "--out", str(tmp_path / "rep")], nproc=1)
    reps = [json.loads((tmp_path / "rep" / "rank0.json").read_text())]
    megatron_probe = reps[0]["logprobs_natural"][0][2][:len(probe) - 1]  # sample 2 starts with the probe
    on_agree, on_total = agreement(sj, reps, "forward_calls")
    off_agree, off_total = agreement(sj, reps, "natural_calls")
    assert on_total > 0 and on_agree == on_total
    assert off_agree == off_total  # same weights: megatron's own routing is the engine's
    assert logprob_diffs(sj, reps, "logprobs_replay")["max_abs"] <= 1e-3
    assert logprob_diffs(sj, reps, "logprobs_natural")["max_abs"] <= 1e-3
    # the push changed the engine: its dummy weights gave other logprobs for the probe
    assert np.abs(np.asarray(dummy_lp) - np.asarray(megatron_probe)).max() > 0.05
    assert np.abs(np.asarray(_prompt_logprobs(url, probe)) - np.asarray(megatron_probe)).max() <= 1e-3
