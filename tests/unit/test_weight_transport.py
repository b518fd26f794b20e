"""Transport seams that run without engines: the tensor payload format and its CPU refusal."""

import pytest
import torch

from mrl.weight_sync.tensor import pickle_named_tensors, serialize_named_tensors


def test_tensor_payload_is_what_sglang_deserializes():
    """Same-process round trip through SGLang 0.5.10's own (restricted) deserializer."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    named = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.ones(4))]
    back = MultiprocessingSerializer.deserialize(pickle_named_tensors(named))
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert torch.equal(a, b)


def test_cpu_tensors_are_refused_before_reaching_a_server():
    with pytest.raises(ValueError, match="CUDA tensors only.*model.norm.weight"):
        serialize_named_tensors([("model.norm.weight", torch.ones(4))])


def test_tensor_transport_refuses_without_cuda():
    from mrl.weight_sync.tensor import TensorTransport

    with pytest.raises(RuntimeError, match="transport=tensor needs CUDA"):
        TensorTransport(executor=None)


# -- flat buckets over CUDA IPC: which path each push takes (the CUDA calls faked on CPU) -------------------
class _Step:
    def __init__(self, bucket, flat):
        self.bucket, self.flat, self.filled = bucket, flat, 0

    def fill(self):
        self.filled += 1


def _transport(monkeypatch, answers: dict[str, str]):
    """A TensorTransport over a one-rank executor stub; ``answers``: each engine's message. Returns it and the
    posts [(url, payload, load_format)]."""
    import types

    from mrl.sglang.endpoint import EngineEndpoint
    from mrl.weight_sync import tensor
    from mrl.weight_sync.planner import HFTensor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(tensor, "serialize_named_tensors", lambda named: named)  # CPU: the tensors themselves
    monkeypatch.setattr(tensor, "bucket_tensors", lambda gathered, fp8_from=None, fp8_ignore=(): gathered)
    posts = []

    def run_on(engines, call, loop=None):
        import asyncio

        class Client:
            def __init__(self, url):
                self.url = url

            async def update_weights_from_tensor(self, payloads, load_format=None):
                posts.append((self.url, payloads[0], load_format))
                return answers[self.url]

        for e in engines:
            asyncio.run(call(Client(e.url)))
        return {}

    monkeypatch.setattr(tensor, "run_on", run_on)
    bucket = types.SimpleNamespace(index=0, tensors=[HFTensor("a", (4,), "float32")])
    flat = torch.arange(4.0).view(torch.uint8)
    ex = types.SimpleNamespace(layout=types.SimpleNamespace(world_size=1, world_rank=0), is_sender=True,
                               engines=[EngineEndpoint(u) for u in answers], order=[bucket], dtype="float32",
                               fp8=False, fp8_ignore=(), gather_bucket=lambda b: [("a", torch.arange(4.0))],
                               steps=lambda: [_Step(bucket, flat)])
    t = tensor.TensorTransport(ex)
    t._io = None
    return t, posts


def test_engines_that_announce_flat_buckets_get_them_from_the_next_sync(monkeypatch):
    from mrl.sglang.wire import FLAT_TENSOR_FORMAT, FLAT_TENSOR_MARK

    t, posts = _transport(monkeypatch, {"http://e0": f"Success {FLAT_TENSOR_MARK}",
                                        "http://e1": f"ok {FLAT_TENSOR_MARK}"})
    t.push("1")  # tensor by tensor: the answers announce the flat format
    assert [p[2] for p in posts] == [None, None] and t.flat_engines == {"http://e0", "http://e1"}
    posts.clear()
    stats = t.push("2")
    assert [u for u, _, _ in posts] == ["http://e0", "http://e1"] and stats.buckets_sent == 1 and stats.bytes_sent == 16
    (name, flat), = posts[0][1]
    assert name == "bucket" and flat.dtype == torch.uint8 and torch.equal(flat.view(torch.float32), torch.arange(4.0))
    assert posts[0][2].startswith(FLAT_TENSOR_FORMAT) and '"names": ["a"]' in posts[0][2]


def test_one_engine_without_the_patch_keeps_every_engine_on_tensors(monkeypatch):
    from mrl.sglang.wire import FLAT_TENSOR_MARK

    t, posts = _transport(monkeypatch, {"http://e0": f"Success {FLAT_TENSOR_MARK}", "http://plain": "Success"})
    t.push("1")
    t.push("2")
    assert all(fmt is None for _, _, fmt in posts) and t.flat_engines == {"http://e0"}
