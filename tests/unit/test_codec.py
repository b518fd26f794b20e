"""Routes codec: SGLang base64 (int32, or uint8/int16 from mrl's engines) -> compact uint8/uint16 [T, moe_layers, K],
validated."""

import base64

import numpy as np
import pytest

from mrl.sglang.protocol import EngineProtocolError, parse_generate, parse_generate_item
from mrl.routing.codec import RoutesCodec, RoutesError, repeats
from tests.fakes.fake_sglang import fixture

CTX = ("http://fixture", "/generate")
TINY = RoutesCodec(num_layers=3, top_k=2, num_experts=8, moe_layers=(0, 1, 2))


def test_decode_recorded_routes():
    out = parse_generate(fixture("gen_routed.json")["body"], CTX)
    r = TINY.decode(out.routed_experts, prompt_len=5, response_len=6)
    assert r.dtype == np.uint8 and r.shape == (10, 3, 2)
    assert r[0].tolist() == [[2, 6], [7, 4], [5, 3]]  # top-k order kept
    # 4x smaller than int32, and base64 JSON costs another 4/3
    assert TINY.compact_bytes_per_token() == 6
    assert len(out.routed_experts) / 10 == pytest.approx(32, abs=1)


def test_stop_abort_and_zero_token_row_rules():
    stop = parse_generate(fixture("gen_stop_token.json")["body"], CTX)
    assert TINY.decode(stop.routed_experts, prompt_len=5, response_len=len(stop.output_ids)).shape[0] == 7
    ab = parse_generate(fixture("gen_aborted_by_rid.json")["body"], CTX)
    assert TINY.decode(ab.routed_experts, prompt_len=5, response_len=len(ab.output_ids)).shape[0] == 35
    zero = parse_generate(fixture("gen_max_new_0.json")["body"], CTX)
    assert zero.output_ids == [] and TINY.decode(zero.routed_experts, prompt_len=5, response_len=0).shape[0] == 5


def test_resumed_routes_cover_the_whole_sequence_and_agree_on_the_prefix():
    d = fixture("partial_resume.json")
    a, b = parse_generate_item(d["aborted"], CTX), parse_generate_item(d["resumed"], CTX)
    ra = TINY.decode(a.routed_experts, prompt_len=5, response_len=len(a.output_ids))
    rb = TINY.decode(b.routed_experts, prompt_len=5 + len(a.output_ids), response_len=len(b.output_ids))
    assert rb.shape[0] == 5 + len(a.output_ids) + len(b.output_ids) - 1 == 404
    assert np.array_equal(rb[: ra.shape[0]], ra)


def _b64(arr, dtype="<i4"):
    return base64.b64encode(np.asarray(arr).astype(dtype).tobytes()).decode()


def test_dense_layers_are_dropped():
    codec = RoutesCodec(num_layers=4, top_k=2, num_experts=8, moe_layers=(1, 3))
    raw = np.arange(3 * 4 * 2).reshape(3, 4, 2) % 8
    raw[:, [0, 2]] = 0
    r = codec.decode(_b64(raw), prompt_len=2, response_len=2)
    assert r.shape == (3, 2, 2) and np.array_equal(r, raw[:, [1, 3]])


def test_uint16_above_256_experts():
    codec = RoutesCodec(num_layers=1, top_k=2, num_experts=300, moe_layers=(0,))
    r = codec.decode(_b64([[[299, 3]], [[256, 0]]]), prompt_len=2, response_len=1)
    assert r.dtype == np.uint16 and r.max() == 299
    assert RoutesCodec(num_layers=1, top_k=1, num_experts=256, moe_layers=(0,)).dtype == np.uint8


@pytest.mark.parametrize("wire", ["u1", "<i2", "<u2", "<i4"])
def test_every_wire_type_decodes_to_the_same_routes(wire):
    """int32 from plain SGLang, uint8 / int16 from mrl's engines (uint16 read alike); the item size comes
    from the byte count, the rows being known."""
    ids = np.arange(3 * 4 * 2).reshape(3, 4, 2) % 8
    ids[:, [0, 2]] = 0
    codec = RoutesCodec(num_layers=4, top_k=2, num_experts=8, moe_layers=(1, 3))
    big = RoutesCodec(num_layers=4, top_k=2, num_experts=300, moe_layers=(1, 3))
    if wire in ("<i2", "<u2"):  # mrl's engines send 16 bits only when an id needs them
        codec, ids = big, ids + np.where(ids > 0, 290, 0)
    payload = _b64(ids, wire)
    assert len(base64.b64decode(payload)) == ids.size * np.dtype(wire).itemsize
    r = codec.decode(payload, prompt_len=2, response_len=2)
    assert r.dtype == codec.dtype and np.array_equal(r, ids[:, [1, 3]])
    assert np.array_equal(r, codec.decode(_b64(ids), prompt_len=2, response_len=2))  # same as int32


def test_uint8_payload_is_a_quarter_of_int32():
    out = parse_generate(fixture("gen_routed.json")["body"], CTX)
    ids = np.frombuffer(base64.b64decode(out.routed_experts), "<i4")
    small = _b64(ids, "u1")
    assert len(base64.b64decode(small)) * 4 == len(base64.b64decode(out.routed_experts))
    assert np.array_equal(TINY.decode(small, prompt_len=5, response_len=6),
                          TINY.decode(out.routed_experts, prompt_len=5, response_len=6))


