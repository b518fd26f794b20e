"""``optimizer_states_for_checkpoint``: while a checkpoint is built or loaded, an optimizer shaped like TE's
FusedAdam (bf16 moments, fp32 copies on request) answers ``state_dict`` with references, moves every fp32
copy it makes to the host at once, leaves states answered as themselves in place, and gets values to load
on the state's own device; outside the context, and for other optimizers, nothing changes."""

from types import SimpleNamespace

import pytest
import torch

from mrl._compat.te import optimizer_states_for_checkpoint


class CastingAdam(torch.optim.Adam):
    """TE FusedAdam's shape: moments kept in bf16; ``get_unscaled_state`` returns an fp32 copy of those and
    an fp32 state itself; ``state_dict`` would return fp32 copies of every one."""

    def step(self, closure=None):
        super().step(closure)
        for st in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].to(torch.bfloat16)
            st["master_param"] = torch.zeros(4)  # kept in fp32: answered as itself

    def get_unscaled_state(self, param, name):
        kept = self.state[param][name]
        return kept if kept.dtype == torch.float32 else kept.float()

    def set_scaled_state(self, param, name, value):
        self.received = getattr(self, "received", []) + [(name, value.device, value.dtype)]
        self.state[param][name] = value.to(self.state[param][name].dtype)

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
    with optimizer_states_for_checkpoint(chained):
        sd = inner.state_dict()
        assert sd["state"][0]["exp_avg"] is inner.state[p]["exp_avg"]  # a reference, not a copy
        assert sd["param_groups"][0]["lr"] == 0.1
        assert "state_dict" not in vars(plain) and "get_unscaled_state" not in vars(plain)  # left alone
    with pytest.raises(AssertionError, match="casting state_dict ran"):
        inner.state_dict()
    assert not {"state_dict", "get_unscaled_state", "set_scaled_state"} & set(vars(inner))


def test_fp32_copies_go_to_the_host_and_states_answered_as_themselves_stay():
    """The copies megatron's per-rank format collects for every parameter land on ``host`` (here ``meta``, a
    device the CPU box has besides ``cpu``), one at a time; the fp32 state is handed over as itself."""
    inner, p = _stepped(CastingAdam)
    with optimizer_states_for_checkpoint(SimpleNamespace(optimizer=inner), host="meta"):
        m = inner.get_unscaled_state(p, "exp_avg")
        master = inner.get_unscaled_state(p, "master_param")
    assert m.device.type == "meta" and m.dtype == torch.float32 and m.shape == (4,)
    assert master is inner.state[p]["master_param"]
    assert inner.get_unscaled_state(p, "exp_avg").device.type == "cpu"  # restored: TE's own answer again


def test_values_to_load_reach_the_states_device():
    inner, p = _stepped(CastingAdam)
    inner.state[p]["exp_avg"] = torch.empty(4, dtype=torch.bfloat16, device="meta")  # "the GPU" of this test
    with optimizer_states_for_checkpoint(SimpleNamespace(optimizer=inner)):
        inner.set_scaled_state(p, "exp_avg", torch.full((4,), 0.5))  # read from the checkpoint on the host
        inner.set_scaled_state(p, "exp_avg_sq", torch.full((4,), 0.25))
    assert inner.received == [("exp_avg", torch.device("meta"), torch.float32),
                              ("exp_avg_sq", torch.device("cpu"), torch.float32)]


def test_restored_when_the_save_fails():
    inner, _ = _stepped(CastingAdam)
    with pytest.raises(RuntimeError):
        with optimizer_states_for_checkpoint(SimpleNamespace(optimizer=inner)):
            raise RuntimeError("save failed")
    assert not {"state_dict", "get_unscaled_state", "set_scaled_state"} & set(vars(inner))
