"""Staged weight updates: the engine receives new weights while it keeps generating, and swaps them in between
two forward passes (``weight_sync.pause_mode=staged``).

SGLang loads a weight update inside its scheduler loop, which generates nothing meanwhile, and its tokenizer
manager holds a writer lock around an update of an engine that is not paused, which waits for every request in
flight to finish. A staged update avoids both:

- The request names the mark ``STAGED_FORMAT`` before its ``load_format`` (disk, tensor and distributed updates).
  The tokenizer manager strips it, marks the request (``STAGED_ATTR``) and sends it to the scheduler without the
  lock, as SGLang does for a paused engine; requests keep arriving and running.
- The scheduler takes the marked request out of its input (``process_input_requests``) and loads it in a thread
  of its own process into a *shadow* of the model: a module tree that shares every submodule's code, config and
  buffers with the live model but holds its own copy of every parameter (``shadow_model``). SGLang's own update
  method runs on a shallow copy of the model runner whose ``model`` is the shadow, so the disk reader, the IPC
  unwrap, the broadcast receive and mrl's replayed loads (their plans kept apart from the live model's) all work
  as usual, writing the shadow's parameters only. The first staged load after a commit copies the live
  parameters into the shadow first, so a push of part of the weights leaves the rest as they are. The answer
  goes to the tokenizer manager from the scheduler loop once the load is done (on every TP rank: one all-reduce
  per loop iteration while a load is running).
- ``/continue_generation`` (after the version stamp) commits: at the top of a scheduler iteration, between two
  forward passes, every parameter is copied from the shadow into the live one in place (the pointers CUDA graphs
  captured stay valid; on GPUs the copy is queued behind the forward pass already launched and before the next
  one, with no host sync), the per-token version tag moves to the new version and cache nodes no request holds
  are evicted, as after an in-place pause. The generation pause is that copy: the model's bytes at the device's
  copy bandwidth.

What it costs: a second copy of the engine's parameters (per TP rank, its shard), allocated at the first staged
update and kept. A load that writes buffers or plain tensor attributes rather than parameters, or replaces
parameters with tensors of another shape (post-load weight processing of quantized models), would reach the live
model or miss the swap, so the swap checks names, shapes and dtypes and refuses a mismatch, and mrl refuses staged
updates of FP8 engines up front. The scheduler runs staged loads one at a time, in the order they came: a sync of
several requests (a bucket each) is several loads into the shadow, swapped in together; one that failed (on any
TP rank) keeps the whole sync out, unless a disk load (a whole checkpoint) follows it before the commit.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import sys
import threading
import time
import traceback

from mrl.engine.server.hook import target
from mrl.sglang.wire import STAGED_FORMAT, STAGED_MARK

STAGED_ATTR = "_mrl_staged"
"""Attribute of an update request the tokenizer manager passes on: load it into the shadow, off the loop."""
_PENDING, _FAILED, _DONE = 0, 1, 2  # a load's state; the minimum over the TP ranks is theirs together


def unmark(obj) -> bool:
    """Strip ``STAGED_FORMAT`` from ``obj.load_format`` and mark ``obj``; whether it was a staged request."""
    fmt = getattr(obj, "load_format", None)
    if not isinstance(fmt, str) or not fmt.startswith(STAGED_FORMAT):
        return False
    obj.load_format = fmt[len(STAGED_FORMAT):] or None
    setattr(obj, STAGED_ATTR, True)
    return True


# -- the shadow model ---------------------------------------------------------------------------------


def _param_like(p, data):
    import torch

    q = torch.Tensor._make_subclass(type(p), data, False)  # the parameter's own class (SGLang's carry loaders)
    q.__dict__.update(p.__dict__)
    return q


def shadow_model(model):
    """A module tree like ``model`` (every module a shallow copy: code, config, buffers, hooks shared) whose
    parameters are copies of ``model``'s; parameters shared between modules (tied embeddings) stay shared."""
    import torch

    params: dict[int, torch.nn.Parameter] = {}
    modules: dict[int, torch.nn.Module] = {}

    def walk(m):
        if id(m) in modules:
            return modules[id(m)]
        new = modules[id(m)] = copy.copy(m)
        d = new.__dict__
        d["_parameters"] = {n: None if p is None else params.setdefault(id(p), _param_like(p, p.detach().clone()))
                            for n, p in m._parameters.items()}
        d["_buffers"] = dict(m._buffers)
        d["_modules"] = {n: None if c is None else walk(c) for n, c in m._modules.items()}
        return new

    with torch.no_grad():
        return walk(model)