def test_a_bad_length_names_the_sizes():
    with pytest.raises(RoutesError) as e:
        TINY.decode(_b64(np.zeros((4, 3, 2))), prompt_len=5, response_len=6)
    assert str(e.value) == ("routed_experts has 96 bytes, expected 10 rows x 3 layers x 2 top-k x 1, 2 or 4 bytes "
                            "= 60, 120 or 240 (it holds whole rows: 16 of uint8, 8 of 16-bit, 4 of int32)")


@pytest.mark.parametrize("b64,kw,msg", [
    (_b64(np.zeros((4, 3, 2))), dict(prompt_len=5, response_len=6), "96 bytes, expected 10 rows"),
    (_b64(np.zeros((11, 3, 2)), "u1"), dict(prompt_len=5, response_len=6), "66 bytes, expected 10 rows"),
    (_b64(np.full((10, 3, 2), 8)), dict(prompt_len=5, response_len=6), "outside"),
    (_b64(np.full((10, 3, 2), 8), "u1"), dict(prompt_len=5, response_len=6), "outside"),
    (_b64(np.full((10, 3, 2), -1)), dict(prompt_len=5, response_len=6), "outside"),
    (_b64(np.full((10, 3, 2), -1), "<i2"), dict(prompt_len=5, response_len=6), "outside"),
    # int32 of 5 rows has the bytes of 10 rows of 16-bit: ids all below 256 give it away
    (_b64(np.ones((5, 3, 2))), dict(prompt_len=5, response_len=6), "fits in uint8"),
    ("not base64!!", dict(prompt_len=5, response_len=6), "base64"),
    (_b64(np.zeros(7)), dict(prompt_len=5, response_len=6), "28 bytes"),
])
def test_invalid_routes_are_refused(b64, kw, msg):
    with pytest.raises(RoutesError, match=msg):
        TINY.decode(b64, **kw)


def test_a_token_routed_twice_to_one_expert_is_refused():
    """A router picks top_k distinct experts per token and layer: a repeated one is an engine bug."""
    ids = np.array([[[1, 2], [3, 4], [5, 6]]] * 4, dtype=np.uint8)  # 4 rows, 3 layers, top-2
    ok = base64.b64encode(ids.tobytes()).decode()
    assert TINY.decode(ok, prompt_len=3, response_len=2).shape == (4, 3, 2)
    ids[2, 1] = [4, 4]
    with pytest.raises(RoutesError, match=r"repeats an expert .* \(row 2, MoE layer 1: \[4, 4\]\)"):
        TINY.decode(base64.b64encode(ids.tobytes()).decode(), prompt_len=3, response_len=2)


@pytest.mark.parametrize("k, dtype", [(8, np.uint8), (8, np.uint16), (6, np.uint8), (2, np.uint8)])
def test_repeats_finds_every_repeated_pair(k, dtype):
    """Against sorting: distinct rows pass; a repeat at any pair of positions is found, on the top-8 one-byte
    path (ids as one 64-bit word) and on the pairwise one; 0 and 255 (all bits off or on) included."""
    rng = np.random.default_rng(0)
    hi = 256 if dtype == np.uint8 else 1024
    ids = np.stack([rng.choice(hi, size=k, replace=False) for _ in range(500)]).astype(dtype)
    ids[0] = np.arange(k)
    ids[1] = hi - 1 - np.arange(k)
    for n, (i, j) in enumerate((i, j) for i in range(k) for j in range(k) if i != j):
        ids[10 + n, i] = ids[10 + n, j]
    want = (np.diff(np.sort(ids, axis=-1), axis=-1) == 0).any(-1)
    assert want.sum() == k * (k - 1)
    np.testing.assert_array_equal(repeats(ids), want)


def test_a_repeat_in_a_top8_payload_names_its_row_and_layer():
    codec = RoutesCodec(num_layers=4, top_k=8, num_experts=128, moe_layers=(1, 3))
    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.choice(128, 8, replace=False) for _ in range(4)]) for _ in range(9)]).astype(np.uint8)
    got = codec.decode(base64.b64encode(ids.tobytes()).decode(), prompt_len=5, response_len=5)
    np.testing.assert_array_equal(got, ids[:, [1, 3]])
    ids[6, 3, 7] = ids[6, 3, 0]
    with pytest.raises(RoutesError, match=r"\(row 6, MoE layer 1: "):
        codec.decode(base64.b64encode(ids.tobytes()).decode(), prompt_len=5, response_len=5)


def test_a_positive_logprob_is_refused():
    body = fixture("gen_routed.json")["body"]
    body = {**body, "meta_info": {**body["meta_info"]}}
    triples = [list(t) for t in body["meta_info"]["output_token_logprobs"]]
    triples[1][0] = 0.5
    body["meta_info"]["output_token_logprobs"] = triples
    with pytest.raises(EngineProtocolError, match=r"output_token_logprobs\[1\]: logprob is 0.5 > 0"):
        parse_generate(body, CTX)
