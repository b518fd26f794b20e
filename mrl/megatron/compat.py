"""The one compatibility module for megatron-core 0.19.2: CPU/gloo shims and torch-Adam fixes.

Import before ``megatron.core``. What applies:
- no CUDA (CPU boxes, CI): every shim below;
- CUDA without apex/Transformer Engine: only the DistributedOptimizer torch-Adam fixes;
- triton missing: the paged-stash stub.

Every shim names the megatron-core file:line it covers (paths relative to ``megatron/core/``) and
records each megatron call site that goes through it (``SHIMS[name].hits``). ``tests/unit/test_compat.py``
runs the paths mrl uses and fails when a shim is no longer hit or when a call site appears that is
not listed here, so a megatron upgrade cannot silently break CPU mode. Re-check the lists on every bump.

Switches: ``MRL_COMPAT_DISABLE=1`` applies nothing; ``TORCHDYNAMO_DISABLE=1`` skips the single
``torch.compile``'d router function (``transformer/moe/router.py`` ``_apply_expert_bias``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types
from dataclasses import dataclass, field

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
BACKEND = "nccl" if HAS_CUDA else "gloo"


def to_device(t: torch.Tensor, device: torch.device = DEVICE) -> torch.Tensor:
    """A host tensor on the trainer's device without stopping the host: on GPUs it is copied from pinned
    memory, asynchronously. A copy from pageable memory first waits for the device's stream to drain, so
    the host can no longer queue work ahead of the GPU (and, with expert parallelism, its peers wait for
    it at the next all-to-all)."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Shim:
    """One workaround: what it covers and which megatron call sites actually went through it."""

    name: str
    covers: tuple[str, ...]
    """megatron-core file:line sites this shim is known to serve (0.19.2)."""
    applied: bool = False
    hits: set[str] = field(default_factory=set)


SHIMS: dict[str, Shim] = {}
_lock = threading.Lock()


def _shim(name: str, *covers: str) -> Shim:
    s = SHIMS.setdefault(name, Shim(name, tuple(covers)))
    return s


def _megatron_site(depth: int = 2) -> str | None:
    """file:line (relative to megatron/core/) of the innermost megatron frame calling us."""
    f = sys._getframe(depth)
    while f is not None:
        fn = f.f_code.co_filename
        i = fn.find("megatron/core/")
        if i >= 0:
            return f"{fn[i + len('megatron/core/'):]}:{f.f_lineno}"
        f = f.f_back
    return None


def _hit(name: str) -> None:
    site = _megatron_site(3)
    if site is not None:
        with _lock:
            SHIMS[name].hits.add(site)


# ----------------------------------------------------------------------------------------------
# 1. triton-only kernel module imported unconditionally
# ----------------------------------------------------------------------------------------------
def _stub_paged_stash() -> None:
    """``import megatron.core`` fails without triton: ``__init__.py:8`` -> ``distributed/finalize_model_grads.py:16``
    -> ``pipeline_parallel/schedules.py:27`` -> ``transformer/moe/paged_stash.py:12`` ->
    ``transformer/moe/ops/paged_stash.py:4`` (unguarded ``import triton``). The kernels serve only the
    paged-stash feature, which mrl never enables, so a stub module that raises on use is enough."""
    name = "megatron.core.transformer.moe.ops.paged_stash"
    shim = _shim("paged_stash_stub", "transformer/moe/ops/paged_stash.py:4")
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*_a, **_k):
        raise RuntimeError("megatron paged-stash kernels need triton, which is not installed")

    mod.paged_stash_copy_kernel = _unavailable
    mod.paged_stash_pop_kernel = _unavailable
    sys.modules[name] = mod
    shim.applied = True


# ----------------------------------------------------------------------------------------------
# 2. torch.cuda entry points -> CPU
# ----------------------------------------------------------------------------------------------
CUDA_API_SITES = {
    # megatron calls torch.cuda.current_device() ~200 times to place buffers; these are the sites
    # on the paths mrl runs (model build, SP/EP/PP fwd+bwd through the schedules, DDP, optimizer).
    "cuda.current_device": (
        "distributed/param_and_grad_buffer.py:1180",
        "distributed/param_and_grad_buffer.py:1186",
        "models/common/embeddings/rotary_pos_embedding.py:162",
        "pipeline_parallel/p2p_communication.py:334",
        "pipeline_parallel/p2p_communication.py:342",
        "tensor_parallel/layers.py:647",
        "tensor_parallel/mappings.py:145",
        "tensor_parallel/mappings.py:185",
        "tensor_parallel/mappings.py:447",
        "transformer/moe/router.py:98",
        "utils.py:715",
    ),
    # model_parallel_cuda_manual_seed / CudaRNGStatesTracker.add
    "cuda.rng": ("tensor_parallel/random.py:303", "tensor_parallel/random.py:305",
                 "tensor_parallel/random.py:306", "tensor_parallel/random.py:490"),
    "cuda.streams": ("distributed/param_and_grad_buffer.py:632", "pipeline_parallel/p2p_communication.py:419"),
}


