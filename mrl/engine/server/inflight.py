"""In-flight weight updates inside mrl's engines: every output token tagged with the version of the weights that
produced it, and no KV cache of older weights handed to later requests.

SGLang's ``/pause_generation`` with ``mode=in_place`` stops the scheduler between two forward passes and leaves
every request as it is, KV cache included; ``mode=retract`` moves the running requests back to the waiting queue
and frees their KV cache, so they are prefilled again when generation continues. The weights change while the
engine is paused, and a reply carries one ``weight_version``: the engine's when it answers. What mrl adds
(installed by ``mrl.engine.server.patches.install``):

- Version per token: each forward pass tags every request of its batch with the version of the weights it runs
  with, through SGLang's own per-token channel (``LogitsProcessorOutput.customized_info`` -> ``Req.customized_info``
  -> the reply's ``meta_info``), under ``TOKEN_VERSIONS_KEY``. The scheduler learns a new version at
  ``/continue_generation``, which the tokenizer manager (where a sync stamps the version) sends along; every
  weight change of a sync happens while the engine is paused, so the version in force at a forward pass is that
  of its weights. Every request starts with an empty list under the key: the per-request lists of one output
  batch stay aligned with its requests when some of them never ran a forward pass.
- Caches: at ``/continue_generation`` after a retract or in-place pause, every radix-cache node that no request
  holds is evicted. After a retract no request holds any, so every request is prefilled again from scratch with
  the new weights; after an in-place pause only the prefixes of the requests still running survive.
- Staged updates (``mrl.engine.server.staged``): the engine is not paused; ``/continue_generation`` swaps the
  staged weights in and moves the tag to the new version at the same step boundary.
- On CUDA, an in-place pause first waits for the forward pass already launched (the overlap scheduler runs one
  ahead), so the weight update that follows never copies into weights a running forward pass reads.
"""

from __future__ import annotations

import functools
import sys

from mrl.engine.server.hook import target
from mrl.sglang.wire import TOKEN_VERSIONS_KEY, TOKEN_VERSIONS_MARK

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
TOKENIZER_MODULE = "sglang.srt.managers.tokenizer_manager"
BATCH_MODULE = "sglang.srt.managers.schedule_batch"
VERSION_ATTR = "_mrl_weight_version"
"""Attribute of the ``ContinueGenerationReqInput`` the tokenizer manager sends the scheduler: its weight version."""
KEEPS_KV = ("retract", "in_place")
"""Pause modes that keep requests in the engine across the weight update (``abort`` returns them)."""

_tag: list = [None]
"""The version tag of this scheduler process's weights; None: the one the server started with."""


def version_tag(version) -> int | str:
    """A weight version as it goes into a reply: an int where it is one (mrl numbers its versions)."""
    s = str(version)
    return int(s) if s.isdigit() else s


UNTAGGED = "tokens carry no per-token weight version"
"""What an engine whose SGLang lacks a patched method does: said in its log."""


def _unpatched(module, what: str) -> None:
    print(f"mrl: {module.__name__} has no {what}: {UNTAGGED}", file=sys.stderr, flush=True)


def tag_forwards(module) -> None:
    """``ModelRunner.forward`` tags each request of its batch with the version of the weights it ran with."""
    found = target(module, "ModelRunner", "forward", "_mrl_tagged", UNTAGGED)
    if found is None:
        return
    runner, forward = found

    @functools.wraps(forward)
    def tagged_forward(self, forward_batch, *args, **kwargs):
        out = forward(self, forward_batch, *args, **kwargs)
        logits = getattr(out, "logits_output", None)
        if logits is not None and hasattr(logits, "customized_info"):  # not a pipeline stage's hidden states
            tag = _tag[0] if _tag[0] is not None else version_tag(self.server_args.weight_version)
            # a new dict: a graph runner may hand out the same one every replay
            logits.customized_info = {**(logits.customized_info or {}),
                                      TOKEN_VERSIONS_KEY: [tag] * forward_batch.batch_size}
        return out

    tagged_forward._mrl_tagged = True
    runner.forward = tagged_forward
    print(TOKEN_VERSIONS_MARK, file=sys.stderr, flush=True)


def start_untagged(module) -> None:
    """Every ``Req`` starts with an empty version list: each request of an output batch has one."""
    req = getattr(module, "Req", None)
    if req is None:
        return _unpatched(module, "Req")
    init = req.__init__
    if getattr(init, "_mrl_tagged", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "customized_info", None) is None:
            self.customized_info = {TOKEN_VERSIONS_KEY: []}

    __init__._mrl_tagged = True
    req.__init__ = __init__


def send_version(module) -> None:
    """The tokenizer manager's ``continue_generation`` hands the scheduler the weight version now in force."""
    found = target(module, "TokenizerManager", "continue_generation", "_mrl_tagged", UNTAGGED)
    if found is None:
        return
    tm, cont = found

    @functools.wraps(cont)
    async def continue_generation(self, obj, *args, **kwargs):
        setattr(obj, VERSION_ATTR, self.server_args.weight_version)
        return await cont(self, obj, *args, **kwargs)

    continue_generation._mrl_tagged = True
    tm.continue_generation = continue_generation


def evict_unheld(tree_cache) -> int:
    """Evict every node of ``tree_cache`` that no request holds; tokens evicted (0 for a chunk cache)."""
    if tree_cache is None or tree_cache.is_chunk_cache() or not hasattr(tree_cache, "evictable_size"):
        return 0
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    n = tree_cache.evictable_size()
    if n <= 0:
        return 0
    res = tree_cache.evict(EvictParams(num_tokens=n))
    return int(getattr(res, "num_tokens_evicted", n) or 0)


def pause_and_continue(module) -> None:
    """The scheduler: a new version at ``continue_generation``, the caches a kept request's pause leaves behind
    evicted, and (CUDA) an in-place pause after the forward pass already launched."""
    sched = getattr(module, "Scheduler", None)
    pause, cont = getattr(sched, "pause_generation", None), getattr(sched, "continue_generation", None)
    if pause is None or cont is None:
        return _unpatched(module, "Scheduler.pause_generation / continue_generation")
    if getattr(pause, "_mrl_tagged", False):
        return

    @functools.wraps(pause)
    def pause_generation(self, recv_req):
        mode = getattr(recv_req, "mode", "abort")
        if mode == "in_place":
            _wait_for_launched()
        out = pause(self, recv_req)
        self._mrl_pause_mode = mode
        return out

    @functools.wraps(cont)
    def continue_generation(self, recv_req):
        st = self.__dict__.get("_mrl_staging")
        pending = st is not None and st.busy
        swapped = pending and st.commit()  # a staged update's weights, between two forward passes
        version = getattr(recv_req, VERSION_ATTR, None)
        if version is not None and (swapped or not pending):  # a failed staged load left the weights as they were
            _tag[0] = version_tag(version)
        if swapped or getattr(self, "_mrl_pause_mode", None) in KEEPS_KV:
            evict_unheld(getattr(self, "tree_cache", None))
        self._mrl_pause_mode = None
        return cont(self, recv_req)

    pause_generation._mrl_tagged = continue_generation._mrl_tagged = True
    sched.pause_generation, sched.continue_generation = pause_generation, continue_generation


def _wait_for_launched() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
