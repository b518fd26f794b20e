"""The two rollout front ends share one interface (``RolloutSide``): the rollout process's ``LocalRollout``
implements it, and the trainer's ``RolloutService`` proxy serves every method of it through the child's
dispatch (``_serve``), over a real connection, with arguments, results and errors carried across."""

from __future__ import annotations

import inspect
import threading
from multiprocessing import Pipe

import pytest

from mrl.rollout.service import LocalRollout, RolloutService, RolloutServiceError, _serve
from mrl.rollout.side import RolloutSide

INTERFACE = sorted(RolloutSide.__abstractmethods__)


def test_both_front_ends_implement_the_interface():
    assert len(INTERFACE) == 13
    for cls in (RolloutService, LocalRollout):
        assert issubclass(cls, RolloutSide) and not cls.__abstractmethods__, cls
        for name in INTERFACE:  # same arguments, so a call through the proxy fits the child's method
            assert _params(getattr(cls, name)) == _params(getattr(RolloutSide, name)), (cls, name)


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


class _Recorder(RolloutSide):
    """A rollout side that answers each call with its name and arguments, or raises what ``fail`` names."""

    def __init__(self, *init_args):
        self.init_args, self.calls = init_args, []


def _answer(name):
    def method(self, *args):
        self.calls.append((name, args))
        if args and args[0] == "fail":
            raise TimeoutError(f"{name} timed out")
        return {"method": name, "args": args, "init": self.init_args}
    return method


for _name in INTERFACE:
    setattr(_Recorder, _name, _answer(_name))
_Recorder.__abstractmethods__ = frozenset()


class _Alive:
    returncode = None

    def poll(self):
        return None


@pytest.fixture
def proxy():
    parent, child = Pipe()
    box = []
    server = threading.Thread(target=_serve, args=(child, lambda *a: box.append(_Recorder(*a)) or box[-1]),
                              daemon=True)
    server.start()
    svc = RolloutService(_Alive(), parent, call_timeout_s=5)
    svc._call("init", ("cfg", "hf"), 5)
    yield svc, box
    parent.close()
    server.join(5)


ARGS = {"start_producing": (4,), "allow": (2,), "take": (8, 3, 1.5), "drain": (2.0,), "undrain": (),
        "submit_eval": (10, 3), "eval_results": (0.5,),
        "stats": (), "state": (), "count": ("groups_bad_routes", 1), "add_engine": ("http://e",),
        "set_adapter": ("a1", 3), "stop": ()}


def test_every_interface_method_is_served_by_the_child(proxy):
    svc, box = proxy
    assert sorted(ARGS) == INTERFACE
    for name in INTERFACE:
        if name == "stop":
            continue  # the proxy's own: asks the child to stop, then waits for its process
        got = getattr(svc, name)(*ARGS[name])
        assert got == {"method": name, "args": ARGS[name], "init": ("cfg", "hf")}, name
    assert svc.count("groups_no_signal")["args"] == ("groups_no_signal", 1)  # the default travels too
    assert svc._call("stop", (), 5)["method"] == "stop"
    assert [c[0] for c in box[0].calls] == [n for n in INTERFACE if n != "stop"] + ["count", "stop"]


def test_errors_come_back_as_raised_and_unknown_calls_are_refused(proxy):
    svc, _ = proxy
    with pytest.raises(TimeoutError, match="take timed out"):
        svc.take("fail", 0, 1.0)
    with pytest.raises(RolloutServiceError, match="serves no call 'shutdown_engines'"):
        svc._call("shutdown_engines", (), 5)
    assert svc.stats()["method"] == "stats"  # the child goes on serving
