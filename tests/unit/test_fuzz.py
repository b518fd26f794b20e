"""Fuzzing (hypothesis, 1000 cases each) of what parses engine bytes: the SGLang reply parsers and the routes codec.

Parsers get arbitrary JSON values and mutations of the recorded 0.5.10 replies: they return a well-typed
result or raise ``EngineProtocolError`` (``parse_success`` also ``EngineHTTPError`` for ``success: false``),
never another exception. The codec round-trips random shapes on both the uint8 and uint16 paths and on
every wire type (int32, uint8, int16), and raises ``RoutesError`` for bad base64, wrong lengths and
out-of-range experts.
"""

import base64
import copy
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrl.sglang.protocol import (
    EngineHTTPError,
    EngineProtocolError,
    FinishReason,
    GenerateOutput,
    error_message,
    parse_generate,
    parse_model_info,
    parse_status_ok,
    parse_success,
)
from mrl.routing.codec import RoutesCodec, RoutesError
from tests.fakes.fake_sglang import fixture

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CTX = ("http://fuzz", "/x")


def _recorded_generate_bodies() -> list:
    bodies = [fixture(n)["body"] for n in ("gen_basic.json", "gen_batch2.json", "gen_eos_default.json",
                                           "gen_logprob_start0_top2.json", "gen_max_new_0.json", "gen_n2.json",
                                           "gen_rid.json", "gen_routed.json", "gen_stop_token.json",
                                           "gen_aborted_by_rid.json")]
    bodies += [fixture(f"inflight_result_{m}.json") for m in ("abort", "retract", "in_place")]
    bodies += list(fixture("partial_resume.json").values())
    bodies += [json.loads(x[6:]) for x in fixture("gen_stream.json")["lines"] if x != "data: [DONE]"]
    return bodies


GENERATE = _recorded_generate_bodies()
OTHER = [fixture(n)["body"] for n in (
    "init_weights_update_group.json", "destroy_weights_update_group.json", "destroy_group_missing.json",
    "update_from_distributed_bad_shape.json", "update_weights_from_disk.json", "update_weight_version.json",
    "pause_abort.json", "continue_after_abort.json", "model_info.json", "gen_bad_top_p.json",
    "get_weight_version_404.json")]

json_scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                              max_size=4),
                           max_leaves=12)


def _paths(v, here=()):
    yield here
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, here + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, here + (i,))


@st.composite
def mutated(draw, recorded: list):
    """A recorded reply with 1-4 random edits: drop a key or list item, or replace any node (the root too)."""
    body = copy.deepcopy(draw(st.sampled_from(recorded)))
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(body))
        path = draw(st.sampled_from(paths))
        if not path:
            body = draw(json_values)
            continue
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values | json_scalars)
    return body


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def assert_well_typed(out: GenerateOutput) -> None:
    assert isinstance(out, GenerateOutput)
    assert isinstance(out.rid, str) and isinstance(out.weight_version, str)
    assert isinstance(out.output_ids, list) and all(_is_int(t) and t >= 0 for t in out.output_ids)
    assert out.output_logprobs is None or (len(out.output_logprobs) == len(out.output_ids)
                                           and all(_is_num(x) for x in out.output_logprobs))
    f = out.finish
    assert f is None or (isinstance(f, FinishReason) and f.type in ("length", "stop", "abort")
                         and (f.matched is None or _is_int(f.matched) or isinstance(f.matched, str))
                         and (f.message is None or isinstance(f.message, str)))
    assert out.prompt_tokens is None or _is_int(out.prompt_tokens)
    assert out.cached_tokens is None or _is_int(out.cached_tokens)
    assert _is_int(out.completion_tokens) and out.completion_tokens == len(out.output_ids)
    assert _is_int(out.total_retractions)
    assert out.routed_experts is None or isinstance(out.routed_experts, str)
    assert out.output_top_logprobs is None or all(
        isinstance(step, list) and all(isinstance(e, tuple) and _is_num(e[0]) and _is_int(e[1]) for e in step)
        for step in out.output_top_logprobs)
    assert out.input_logprobs is None or all(x is None or _is_num(x) for x in out.input_logprobs)


def check_generate(body, expect_logprobs: bool) -> None:
    try:
        out = parse_generate(body, CTX, expect_logprobs=expect_logprobs)
    except EngineProtocolError:
        return
    for o in out if isinstance(out, list) else [out]:
        assert_well_typed(o)


def test_recorded_generate_replies_are_well_typed():
    for body in GENERATE:
        out = parse_generate(body, CTX)
        for o in out if isinstance(out, list) else [out]:
            assert_well_typed(o)


@FUZZ
@given(body=json_values, expect_logprobs=st.booleans())
def test_generate_parser_on_arbitrary_json(body, expect_logprobs):
    check_generate(body, expect_logprobs)


@FUZZ
@given(body=mutated(GENERATE), expect_logprobs=st.booleans())
def test_generate_parser_on_mutated_recordings(body, expect_logprobs):
    check_generate(body, expect_logprobs)


@FUZZ
@given(body=json_values | mutated(OTHER), text=st.text(max_size=40))
def test_control_reply_parsers(body, text):
    try:
        assert isinstance(parse_success(body, CTX), str)
    except (EngineProtocolError, EngineHTTPError):
        pass
    try:
        assert parse_status_ok(body, CTX) is None
    except EngineProtocolError:
        pass
    try:
        assert isinstance(parse_model_info(body, CTX)["weight_version"], str)
    except EngineProtocolError:
        pass
    assert isinstance(error_message(body, text), str)


