"""``optimizer_states_by_reference``: while a checkpoint's sharded state dict is built, an optimizer with TE
FusedAdam's casting ``state_dict`` answers with torch's own (references, no copies), and only then."""

from types import SimpleNamespace

import pytest
import torch

from mrl._compat.te import optimizer_states_by_reference


class CastingAdam(torch.optim.Adam):
    """TE FusedAdam's shape: states kept in bf16, ``state_dict`` returns fp32 copies of every one."""

    def get_unscaled_state(self, param, name):
        return self.state[param][name].float()

    def state_dict(self):
        raise AssertionError("the casting state_dict ran: it copies every state to fp32")


def _stepped(opt_cls):
    p = torch.nn.Parameter(torch.ones(4))
    opt = opt_cls([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    return opt, p


def test_casting_state_dict_is_bypassed_inside_and_restored_after():
    inner, p = _stepped(CastingAdam)
    plain, _ = _stepped(torch.optim.Adam)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner), SimpleNamespace(optimizer=plain)])
    with optimizer_states_by_reference(chained):
        sd = inner.state_dict()
        assert sd["state"][0]["exp_avg"] is inner.state[p]["exp_avg"]  # a reference, not a copy
        assert sd["param_groups"][0]["lr"] == 0.1
        assert "state_dict" not in vars(plain)  # optimizers without TE's accessors are left alone
    with pytest.raises(AssertionError, match="casting state_dict ran"):
        inner.state_dict()


def test_restored_when_the_save_fails():
    inner, _ = _stepped(CastingAdam)
    with pytest.raises(RuntimeError):
        with optimizer_states_by_reference(SimpleNamespace(optimizer=inner)):
            raise RuntimeError("save failed")
    assert "state_dict" not in vars(inner)