def pairs(live, shadow) -> tuple[list, list]:
    """(live parameters, shadow parameters) by name; a mismatch (a load that replaced a parameter with another
    shape or dtype, or added one) raises."""
    a, b = dict(live.named_parameters()), dict(shadow.named_parameters())
    if a.keys() != b.keys():
        raise RuntimeError(f"the staged model's parameters differ from the live ones: only live "
                           f"{sorted(a.keys() - b.keys())[:4]}, only staged {sorted(b.keys() - a.keys())[:4]}")
    bad = [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype or a[n].device != b[n].device]
    if bad:
        raise RuntimeError(f"staged parameters {bad[:4]} changed shape, dtype or device in the load: not swappable")
    names = list(a)
    return [a[n] for n in names], [b[n] for n in names]


# -- the scheduler side -------------------------------------------------------------------------------


class Staging:
    """One scheduler process's staged update: the shadow, the loads into it since the last commit (one at a time, in
    the order they came; a sync of several buckets is several loads), and the answer owed."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.shadow = None
        self.stream = None  # CUDA: the loader thread's stream
        self.swapped = None  # CUDA: an event after the last swap's copies
        self.queue: collections.deque = collections.deque()
        self.req = None  # the load running (or done and not yet agreed on by every rank)
        self.thread: threading.Thread | None = None
        self.ok, self.message = False, ""
        self.open = False  # the shadow holds loads not committed yet
        self.whole = True  # every load since the last commit succeeded

    @property
    def busy(self) -> bool:
        return self.open or self.req is not None or bool(self.queue)

    def submit(self, req) -> None:
        self.queue.append(req)
        self._next()

    def _next(self) -> None:
        if self.req is not None or not self.queue:
            return
        self.req = self.queue.popleft()
        full = type(self.req).__name__ == "UpdateWeightFromDiskReqInput"  # a checkpoint: every weight anew
        refresh = not self.open
        if full:
            self.whole = True
        self.open, self.ok, self.message = True, False, ""
        self.began = (time.perf_counter(), getattr(self.scheduler, "forward_ct", 0))
        self.thread = threading.Thread(target=self._load, args=(self.req, refresh), name="mrl-staged-load",
                                       daemon=True)
        self.thread.start()

    def _load(self, req, refresh: bool) -> None:
        import torch

        runner = self.scheduler.tp_worker.model_runner
        cuda = str(runner.device).startswith("cuda")
        try:
            if cuda:
                torch.cuda.set_device(runner.gpu_id)
                if self.stream is None:
                    self.stream = torch.cuda.Stream()
            with torch.no_grad(), torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
                if self.swapped is not None:  # the last swap's copies read the shadow and wrote the live model
                    self.stream.wait_event(self.swapped)
                if self.shadow is None:
                    self.shadow = shadow_model(runner.model)
                elif refresh:  # the live weights may have changed since (an update that was not staged)
                    live, staged = pairs(runner.model, self.shadow)
                    torch._foreach_copy_(staged, live)
                view = copy.copy(runner)
                view.model = self.shadow
                view.__dict__["_mrl_load_plans"] = runner.__dict__.setdefault("_mrl_staged_plans", {})
                self.ok, self.message = _update(view, req, getattr(self.scheduler.tp_worker, "tp_rank", 0))
                if cuda:
                    self.stream.synchronize()
        except Exception as e:
            self.ok, self.message = False, f"staged load failed: {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        if not self.ok:
            print(f"mrl: staged weight update failed: {self.message}", file=sys.stderr, flush=True)

    def poll(self, wait: bool = False) -> None:
        """Answer the running load once every rank's is done (``wait``: block until it is), and start the next.
        Called at the same point of the loop on every TP rank."""
        if self.req is None:
            return
        if wait:
            self.thread.join()
        state = _PENDING if self.thread.is_alive() else (_DONE if self.ok else _FAILED)
        group = getattr(self.scheduler, "tp_cpu_group", None)
        if getattr(self.scheduler, "tp_size", 1) > 1 and group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([state], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
            state = int(t.item())
        if state == _PENDING:
            return
        self.whole &= state == _DONE
        message = self.message or ("Succeeded (staged)." if state == _DONE else "a TP rank's staged load failed")
        t0, ct0 = self.began
        forwards = getattr(self.scheduler, "forward_ct", 0) - ct0
        print(f"{STAGED_MARK}: {type(self.req).__name__} {'loaded' if state == _DONE else 'failed'} in "
              f"{time.perf_counter() - t0:.3f} s, {forwards} forward passes meanwhile", file=sys.stderr, flush=True)
        message += f" [mrl: staged, {forwards} forward passes during the load]"
        self.scheduler.ipc_channels.send_to_tokenizer.send_output(_output(self.req, state == _DONE, message), self.req)
        self.req, self.thread = None, None
        self._next()

    def commit(self) -> bool:
        """Swap the staged weights in (after the loads still queued); whether it did. Between two forward passes."""
        while self.req is not None:
            self.poll(wait=True)
        ok = self.open and self.whole
        why = "a staged load failed"
        if ok:
            try:
                self._swap(*pairs(self.scheduler.tp_worker.model_runner.model, self.shadow))
            except RuntimeError as e:
                ok, why = False, str(e)
        if self.open and not ok:
            print(f"mrl: {why}: the staged weights are not swapped in", file=sys.stderr, flush=True)
        self.open, self.whole = False, True
        return ok

    def _swap(self, live, staged) -> None:
        import torch

        with torch.no_grad():
            if not live[0].is_cuda:
                torch._foreach_copy_(live, staged)
                return
            cur = torch.cuda.current_stream()
            fwd = getattr(self.scheduler, "forward_stream", None)
            if fwd is not None:  # after the forward pass already launched (the overlap scheduler runs one ahead)
                cur.wait_stream(fwd)
            torch._foreach_copy_(live, staged)
            if fwd is not None:  # and before the next one
                fwd.wait_stream(cur)
            self.swapped = cur.record_event()


def _update(view, req, tp_rank: int) -> tuple[bool, str]:
    """SGLang's own update of ``req``'s kind on the runner ``view`` (whose model is the shadow)."""
    kind = type(req).__name__
    if kind == "UpdateWeightFromDiskReqInput":
        return view.update_weights_from_disk(req.model_path, req.load_format)
    if kind == "UpdateWeightsFromTensorReqInput":
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return view.update_weights_from_tensor(
            named_tensors=MultiprocessingSerializer.deserialize(req.serialized_named_tensors[tp_rank]),
            load_format=req.load_format)
    if kind == "UpdateWeightsFromDistributedReqInput":
        return view.update_weights_from_distributed(req.names, req.dtypes, req.shapes, req.group_name,
                                                    req.load_format)
    return False, f"a staged update takes disk, tensor or distributed updates, not {kind}"


def _output(req, ok: bool, message: str):
    from sglang.srt.managers import io_struct as io

    kind = type(req).__name__
    if kind == "UpdateWeightFromDiskReqInput":
        return io.UpdateWeightFromDiskReqOutput(ok, message, 0)
    if kind == "UpdateWeightsFromTensorReqInput":
        return io.UpdateWeightsFromTensorReqOutput(ok, message)
    return io.UpdateWeightsFromDistributedReqOutput(ok, message)


def staging(scheduler) -> Staging:
    s = scheduler.__dict__.get("_mrl_staging")
    if s is None:
        s = scheduler.__dict__["_mrl_staging"] = Staging(scheduler)
    return s


def stage_loads(module) -> None:
    """``Scheduler.process_input_requests`` starts marked updates in the loader thread and answers them when
    every rank's load is done."""
    found = target(module, "Scheduler", "process_input_requests", "_mrl_staged", "no staged updates")
    if found is None:
        return
    sched, process = found

    @functools.wraps(process)
    def process_input_requests(self, recv_reqs):
        marked = [r for r in recv_reqs if getattr(r, STAGED_ATTR, False)]
        if marked:
            recv_reqs = [r for r in recv_reqs if not getattr(r, STAGED_ATTR, False)]
        out = process(self, recv_reqs)
        st = staging(self)
        for r in marked:
            st.submit(r)
        st.poll()
        return out

    process_input_requests._mrl_staged = True
    sched.process_input_requests = process_input_requests