# -- routes codec ---------------------------------------------------------------------------------

@st.composite
def codecs_and_routes(draw):
    num_layers = draw(st.integers(1, 6))
    moe = tuple(i for i in range(num_layers) if draw(st.booleans())) or (num_layers - 1,)
    num_experts = draw(st.sampled_from([1, 2, 8, 255, 256, 257, 1000, 65536]) | st.integers(1, 4096))
    codec = RoutesCodec(num_layers=num_layers, top_k=draw(st.integers(1, min(8, num_experts))),
                        num_experts=num_experts, moe_layers=moe)
    prompt_len = draw(st.integers(1, 12))
    response_len = draw(st.integers(0, 12))
    rows = codec.expected_rows(prompt_len, response_len)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)  # a router's top-k: distinct experts per token and layer
    ids = np.array([[rng.choice(num_experts, codec.top_k, replace=False) for _ in range(num_layers)]
                    for _ in range(rows)], dtype="<i4").reshape(rows, num_layers, codec.top_k)
    dense = [i for i in range(num_layers) if i not in moe]
    ids[:, dense, :] = 0  # the engine reports dense layers as zeros
    return codec, ids, prompt_len, response_len


def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<i4").tobytes()).decode()


@FUZZ
@given(case=codecs_and_routes())
def test_codec_round_trip(case):
    codec, ids, p, r = case
    out = codec.decode(_b64(ids), prompt_len=p, response_len=r)
    assert out.dtype == (np.uint8 if codec.num_experts <= 256 else np.uint16)
    assert out.shape == (ids.shape[0], len(codec.moe_layers), codec.top_k) and out.flags.c_contiguous
    assert np.array_equal(out.astype(np.int64), ids[:, list(codec.moe_layers), :])


@FUZZ
@given(case=codecs_and_routes())
def test_codec_round_trip_on_the_compact_wire(case):
    """What mrl's engines send (``engine_patches.compact_ids``): the smallest type holding every id."""
    torch = pytest.importorskip("torch")
    from mrl.engine.server.patches import compact_ids

    codec, ids, p, r = case
    small = compact_ids(torch.from_numpy(ids)).numpy()
    b64 = base64.b64encode(small.tobytes()).decode()
    assert np.array_equal(codec.decode(b64, prompt_len=p, response_len=r), codec.decode(_b64(ids), prompt_len=p,
                                                                                        response_len=r))


@FUZZ
@given(case=codecs_and_routes(), edit=st.sampled_from(["drop_row", "add_row", "cut_bytes", "bad_expert",
                                                        "neg_expert", "dup_expert", "garbage", "bad_padding",
                                                        "non_ascii"]),
       junk=st.text(max_size=30), cut=st.integers(1, 7))
def test_codec_refuses_malformed_routes(case, edit, junk, cut):
    codec, ids, p, r = case
    moe = list(codec.moe_layers)
    if edit == "drop_row":
        b64 = _b64(ids[:-1])
    elif edit == "add_row":
        b64 = _b64(np.concatenate([ids, ids[:1]]))
    elif edit == "cut_bytes":
        raw = np.ascontiguousarray(ids, dtype="<i4").tobytes()
        b64 = base64.b64encode(raw[:-cut]).decode()
    elif edit in ("bad_expert", "neg_expert"):
        ids = ids.copy()
        ids[-1, moe[-1], -1] = codec.num_experts if edit == "bad_expert" else -1
        b64 = _b64(ids)
    elif edit == "dup_expert":
        if codec.top_k < 2 or ids.shape[0] == 0:
            return
        ids = ids.copy()
        ids[-1, moe[-1], 1] = ids[-1, moe[-1], 0]
        b64 = _b64(ids)
    elif edit == "garbage":
        b64 = _b64(ids)[:-1] + "!" + junk
    elif edit == "bad_padding":  # padding inside the data
        b64 = _b64(ids)[:4] + "=" + _b64(ids)[4:]
    else:
        b64 = _b64(ids) + "é" + junk
    if edit in ("drop_row", "add_row", "cut_bytes"):
        per_seq = ids.shape[0] * codec.num_layers * codec.top_k
        if len(base64.b64decode(b64)) in (per_seq, 2 * per_seq):
            # the byte count of the right rows in uint8 or 16-bit: length cannot tell (the codec's docstring)
            try:
                codec.decode(b64, prompt_len=p, response_len=r)
            except RoutesError:
                pass
            return
    with pytest.raises(RoutesError):
        codec.decode(b64, prompt_len=p, response_len=r)


@FUZZ
@given(b64=st.text(max_size=64) | st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
       p=st.integers(-2, 20), r=st.integers(-2, 20))
def test_codec_on_arbitrary_text(b64, p, r):
    codec = RoutesCodec(num_layers=2, top_k=2, num_experts=300, moe_layers=(1,))
    try:
        out = codec.decode(b64, prompt_len=p, response_len=r)
    except RoutesError:
        return
    assert out.dtype == np.uint16 and out.shape == (codec.expected_rows(p, r), 1, 2)
