"""Narrow patches to SGLang inside the server processes mrl starts, CPU and GPU engines alike.

Applied through a ``sitecustomize`` on the server's ``PYTHONPATH`` (``SHIM_DIR`` on GPUs; CPU mode's
own shim, ``mrl/rollout/cpu/pyshim``, calls :func:`install` too). Each patch waits for SGLang to import
its module (:class:`PatchOnImport`), so processes that never load that module pay nothing, and each
one checks its target first: an SGLang without it runs unpatched, with a line in the engine log.
Never imported by the trainer.

Compact routes (``MRL_COMPACT_ROUTES=1``, the launcher's default): SGLang keeps each request's routes
(expert ids, ``[rows, layers, top_k]``) as int32, pickles them from the scheduler to the tokenizer
manager and sends them as base64 in the JSON reply, 4 bytes per id. Expert ids fit in one byte up to
256 experts, so the scheduler hands over the smallest integer type that holds every id of the request
exactly (uint8, else int16, else int32 unchanged): fewer bytes through every later copy, base64
included. The conversion happens where a finished request's routes are gathered
(``RoutedExpertsCapturer.get_topk``), before the hand-over, so the tokenizer manager's encoder (and
the detokenizer's, without ``--skip-tokenizer-init``) base64 the small tensor as is.
``mrl.routing.codec`` tells the types apart by the payload's length, and engines without the patch
still send int32, which it reads as before.
"""

from __future__ import annotations

import functools
import os
import sys

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_shim")
COMPACT_ROUTES_ENV = "MRL_COMPACT_ROUTES"
ROUTES_MODULE = "sglang.srt.state_capturer.routed_experts"
COMPACT_ROUTES_MARK = "mrl: routes leave the scheduler in the smallest integer type (mrl.rollout.engine_patches)"
"""Printed to the engine's log when the patch is in place (once per server process that loads the module)."""


class PatchOnImport:
    """Meta-path finder that lets one SGLang module load as usual, then hands it to ``patch``."""

    def __init__(self, target, patch):
        self.target, self.patch = target, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def compact_ids(ids):
    """``ids`` (int32) in the smallest integer type that holds every value exactly: uint8 when all are in
    [0, 256), int16 in [0, 32768), else unchanged. Values are checked, not assumed from the expert
    count, so an id SGLang might one day put out of range (a physical expert id, a -1 pad) reaches mrl's
    decoder unchanged and is refused there instead of wrapping around silently."""
    import torch

    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.numel() == 0:
        return ids
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0:
        return ids
    if hi < 256:
        return ids.to(torch.uint8)
    if hi < 32768:
        return ids.to(torch.int16)
    return ids


def compact_routes(module) -> None:
    cls = getattr(module, "RoutedExpertsCapturer", None)
    get_topk = getattr(cls, "get_topk", None)
    if get_topk is None:
        print(f"mrl: {module.__name__} has no RoutedExpertsCapturer.get_topk: routes stay int32",
              file=sys.stderr, flush=True)
        return
    if getattr(get_topk, "_mrl_compact", False):
        return

    @functools.wraps(get_topk)
    def compact_get_topk(self, *args, **kwargs):
        return compact_ids(get_topk(self, *args, **kwargs))

    compact_get_topk._mrl_compact = True
    cls.get_topk = compact_get_topk
    print(COMPACT_ROUTES_MARK, file=sys.stderr, flush=True)


def install() -> None:
    """Register the patches the environment asks for (called from the engines' ``sitecustomize``)."""
    if os.environ.get(COMPACT_ROUTES_ENV) == "1":
        sys.meta_path.insert(0, PatchOnImport(ROUTES_MODULE, compact_routes))


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the switches :func:`install` reads, on unless ``env`` already sets them (so
    ``MRL_COMPACT_ROUTES=0`` in the launcher's environment sends int32 routes, for comparisons)."""
    env.setdefault(COMPACT_ROUTES_ENV, "1")
    return env
