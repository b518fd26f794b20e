"""The staged copy of an engine's model (``mrl.engine.server.staged``): a load into it never touches the live
parameters, tied parameters stay tied, SGLang-style parameter classes keep their loaders, and the swap refuses a
staged model whose parameters no longer match. The engine side, with real SGLang engines:
``tests/integration/test_inflight_sync.py::test_staged_update_swaps_in_between_two_forward_passes``."""

from __future__ import annotations

import pytest
import torch

from mrl.engine.server.staged import STAGED_ATTR, pairs, shadow_model, unmark
from mrl.sglang.wire import STAGED_FORMAT


class LoaderParam(torch.nn.Parameter):
    """Like SGLang's parameter classes: a subclass that carries its loader as an attribute."""


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied
        w = LoaderParam(torch.zeros(4), requires_grad=False)
        w.weight_loader = lambda p, x: p.data.copy_(x)
        self.norm = torch.nn.Module()
        self.norm.register_parameter("weight", w)
        self.register_buffer("scale", torch.ones(1))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, x in weights:
            p = params[name]
            getattr(p, "weight_loader", lambda p, x: p.data.copy_(x))(p, x)

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)) + self.norm.weight)


def test_a_load_into_the_shadow_leaves_the_live_model_as_it_was():
    torch.manual_seed(0)
    live = Tiny()
    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    ids = torch.tensor([1, 2, 3])
    out = live(ids).detach()
    shadow = shadow_model(live)
    assert shadow.scale is live.scale  # buffers shared, parameters not
    assert shadow.head.weight is shadow.embed.weight and shadow.embed.weight is not live.embed.weight
    assert type(shadow.norm.weight) is LoaderParam and hasattr(shadow.norm.weight, "weight_loader")
    shadow.load_weights([("embed.weight", torch.full((8, 4), 0.5)), ("norm.weight", torch.full((4,), 2.0))])
    for n, p in live.named_parameters():
        assert torch.equal(p, before[n]), n
    assert torch.equal(live(ids), out)
    assert torch.equal(shadow.head.weight, torch.full((8, 4), 0.5))
    dst, src = pairs(live, shadow)
    with torch.no_grad():  # the swap
        torch._foreach_copy_(dst, src)
    assert torch.equal(live.head.weight, torch.full((8, 4), 0.5))
    assert torch.equal(live.norm.weight, torch.full((4,), 2.0))
    assert torch.equal(live(ids), shadow(ids)) and not torch.equal(live(ids), out)


def test_the_swap_refuses_parameters_that_changed_shape():
    live = Tiny()
    shadow = shadow_model(live)
    shadow.proj.weight = torch.nn.Parameter(torch.zeros(2, 4))  # a post-load step that repacked a weight
    with pytest.raises(RuntimeError, match=r"proj\.weight"):
        pairs(live, shadow)


def test_the_mark_is_stripped_off_the_load_format():
    class Req:
        load_format = STAGED_FORMAT + "mrl_flat:{}"

    r = Req()
    assert unmark(r) and r.load_format == "mrl_flat:{}" and getattr(r, STAGED_ATTR)
    r.load_format = STAGED_FORMAT
    assert unmark(r) and r.load_format is None
    r = Req()
    r.load_format = "auto"
    assert not unmark(r) and r.load_format == "auto" and not hasattr(r, STAGED_ATTR)