def _install_torch_cuda_shims() -> None:
    import torch.cuda as tc

    cpu = torch.device("cpu")
    dev = _shim("cuda.current_device", *CUDA_API_SITES["cuda.current_device"])
    rng = _shim("cuda.rng", *CUDA_API_SITES["cuda.rng"])
    streams = _shim("cuda.streams", *CUDA_API_SITES["cuda.streams"])

    def current_device():
        _hit("cuda.current_device")
        return cpu

    def get_rng_state(device="cuda"):
        _hit("cuda.rng")
        return torch.get_rng_state()

    def set_rng_state(state, device="cuda"):
        _hit("cuda.rng")
        torch.set_rng_state(state)

    def manual_seed(seed):
        _hit("cuda.rng")
        torch.manual_seed(seed)

    def current_stream(device=None):
        _hit("cuda.streams")
        return torch.cpu.current_stream()

    def stream(s):
        _hit("cuda.streams")
        return torch.cpu.stream(s)

    def synchronize(device=None):
        _hit("cuda.streams")

    tc.current_device = current_device
    tc.get_rng_state = tc.random.get_rng_state = get_rng_state
    tc.set_rng_state = tc.random.set_rng_state = set_rng_state
    tc.manual_seed = tc.random.manual_seed = manual_seed
    tc.current_stream = current_stream
    tc.stream = stream
    tc.synchronize = synchronize
    dev.applied = rng.applied = streams.applied = True


def _patch_megatron_rng() -> None:
    """``tensor_parallel/random.py:104`` ``_get_cuda_rng_state`` and ``:137`` ``_set_cuda_rng_state`` use
    ``torch.cuda.default_generators`` / ``_lazy_call``. On the CPU generator, megatron's own
    ``CudaRNGStatesTracker`` (dropout, recompute, init) keeps its fork/restore semantics."""
    from megatron.core.tensor_parallel import random as mrandom

    shim = _shim("megatron_rng", "tensor_parallel/random.py:308", "tensor_parallel/random.py:318",
                 "tensor_parallel/random.py:323", "tensor_parallel/random.py:341", "tensor_parallel/random.py:345")

    def _get(device="cuda", clone=False, graph_safe=False):
        _hit("megatron_rng")
        return torch.get_rng_state()

    def _set(new_state, device=-1, graph_safe=False):
        _hit("megatron_rng")
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get
    mrandom._set_cuda_rng_state = _set
    shim.applied = True


# ----------------------------------------------------------------------------------------------
# 3. alltoall token dispatcher: CUDA streams and numpy split sizes
# ----------------------------------------------------------------------------------------------
def _patch_alltoall_dispatcher() -> None:
    """``transformer/moe/token_dispatcher.py:469`` creates ``torch.cuda.Stream()`` in ``__init__``;
    ``:922-946`` ``_maybe_dtoh_and_synchronize`` uses CUDA streams/events; and ``moe_utils.py:1184``
    ``maybe_move_tensor_to_cpu(as_numpy=True)`` converts only CUDA tensors, so on CPU the split sizes
    stay tensors and ``all_to_all_single`` raises TypeError. Same moves, no streams, numpy splits."""
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    # :469 never runs: the class attribute set below makes __init__ skip torch.cuda.Stream()
    shim = _shim("alltoall_dispatcher", "transformer/moe/token_dispatcher.py:922")
    cls = td.MoEAlltoAllTokenDispatcher
    cls.cuda_dtoh_stream = torch.cpu.Stream()

    def _np(t):
        return t.numpy() if torch.is_tensor(t) else t

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            SHIMS["alltoall_dispatcher"].hits.add("transformer/moe/token_dispatcher.py:922")
            tokens_per_expert = maybe_move_tensor_to_cpu(tokens_per_expert)
            self.input_splits = _np(self.input_splits)
            self.output_splits = _np(self.output_splits)
            self.output_splits_tp = _np(self.output_splits_tp)
            self.num_out_tokens = maybe_move_tensor_to_cpu(self.num_out_tokens)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = maybe_move_tensor_to_cpu(
                    self.num_global_tokens_per_local_expert
                )
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    shim.applied = True


