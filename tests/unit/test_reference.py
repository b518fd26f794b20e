"""Reference weights swapped into the training model for the KL forward (mrl/megatron/reference.py)."""

import pytest
import torch

from mrl.megatron.reference import ReferenceWeights


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("bias_buf", torch.zeros(3))  # like megatron's expert bias: read by forward

    def forward(self, x):
        return self.lin(x) + self.bias_buf


def test_swap_gives_reference_outputs_and_restores_the_policy_in_place(tmp_path):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 4)
    ref = ReferenceWeights()
    ref.capture(net)
    y_ref = net(x).detach()
    storage = net.lin.weight.data_ptr()
    with torch.no_grad():  # "training" moves the policy away from the reference
        net.lin.weight.add_(1.0)
        net.bias_buf.add_(0.5)
    y_pol = net(x).detach()
    with ref.swapped_in(net):
        assert torch.equal(net(x), y_ref)
    assert torch.equal(net(x), y_pol)
    assert net.lin.weight.data_ptr() == storage  # same storage: DDP buffers stay valid
    ref.save(str(tmp_path), rank=0)
    again = ReferenceWeights()
    assert again.load(str(tmp_path), rank=0) and not ReferenceWeights().load(str(tmp_path), rank=1)
    with again.swapped_in(net):
        assert torch.equal(net(x), y_ref)


def test_refuses_uncaptured_or_mismatched_weights():
    with pytest.raises(RuntimeError, match="never captured"):
        with ReferenceWeights().swapped_in(Net()):
            pass
    ref = ReferenceWeights()
    ref.capture(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="do not match"):
        with ref.swapped_in(Net()):
            pass
