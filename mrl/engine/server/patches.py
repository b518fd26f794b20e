"""Narrow patches to SGLang inside the server processes mrl starts, CPU and GPU engines alike.

Applied through a ``sitecustomize`` on the server's ``PYTHONPATH`` (``SHIM_DIR`` on GPUs; CPU mode's
own shim, ``mrl/engine/server/cpu/pyshim``, calls :func:`install` too). Each patch waits for SGLang to import
its module (:class:`PatchOnImport`), so processes that never load that module pay nothing, and each
one checks its target first: an SGLang without it runs unpatched, with a line in the engine log.
The trainer and the rollout process import only its wire constants (``BATCHED_BUCKETS_FORMAT`` and the
marks); nothing is patched outside an engine.

Compact routes: SGLang keeps each request's routes
(expert ids, ``[rows, layers, top_k]``) as int32, pickles them from the scheduler to the tokenizer
manager and sends them as base64 in the JSON reply, 4 bytes per id. Expert ids fit in one byte up to
256 experts, so the scheduler hands over the smallest integer type that holds every id of the request
exactly (uint8, else int16, else int32 unchanged): fewer bytes through every later copy, base64
included. The conversion happens where a finished request's routes are gathered
(``RoutedExpertsCapturer.get_topk``), before the hand-over, so the tokenizer manager's encoder (and
the detokenizer's, without ``--skip-tokenizer-init``) base64 the small tensor as is.
``mrl.routing.codec`` tells the types apart by the payload's length, and engines without the patch
still send int32, which it reads as before.

Replayed loads: a ``flattened_bucket`` weight update
is received into one flat buffer (SGLang allocates every tensor, then concatenates them into a second
buffer of the same size) and, from the second bucket of a layout on, loaded by the copies its first
load made (``mrl.engine.server.replayed_load``) instead of the model's per-tensor ``load_weights``. A load
that is not pure copies (derived weights, conversions) keeps ``load_weights``; the engine log says which
happened, once per layout. The same patch lets one request carry every bucket of a sync
(``BATCHED_BUCKETS_FORMAT``; announced in the answer to ``/init_weights_update_group``), so the engine
posts its receives back to back instead of answering and waiting for the next request between buckets.
CUDA IPC updates (``update_weights_from_tensor``) get the same loads for a bucket sent as one flat buffer
(``FLAT_TENSOR_FORMAT``, announced in the answers to the per-tensor updates).

In-flight updates (``mrl.engine.server.inflight``): every output token carries the version of the weights that
produced it, and a retract or in-place pause leaves no KV cache of older weights to later requests.
Staged updates (``mrl.engine.server.staged``): weights received into a copy of the parameters while the engine
generates, swapped in between two forward passes.
Classifier score bias: SGLang's ``Qwen2ForSequenceClassification`` and ``Qwen3ForSequenceClassification`` give
their score head a bias (``nn.Linear``'s default) that Hugging Face's classes do not have, so a reward model
checkpoint has no ``score.bias`` and the bias kept its random init: every score off by one random constant.
The patch zeroes a score bias the checkpoint did not carry, which makes the engine's score the checkpoint's.

Whoever wants to time an update's phases (a benchmark) sets ``watch`` to an ``UpdateWatch`` of its own.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys

from mrl.engine.server import inflight, staged
from mrl.engine.server.hook import target
from mrl.sglang.wire import (BATCHED_BUCKETS_FORMAT, BATCHED_BUCKETS_MARK, COMPACT_ROUTES_MARK, FLAT_TENSOR_FORMAT,
                             FLAT_TENSOR_MARK, KEEPS_LAYOUTS_MARK, LAYOUT_KEPT_MARK, REPLAYED_LOAD_MARK)

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
ROUTES_MODULE = "sglang.srt.state_capturer.routed_experts"
RUNNER_MODULE = "sglang.srt.model_executor.model_runner"


class UpdateWatch:
    """The phase boundaries of a weight update in the model runner, for whoever times them (``watch``); this one
    does nothing. ``update(runner)`` is a context around each update; per bucket ``bucket(key, dtypes, shapes)``
    opens it and ``mark(phase, stream, **info)`` ends each phase (``wait_free`` in a batched request, ``receive``,
    ``load`` with the load's path and copy counts in ``info``; ``stream``: the CUDA stream the phase ran on, None
    for the current one)."""

    def update(self, runner):
        return contextlib.nullcontext()

    def bucket(self, key: str, dtypes, shapes) -> None:
        pass

    def mark(self, phase: str, stream=None, **info) -> None:
        pass


watch = UpdateWatch()

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
    found = target(module, "RoutedExpertsCapturer", "get_topk", "_mrl_compact", "routes stay int32")
    if found is None:
        return
    cls, get_topk = found

    @functools.wraps(get_topk)
    def compact_get_topk(self, *args, **kwargs):
        return compact_ids(get_topk(self, *args, **kwargs))

    compact_get_topk._mrl_compact = True
    cls.get_topk = compact_get_topk
    print(COMPACT_ROUTES_MARK, file=sys.stderr, flush=True)


def replayed_load(module) -> None:
    runner = getattr(module, "ModelRunner", None)
    _replayed_tensor_load(module, runner)
    update = getattr(runner, "update_weights_from_distributed", None)
    init = getattr(runner, "init_weights_update_group", None)
    if update is None or init is None or not hasattr(runner, "_update_bucketed_weights_from_distributed"):
        print(f"mrl: {module.__name__} has no bucketed distributed update: weights load through load_weights",
              file=sys.stderr, flush=True)
        return
    if getattr(update, "_mrl_replayed", False):
        return

    @functools.wraps(update)
    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        if load_format is not None and load_format.startswith(BATCHED_BUCKETS_FORMAT):
            try:
                names, dtypes, shapes, layout, kept = _batch_layout(self, names, dtypes, shapes,
                                                                    load_format[len(BATCHED_BUCKETS_FORMAT):])
            except (ValueError, TypeError, KeyError) as e:
                return False, f"Failed to update parameter online: bad batched bucket layout: {e}"
            with watch.update(self):
                ok, message = _receive_batch(self, names, dtypes, shapes, layout)
            return ok, f"{message} {LAYOUT_KEPT_MARK}{kept}]" if ok and kept else message
        if load_format != "flattened_bucket" or group_name not in getattr(self, "_model_update_group", {}):
            return update(self, names, dtypes, shapes, group_name, load_format)
        try:
            with watch.update(self):
                watch.bucket(group_name, dtypes, shapes)
                flat = _receive(self, dtypes, shapes, group_name)
                watch.mark("receive")
                info: dict = {}
                message = _load(self, flat, names, dtypes, shapes, group_name, info)
                watch.mark("load", **info)
                return True, message
        except Exception as e:
            return False, _partial(e)

    @functools.wraps(init)
    def init_weights_update_group(self, *args, **kwargs):  # tells the trainer it may batch the buckets
        ok, message = init(self, *args, **kwargs)
        return ok, f"{message} {BATCHED_BUCKETS_MARK} {KEEPS_LAYOUTS_MARK}" if ok else message

    update_weights_from_distributed._mrl_replayed = True
    runner.update_weights_from_distributed = update_weights_from_distributed
    runner.init_weights_update_group = init_weights_update_group


def _replayed_tensor_load(module, runner) -> None:
    """``update_weights_from_tensor`` takes ``FLAT_TENSOR_FORMAT`` buckets and says so in its answers."""
    update = getattr(runner, "update_weights_from_tensor", None)
    unwrap = getattr(module, "_unwrap_tensor", None)  # SGLang's own: a rank's tensor of an IPC payload
    if update is None or unwrap is None:
        print(f"mrl: {module.__name__} has no tensor update to patch: CUDA IPC buckets load tensor by tensor",
              file=sys.stderr, flush=True)
        return
    if getattr(update, "_mrl_replayed", False):
        return

    @functools.wraps(update)
    def update_weights_from_tensor(self, named_tensors, load_format=None):
        if load_format is None or not load_format.startswith(FLAT_TENSOR_FORMAT):
            ok, message = update(self, named_tensors, load_format)
            return ok, f"{message} {FLAT_TENSOR_MARK}" if ok else message
        try:
            with watch.update(self):
                return True, _load_flat(self, named_tensors, load_format[len(FLAT_TENSOR_FORMAT):], unwrap)
        except Exception as e:
            return False, _partial(e)

    update_weights_from_tensor._mrl_replayed = True
    runner.update_weights_from_tensor = update_weights_from_tensor


def _load_flat(runner, named_tensors, meta_json: str, unwrap) -> str:
    """One ``FLAT_TENSOR_FORMAT`` bucket: the flat buffer checked against its layout, loaded by ``_load``,
    the copies finished before the answer (the sender reuses the buffer for a later bucket)."""
    import torch

    from mrl.engine.server import replayed_load as rl

    meta = json.loads(meta_json)
    key, names, dtypes = str(meta["key"]), list(meta["names"]), list(meta["dtypes"])
    shapes = [list(x) for x in meta["shapes"]]
    if len(named_tensors) != 1 or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"a flat bucket is one tensor with as many names, dtypes and shapes: got "
                         f"{len(named_tensors)} tensors, {len(names)} names, {len(dtypes)} dtypes, "
                         f"{len(shapes)} shapes")
    device = torch.get_device_module(runner.device).current_device()
    flat = unwrap(named_tensors[0][1], tp_rank=getattr(runner, "tp_rank", 0), device=device)
    want = rl.bucket_nbytes(dtypes, shapes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != want:
        raise ValueError(f"flat bucket {key}: a uint8 buffer of {want} bytes expected, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    watch.bucket(key, dtypes, shapes)
    watch.mark("receive")
    info: dict = {}
    message = _load(runner, flat, names, dtypes, shapes, key, info)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    watch.mark("load", **info)
    return message


_BUCKETS_IN_FLIGHT = 3
"""Buckets of a batched request queued on the GPU at most (received and loaded, or on their way): the
next receive waits for the oldest, so a model of many buckets never holds more than this many buffers."""


def _partial(e: Exception) -> str:
    # SGLang's own wording: the trainer reads "partially updated" as a broken engine
    return (f"Failed to update parameter online: {e}. The full weights of the ModelRunner are partially "
            "updated. Please discard the whole weights.")


_KEPT_LAYOUTS = 4
"""Layouts an engine keeps by key (a rebuilt set of groups is a new layout; older ones are forgotten)."""


def _batch_layout(runner, names, dtypes, shapes, spec: str):
    """A batched request's tensors and bucket layout, and the key it was kept under (None: not kept). ``spec``:
    the JSON after ``BATCHED_BUCKETS_FORMAT``, a layout list, ``{"key", "layout"}`` (keep the request's
    names, dtypes and shapes with it) or ``{"key"}`` (a kept one; the request's lists are empty)."""
    kept_layouts = runner.__dict__.setdefault("_mrl_layouts", collections.OrderedDict())
    got, key = json.loads(spec), None
    if isinstance(got, dict):
        key = str(got["key"])
        if "layout" not in got:
            if key not in kept_layouts:
                raise KeyError(f"no kept layout {key!r} (kept: {list(kept_layouts)})")
            return (*kept_layouts[key], None)
        got = got["layout"]
    layout = [(str(g), int(n)) for g, n in got]
    if key is not None:
        kept_layouts[key] = (list(names), list(dtypes), [list(x) for x in shapes], layout)
        while len(kept_layouts) > _KEPT_LAYOUTS:
            kept_layouts.popitem(last=False)
    return names, dtypes, shapes, layout, key


def _receive_batch(runner, names, dtypes, shapes, layout: list[tuple[str, int]]):
    """Every bucket of a sync from one request (``BATCHED_BUCKETS_FORMAT``): no request, answer and
    scheduler round trip between buckets, so on GPUs the broadcasts and the loads' copies queue back to back.
    A bucket whose load fails does not stop the receiving (the senders' broadcasts must stay matched); its
    error fails the request. A failed broadcast does (the sender tore its group down)."""
    groups = getattr(runner, "_model_update_group", {})
    unknown = sorted({g for g, _ in layout} - set(groups))
    if unknown or sum(n for _, n in layout) != len(names) or not len(names) == len(dtypes) == len(shapes):
        return False, (f"Failed to update parameter online: batched buckets name groups {unknown} that do not "
                       f"exist or count {sum(n for _, n in layout)} tensors for {len(names)} names, "
                       f"{len(dtypes)} dtypes, {len(shapes)} shapes")
    import torch

    first, at = None, 0
    done = collections.deque()  # GPU: an event after each queued bucket's load
    loads = load_stream(runner)
    try:
        for i, (group, n) in enumerate(layout):
            part = slice(at, at + n)
            at += n
            watch.bucket(group, dtypes[part], shapes[part])
            if len(done) >= _BUCKETS_IN_FLIGHT:  # the host runs ahead of the GPU: bound the receive buffers
                done.popleft().synchronize()
            watch.mark("wait_free")
            try:
                flat = _receive(runner, dtypes[part], shapes[part], group)
            except Exception as e:
                return False, _partial(RuntimeError(f"bucket {i} over {group}: {e}"))
            watch.mark("receive")
            if loads is not None:  # the copies wait for this receive only, and the next receive not for them
                loads.wait_stream(torch.cuda.current_stream(flat.device))
                flat.record_stream(loads)
            info: dict = {}
            try:
                with torch.cuda.stream(loads) if loads is not None else contextlib.nullcontext():
                    _load(runner, flat, names[part], dtypes[part], shapes[part], group, info)
            except Exception as e:
                first = first or RuntimeError(f"bucket {i} over {group}: {e}")
            watch.mark("load", loads, **info)
            if loads is not None:
                done.append(loads.record_event())
    finally:
        if loads is not None:  # what runs after the update (SGLang's forwards) is ordered after every copy
            torch.cuda.current_stream(loads.device).wait_stream(loads)
    if first is not None:
        return False, _partial(first)
    return True, f"Succeeded to update parameter online ({len(layout)} buckets in one request)."


def load_stream(runner):
    """The CUDA stream a batched update's copies run on (None off CUDA).
    A process group's NCCL stream waits for the whole current stream before each collective, so copies
    queued there would hold every receive after them until they finish: receive and load of a bucket would
    take turns instead of the next bucket arriving while this one is copied."""
    import torch

    if not str(getattr(runner, "device", "cpu")).startswith("cuda"):
        return None
    stream = runner.__dict__.get("_mrl_load_stream")
    if stream is None:
        stream = runner.__dict__["_mrl_load_stream"] = torch.cuda.Stream(torch.cuda.current_device())
    return stream


def _receive(runner, dtypes, shapes, group_name):
    import torch
    import torch.distributed as dist

    from mrl.engine.server import replayed_load as rl

    flat = torch.empty(rl.bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=runner.device)
    dist.broadcast(flat, src=0, group=runner._model_update_group[group_name])
    return flat


def _load(runner, flat, names, dtypes, shapes, group_name, info: dict | None = None) -> str:
    """Load a received bucket; ``info`` gets the path taken and, for a replay, the plan's counts (``watch``)."""
    from mrl.engine.server import replayed_load as rl

    info = {} if info is None else info
    plans = runner.__dict__.setdefault("_mrl_load_plans", {})
    key = (group_name, tuple(names), tuple(map(str, dtypes)), tuple(tuple(s) for s in shapes))
    plan = plans.get(key)
    if plan is not None and plan.valid():
        plan.replay(flat)
        info |= {"path": "replayed", **plan.counts()}
        return "Succeeded to update parameter online (replayed)."
    views = rl.bucket_views(flat, names, dtypes, shapes)
    if key in plans and plan is None:  # recorded before and refused: the model's own load, unrecorded
        runner.model.load_weights(views)
        info["path"] = "load_weights"
        return "Succeeded to update parameter online."
    plan, why = rl.record_load(lambda: runner.model.load_weights(views), flat, runner.model)
    plans[key] = plan
    info["path"] = "recorded" if plan else "refused"
    print(f"{REPLAYED_LOAD_MARK if plan else 'mrl: bucket layout loads through load_weights'}: {why}",
          file=sys.stderr, flush=True)
    return "Succeeded to update parameter online."


def _runner(module) -> None:
    replayed_load(module)
    inflight.tag_forwards(module)


def _scheduler(module) -> None:
    inflight.pause_and_continue(module)
    staged.stage_loads(module)


def _tokenizer_manager(module) -> None:
    inflight.send_version(module)
    staged.unlocked_updates(module)


CLASSIFIER_MODULES = ("sglang.srt.models.qwen2_classification", "sglang.srt.models.qwen3_classification")
CLASSIFIER_CLASSES = ("Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


def zero_missing_score_bias(module) -> None:
    for name in CLASSIFIER_CLASSES:
        cls = getattr(module, name, None)
        load = getattr(cls, "load_weights", None)
        if load is None or getattr(load, "_mrl_score_bias", False):
            continue

        @functools.wraps(load)
        def load_weights(self, weights, _load=load):
            names: set[str] = set()

            def seen():
                for n, w in weights:
                    names.add(n)
                    yield n, w

            import torch

            out = _load(self, seen())
            bias = getattr(getattr(self, "score", None), "bias", None)
            if bias is not None and not any(n.endswith("score.bias") for n in names):
                with torch.no_grad():
                    bias.zero_()
            return out

        load_weights._mrl_score_bias = True
        cls.load_weights = load_weights


def install() -> None:
    """Register the patches (called from the engines' ``sitecustomize``)."""
    for name in CLASSIFIER_MODULES:
        sys.meta_path.insert(0, PatchOnImport(name, zero_missing_score_bias))
    sys.meta_path.insert(0, PatchOnImport(ROUTES_MODULE, compact_routes))
    sys.meta_path.insert(0, PatchOnImport(RUNNER_MODULE, _runner))
    sys.meta_path.insert(0, PatchOnImport(inflight.SCHEDULER_MODULE, _scheduler))
    sys.meta_path.insert(0, PatchOnImport(inflight.TOKENIZER_MODULE, _tokenizer_manager))
    sys.meta_path.insert(0, PatchOnImport(inflight.BATCH_MODULE, inflight.start_untagged))