# -- the tokenizer manager side -----------------------------------------------------------------------


def unlocked_updates(module) -> None:
    """The tokenizer manager sends a staged update to the scheduler without SGLang's writer lock (which waits for
    every request in flight to end) and stamps the request's version once it is loaded, as SGLang does."""
    tm = getattr(module, "TokenizerManager", None)
    if tm is None:
        return
    for name, communicator in (("update_weights_from_tensor", "update_weights_from_tensor_communicator"),
                               ("update_weights_from_distributed", "update_weights_from_distributed_communicator"),
                               ("update_weights_from_disk", None)):
        orig = getattr(tm, name, None)
        if orig is None or getattr(orig, "_mrl_staged", False):
            continue
        setattr(tm, name, _unlocked(orig, communicator))


def _unlocked(orig, communicator: str | None):
    @functools.wraps(orig)
    async def update(self, obj, request=None):
        if not unmark(obj):
            return await orig(self, obj, request)
        self.auto_create_handle_loop()
        if communicator is None:  # disk: the scheduler answers one future (SGLang's own path, minus the lock)
            if obj.load_format is None:
                obj.load_format = self.server_args.load_format
            ok, message, paused = await self._wait_for_model_update_from_disk(obj)
        else:
            from sglang.srt.managers.communicator import FanOutCommunicator

            ok, message = FanOutCommunicator.merge_results(await getattr(self, communicator)(obj))
        if ok and obj.weight_version is not None:
            self._update_weight_version_if_provided(obj.weight_version)
            message += f" Weight version updated to {obj.weight_version}."
        return (ok, message, paused) if communicator is None else (ok, message)

    update._mrl_staged = True
    return update