# ----------------------------------------------------------------------------------------------
# 4. gloo cannot all_gather uneven tensors
# ----------------------------------------------------------------------------------------------
def _patch_uneven_allgather() -> None:
    """``tensor_parallel/mappings.py:154`` ``_gather_along_first_dim(..., output_split_sizes)`` all-gathers
    tensors of different sizes; gloo raises "invalid tensor size". Hit by the alltoall dispatcher when
    ETP>1 and EP>1. On gloo: pad to the largest, ``all_gather_into_tensor``, trim."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    # recorded at the callers: gather_from_sequence_parallel_region with output_split_sizes
    shim = _shim("uneven_allgather", "tensor_parallel/mappings.py:329", "tensor_parallel/mappings.py:377")
    orig = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (output_split_sizes is None or group is None or group.size() == 1
                or dist.get_backend(group) != "gloo"):
            return orig(input_, group, output_split_sizes, use_global_buffer)
        _hit("uneven_allgather")
        sizes = [int(x) for x in output_split_sizes]
        m = max(sizes)
        padded = input_.new_zeros((m,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((m * group.size(),) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * m: i * m + n] for i, n in enumerate(sizes)], dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim
    shim.applied = True


# ----------------------------------------------------------------------------------------------
# 5. literal device="cuda", .cuda(), Tensor.type() == "torch.cuda.*" checks
# ----------------------------------------------------------------------------------------------
def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, str) and d.startswith("cuda")


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA placements made by megatron to CPU.

    megatron allocates small tensors with a literal ``device="cuda"`` (``pipeline_parallel/schedules.py:749``
    ``total_num_tokens``, ``optimizer/optimizer.py:315`` ``found_inf``, ``optimizer/clip_grads.py:108``),
    calls ``.cuda()`` (``optimizer/distrib_optimizer.py:1374``) and rejects tensors whose ``type()`` is not
    ``torch.cuda.*Tensor`` (``optimizer/clip_grads.py:174``, ``optimizer/distrib_optimizer.py:401,466,758``).
    This thread-local mode maps those to CPU and, for megatron callers only, reports CPU tensors as
    ``torch.cuda.*``. It costs a Python call per torch function, a few percent of a tiny model's step.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs = dict(kwargs, device="cpu")
            _hit("cuda_to_cpu_mode")
        if func is torch.Tensor.cuda:
            _hit("cuda_to_cpu_mode")
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _hit("cuda_to_cpu_mode")
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            out = func(*args)
            if out.startswith("torch.") and not out.startswith("torch.cuda."):
                caller = sys._getframe(1).f_code.co_filename
                if "megatron/core/" in caller:
                    _hit("cuda_to_cpu_mode")
                    return "torch.cuda." + out[len("torch."):]
            return out
        return func(*args, **kwargs)


_MODE: CudaToCpuMode | None = None


def _enter_cuda_to_cpu_mode() -> None:
    global _MODE
    _shim("cuda_to_cpu_mode",
          "optimizer/clip_grads.py:108", "optimizer/clip_grads.py:112", "optimizer/clip_grads.py:174",
          "optimizer/clip_grads.py:180", "optimizer/distrib_optimizer.py:401", "optimizer/distrib_optimizer.py:466",
          "optimizer/distrib_optimizer.py:758", "optimizer/optimizer.py:315", "optimizer/optimizer.py:698",
          "optimizer/optimizer.py:702", "pipeline_parallel/schedules.py:749", "pipeline_parallel/schedules.py:2292",
          "transformer/utils.py:39", "utils.py:1332").applied = True
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    # torch 2.11 runs autograd's backward without the caller's torch-function modes, and megatron's
    # activation recompute re-runs the forward there (e.g. the causal mask at transformer/utils.py:39)
    from megatron.core.tensor_parallel import random as mrandom

    for fn in (mrandom.CheckpointFunction, mrandom.CheckpointWithoutOutputFunction):
        def backward(ctx, *args, _backward=fn.backward):
            with CudaToCpuMode():
                return _backward(ctx, *args)

        fn.backward = staticmethod(backward)


# ----------------------------------------------------------------------------------------------
# 6. DistributedOptimizer with the torch-Adam backend (no apex/TE): any device
# ----------------------------------------------------------------------------------------------
def _patch_distopt_torch_adam() -> None:
    """Two megatron-core bugs of the DistributedOptimizer with torch Adam (no apex/TE), and a third avoided:
    (a) ``optimizer/distrib_optimizer.py:1219-1225`` copies every tensor of the live state, but the loader
        drops torch-Adam's tensor ``step`` (``:2390``) -> KeyError 'step'; missing keys now read as None.
    (b) ``optimizer/distrib_optimizer.py:1032`` gives every param ONE shared ``step`` tensor; torch Adam
        increments it once per param, so a resumed run uses wrong bias correction. Un-share after loading.
    (d) ``:1225`` copies into the model's own params when they are the main params (fp32 models): the
        dp_reshardable loader calls it outside ``no_grad`` and autograd refuses an in-place copy into a leaf.
    (e) ``:1021`` gives the per-param ``step`` the checkpoint's count only when it rebuilds the state; the
        dp_reshardable path keeps the placeholder state's count (1). Set from the saved param groups.
    ((c) the empty-state assert at ``:839`` is avoided by the checkpoint code calling
    ``_init_optimizer_states_with_dummy_values`` before loading.)"""
    from megatron.core.optimizer import distrib_optimizer as do

    if getattr(do, "HAVE_APEX_OR_TE", True):
        return
    shim = _shim("distopt_torch_adam", "optimizer/distrib_optimizer.py:1219", "optimizer/distrib_optimizer.py:1032")

    class _NoneForMissing(dict):
        def __missing__(self, key):
            return None

    orig_set = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set(self, model_param, tensors):
        shim.hits.add("optimizer/distrib_optimizer.py:1219")
        with torch.no_grad():
            return orig_set(self, model_param, _NoneForMissing(tensors))

    orig_load = do.DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        out = orig_load(self, state_dict)
        shim.hits.add("optimizer/distrib_optimizer.py:1032")
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if "step" in g}
        for st in self.optimizer.state.values():
            if len(steps) == 1 and "step" in st:  # (e) the checkpoint's count, whatever the loader left there
                st["step"] = torch.tensor(float(next(iter(steps))))
            elif torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        return out

    do.DistributedOptimizer._set_main_param_and_optimizer_states = _set
    do.DistributedOptimizer.load_state_dict = load_state_dict
    shim.applied = True


def checkpoint_writes_in_process() -> None:
    """``dist_checkpointing/strategies/filesystem_async.py:65`` keeps the checkpoint writer's results queue
    in a ``multiprocessing`` Manager: a spawned server process per rank, seconds to start at the first save
    and to join at exit, shut down only by a finalizer (a killed rank leaves it running for good). mrl saves
    synchronously (``dist_checkpointing.save`` without ``async_sharded_save``): the writer threads and the
    reader of their results are all in the rank's own process, so a plain in-process queue carries them.
    An asynchronous save would have to pickle it and fails saying so. Call before ``dist_checkpointing.save``;
    idempotent."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def checkpoint_writes_in_child() -> None:
    """An asynchronous save's writer is a process megatron forks per save, so its results must cross
    processes: a queue served by a ``multiprocessing`` Manager, as megatron's own default, but forked
    rather than spawned (a spawned server re-imports the rank's main module), and dying with the rank. Not
    a plain fork-context queue: a writer's results fill its pipe while the rank, joining the writer, does
    not read it yet. Call before ``dist_checkpointing.save(..., async_sharded_save=True)``."""
    import multiprocessing
    import queue
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mrl.process import die_with_parent

    if getattr(filesystem_async, "_results_queue", None) is None or \
            isinstance(filesystem_async._results_queue, queue.Queue):
        server = SyncManager(ctx=multiprocessing.get_context("fork"))
        server.start(initializer=die_with_parent)
        filesystem_async._results_queue = server.Queue()  # the queue's proxy keeps its server


def _apply() -> None:
    if os.environ.get("MRL_COMPAT_DISABLE") == "1":
        return
    _stub_paged_stash()
    _patch_distopt_torch_adam()
    if HAS_CUDA:
        return
    _install_torch_cuda_shims()
    _patch_megatron_rng()
    _patch_alltoall_dispatcher()
    _patch_uneven_allgather()
    _enter_cuda_to_cpu_mode()


_apply()
