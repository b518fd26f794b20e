"""Every recorded SGLang 0.5.10 reply parses (or yields the error the client raises for it)."""

import base64
import glob
import json
import os

import numpy as np
import pytest

from mrl.sglang.protocol import (
    EngineHTTPError,
    EngineProtocolError,
    error_message,
    parse_generate,
    parse_generate_item,
    parse_model_info,
    parse_status_ok,
    parse_success,
)
from tests.fakes.fake_sglang import FIXTURES, fixture

CTX = ("http://fixture", "/x")
ALL = sorted(os.path.basename(f) for f in glob.glob(os.path.join(FIXTURES, "*.json")))


def test_fixture_set_is_complete():
    assert len(ALL) == 59


def _expect_parse(name: str, d):
    """Parse one fixture the way the client does; return what it parsed to."""
    if name == "partial_resume.json":
        return [parse_generate_item(d["aborted"], CTX), parse_generate_item(d["resumed"], CTX)]
    if name.startswith("inflight_result_"):
        return parse_generate_item(d, CTX, expect_logprobs=True)
    if name == "update_from_distributed_request_example.json":
        assert len(d["names"]) == len(d["dtypes"]) == len(d["shapes"]) and d["load_format"] == "flattened_bucket"
        return d
    if name == "gen_stream.json":
        chunks = [json.loads(line[len("data: "):]) for line in d["lines"] if line != "data: [DONE]"]
        assert d["lines"][-1] == "data: [DONE]"
        return [parse_generate_item(c, CTX) for c in chunks]
    status, body = d["status"], d.get("body", d.get("text"))
    if status != 200:
        msg = error_message(body if isinstance(body, dict) else None, body if isinstance(body, str) else "")
        assert msg and msg != "<empty body>"
        if isinstance(body, dict) and "success" in body:
            with pytest.raises(EngineHTTPError):
                parse_success(body, CTX)
        return msg
    if name.startswith("gen_"):
        return parse_generate(body, CTX)
    if name.startswith(("pause_", "continue_")):
        return parse_status_ok(body, CTX)
    if name.startswith(("init_", "destroy_", "update_", "tp2_")):
        return parse_success(body, CTX)
    if name.startswith("model_info"):
        return parse_model_info(body, CTX)
    if name.startswith(("abort_", "health")):
        assert body == ""
        return body
    if name.startswith("flush_"):
        assert body.startswith("Cache flushed.")
        return body
    if name.endswith("_memory_occupation.json"):
        assert body is None
        return body
    raise AssertionError(f"no parser for {name}")


@pytest.mark.parametrize("name", ALL)
def test_every_fixture_parses(name):
    _expect_parse(name, fixture(name))  # raises on anything the client would not accept


def test_generate_fields_match_the_recording():
    out = parse_generate(fixture("gen_routed.json")["body"], CTX, expect_logprobs=True)
    assert out.output_ids == [68, 214, 151, 157, 214, 157]
    assert out.finish.type == "length" and not out.finish.aborted
    assert out.output_logprobs[0] == pytest.approx(-5.707941055297852)
    assert out.weight_version == "default" and out.prompt_tokens == 5
    raw = np.frombuffer(base64.b64decode(out.routed_experts), "<i4").reshape(-1, 3, 2)
    assert raw.shape == (10, 3, 2) and raw[0].tolist() == [[2, 6], [7, 4], [5, 3]]


def test_batch_and_n2_are_lists_with_ids():
    b = parse_generate(fixture("gen_batch2.json")["body"], CTX)
    assert [o.rid for o in b] == ["a1", "a2"]
    n2 = parse_generate(fixture("gen_n2.json")["body"], CTX)
    assert len(n2) == 2 and all(o.rid != "myrid" for o in n2)


def test_stop_and_abort_finish_reasons():
    stop = parse_generate(fixture("gen_stop_token.json")["body"], CTX)
    assert stop.finish.type == "stop" and stop.finish.matched == 151 and stop.output_ids[-1] == 151
    ab = parse_generate_item(fixture("inflight_result_retract.json"), CTX)
    assert ab.finish.aborted and ab.total_retractions == 1 and len(ab.output_ids) == 409


def test_stream_chunks_are_cumulative_and_routes_only_at_the_end():
    d = fixture("gen_stream.json")
    chunks = [parse_generate_item(json.loads(x[6:]), CTX) for x in d["lines"] if x != "data: [DONE]"]
    assert [len(c.output_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c.finish is None for c in chunks[:-1]) and chunks[-1].finish.type == "length"
    assert all(c.routed_experts is None for c in chunks[:-1]) and chunks[-1].routed_experts


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b["meta_info"]["output_token_logprobs"][0].__setitem__(0, None), "NaN"),
    (lambda b: b.pop("meta_info"), "missing 'meta_info'"),
    (lambda b: b.__setitem__("output_ids", [1, "x"]), "output_ids"),
    (lambda b: b["meta_info"].__setitem__("finish_reason", {"type": "exploded"}), "finish_reason"),
    (lambda b: b["meta_info"].__setitem__("routed_experts", [1, 2]), "routed_experts"),
    (lambda b: b["meta_info"].__setitem__("completion_tokens", 99), "completion_tokens"),
    (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "triples"),
])
def test_malformed_generate_replies_name_the_field(mutate, msg):
    body = json.loads(json.dumps(fixture("gen_routed.json")["body"]))
    mutate(body)
    with pytest.raises(EngineProtocolError, match=msg):
        parse_generate(body, CTX, expect_logprobs=True)
