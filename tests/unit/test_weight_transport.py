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
