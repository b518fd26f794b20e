"""``weight_sync.pause_mode``: the typed key and its refusals, the per-token versions a reply carries, and the
rollout manager's rule for replies without them (``docs/weight_sync.md#pause-modes``). The engines' side, with
real SGLang engines: ``tests/integration/test_inflight_sync.py``."""

from __future__ import annotations

import asyncio

import pytest

from mrl.config.load import compose
from mrl.config.schema import PauseMode
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import Sample, SamplingSpec
from mrl.sglang.client import EngineClient
from mrl.sglang.protocol import EngineProtocolError, parse_generate_item
from mrl.sglang.wire import TOKEN_VERSIONS_KEY
from tests.fakes.fake_sglang import FakeSGLang

CTX = ("http://e", "/generate")


def test_default_is_abort_and_every_mode_composes():
    cfg = compose([])
    assert cfg.weight_sync.pause_mode == PauseMode.abort and not cfg.weight_sync.keeps_requests
    for transport in ("distributed", "disk", "tensor"):
        for mode in ("retract", "in_place", "staged"):
            if (transport, mode) == ("distributed", "staged"):
                continue
            ws = compose([f"weight_sync={transport}", f"weight_sync.pause_mode={mode}"]).weight_sync
            assert ws.pause_mode == PauseMode(mode) and ws.keeps_requests


def test_an_unknown_mode_names_the_key_and_the_choices():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        compose(["weight_sync.pause_mode=keep"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "pause_mode" in msg and all(m in msg for m in ("abort", "retract", "in_place")), msg


@pytest.mark.parametrize("overrides,message", [
    (["engine=gpu", "model.dtype=bf16", "weight_sync.pause_mode=in_place"],
     r"^weight_sync\.pause_mode: =in_place with GPU engines: the versions of tokens decoded around"),
    (["engine=gpu", "model.dtype=bf16", "weight_sync=tensor", "weight_sync.pause_mode=staged"],
     r"^weight_sync\.pause_mode: =staged with GPU engines: the versions of tokens decoded around"),
    (["+experiment=lora_tiny", "weight_sync.pause_mode=in_place"],
     r"^weight_sync\.pause_mode: =in_place with model\.lora: a LoRA run never pauses"),
    (["engine.dp=2", "+engine.server_args.enable_dp_attention=true", "weight_sync.pause_mode=retract"],
     r"^weight_sync\.pause_mode: =retract with engine\.dp=2"),
    (["weight_sync=distributed", "weight_sync.pause_mode=staged"],
     r"^weight_sync\.pause_mode: =staged with weight_sync\.transport=distributed"),
    (["engine=gpu", "model.dtype=bf16", "weight_sync=tensor", "engine.quantization=fp8",
      "weight_sync.pause_mode=staged"],
     r"^weight_sync\.pause_mode: =staged with engine\.quantization=fp8"),
])
def test_modes_the_run_cannot_honour_are_refused_at_config_load(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_keeping_requests_on_engines_attached_by_url_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^weight_sync\.pause_mode: =in_place with engine\.urls: engines attached"):
        compose([f"run_dir={tmp_path}/r", "engine.urls=[http://10.0.0.5:30000]", "weight_sync.pause_mode=in_place"])
    assert compose([f"run_dir={tmp_path}/r", "engine.urls=[http://10.0.0.5:30000]"]).engine.urls
    assert compose(["engine=gpu", "model.dtype=bf16", "weight_sync.pause_mode=retract"]).weight_sync.keeps_requests
    assert compose(["weight_sync=disk", "weight_sync.pause_mode=staged"]).weight_sync.keeps_requests
    cfg = compose([f"run_dir={tmp_path}/r", "weight_sync.pause_mode=retract"])
    assert cfg.weight_sync.pause_mode.value == "retract"


def _body(ids, tags=None, version="3"):
    meta = {"id": "r", "finish_reason": {"type": "length"}, "weight_version": version, "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    if tags is not None:
        meta[TOKEN_VERSIONS_KEY] = tags
    return {"output_ids": ids, "meta_info": meta}


def test_a_reply_carries_one_version_per_token():
    out = parse_generate_item(_body([5, 6, 7], [2, 2, 3]), CTX)
    assert out.token_versions == [2, 2, 3] and out.weight_version == "3"
    assert parse_generate_item(_body([5, 6]), CTX).token_versions is None
    for bad in ([2, 2], [2, True, 3], [2, None, 3], "223"):
        with pytest.raises(EngineProtocolError, match=TOKEN_VERSIONS_KEY):
            parse_generate_item(_body([5, 6, 7], bad), CTX)


def test_token_versions_are_the_samples_and_the_reply_version_only_without_inflight_updates():
    mgr = RolloutManager([EngineClient("http://e")], sampling=SamplingSpec())
    inflight = RolloutManager([EngineClient("http://e")], sampling=SamplingSpec(), inflight_updates=True)
    tagged, untagged = parse_generate_item(_body([5, 6, 7], [2, 2, 3]), CTX), parse_generate_item(_body([5, 6]), CTX)
    assert mgr._versions(tagged, None) == inflight._versions(tagged, None) == [2, 2, 3]
    assert mgr._versions(untagged, None) == [3, 3]
    assert inflight._versions(tagged, 9) == [9, 9, 9]  # LoRA: the adapter's version
    with pytest.raises(ValueError, match="no per-token weight versions"):
        inflight._versions(untagged, None)


def test_an_engine_without_token_versions_fails_the_sample_at_once_when_syncs_keep_requests():
    """Retrying could not help (every reply of that engine lacks them): the sample fails naming the cause."""

    async def go(url):
        mgr = RolloutManager([EngineClient(url)], sampling=SamplingSpec(max_new_tokens=4), inflight_updates=True)
        return await mgr.run_sample(Sample(prompt_ids=[1, 2, 3], group_id=0, index=0, max_new_tokens=4))

    with FakeSGLang() as srv:
        s = asyncio.run(go(srv.url))
    assert s.error is not None and "no per-token weight versions" in s.error and s.num_retries == 0
