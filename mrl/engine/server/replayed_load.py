"""A weight-update bucket's load, recorded once and replayed as plain copies.

An SGLang engine loads each received bucket through its model's ``load_weights``: Python per HF tensor
(name matching, stacked-parameter mapping, one ``weight_loader`` call per expert), so on GPUs the load,
not the broadcast, sets the pace of a sync. For a given bucket layout (names, dtypes, shapes) that load
always moves the same bytes to the same places. :func:`record_load` runs it once under a dispatch mode
that sees every aten op; when the load is nothing but views and copies from the received flat buffer
into the model's parameters, the copies make a :class:`LoadPlan`, and later buckets of that layout are
loaded by :meth:`LoadPlan.replay` (batched copies, no per-tensor Python in the model).

Anything else refuses the plan and the bucket keeps the model's own load: a copy from a temporary (a
converted or concatenated tensor), any other op that writes a parameter, and any op that computes on
loaded or parameter data (a derived weight such as DeepSeek's absorbed MLA matrices would otherwise go
stale). Pure torch: the engine patch (``mrl.engine.server.patches``) uses it inside SGLang's servers,
the unit tests drive it directly.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# ops that only read metadata (sizes, strides, layout), never element values
_METADATA = {_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default,
             _aten.is_contiguous.default, _aten.is_contiguous.memory_format, _aten.size.int, _aten.stride.int,
             _aten.numel.default, _aten.dim.default, _aten.is_same_size.default}
# new tensors shaped like another: they read its metadata, never its values
_LIKE = {_aten.zeros_like.default, _aten.empty_like.default, _aten.ones_like.default, _aten.full_like.default,
         _aten.new_zeros.default, _aten.new_empty.default, _aten.new_ones.default, _aten.new_full.default}


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def _slot(module: torch.nn.Module, attr: str):
    return module._parameters.get(attr, module._buffers.get(attr))


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


_Src = tuple  # (dtype, storage offset, size, stride) of a source inside the flat bucket


@dataclass
class LoadPlan:
    """What one bucket layout's load did, in order: copies from the flat bucket into views of parameters
    (consecutive ones batched into one step) and fills of parameter views with constants."""

    steps: list[tuple[list[torch.Tensor], list[_Src] | float]]
    """(destinations, their sources) for a run of copies, (destinations, value) for a run of fills"""
    owners: list[tuple[torch.nn.Module, str, int]]
    """(module, attribute, storage) of every tensor the plan writes, to notice it being replaced"""

    @property
    def copies(self) -> int:
        return sum(len(d) for d, what in self.steps if isinstance(what, list))

    @property
    def fills(self) -> int:
        return sum(len(d) for d, what in self.steps if not isinstance(what, list))

    def valid(self) -> bool:
        """False once a tensor the plan writes was replaced in its module (a reload may swap them)."""
        return all(_storage(_slot(m, a)) == ptr for m, a, ptr in self.owners)

    def __post_init__(self) -> None:
        self.batched = [_batch(dsts, what) if isinstance(what, list) else None for dsts, what in self.steps]

    def counts(self) -> dict[str, int]:
        """Per replay: copies recorded, copies run (after merging; ``fused``: of these, the ones in a list
        that CUDA copies with its fused multi-tensor kernel), and the calls (batched copies and fills)."""
        calls = [c for b in self.batched if b is not None for c in b]
        return {"copies": self.copies, "fills": self.fills,
                "copies_run": sum(len(c[1]) if c[0] == "foreach" else 1 for c in calls),
                "fused": sum(len(c[1]) for c in calls if c[0] == "foreach" and _fusable(c[1], c[2])),
                "calls": len(calls) + sum(1 for b in self.batched if b is None)}

    def replay(self, flat: torch.Tensor) -> None:
        """Load a received bucket of this layout: the recorded steps, each copy step as at most two batched
        copies and an ``index_copy_`` per reversed run (``_batch``)."""
        storage = flat.untyped_storage()
        typed: dict[torch.dtype, torch.Tensor] = {}

        def src(dtype, offset, size, stride):
            base = typed.get(dtype)
            if base is None:
                n = storage.nbytes() // dtype.itemsize
                base = typed[dtype] = torch.empty(0, dtype=dtype, device=flat.device).set_(storage, 0, (n,), (1,))
            return base.as_strided(size, stride, offset)

        for (dsts, what), batched in zip(self.steps, self.batched):
            if batched is not None:
                for kind, d, specs, *index in batched:
                    if kind == "foreach":
                        torch._foreach_copy_(d, [src(*spec) for spec in specs])
                    else:
                        d.index_copy_(0, index[0], src(*specs))
            elif what == 0:
                torch._foreach_zero_(dsts)
            else:
                for d in dsts:
                    d.fill_(what)


def _contiguous(size, stride) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _footprint(size, stride) -> int:
    """Elements from a view's first to one past its last (its span in the storage)."""
    return 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0


def _index_backwards(t: torch.Tensor) -> bool:
    """Merge a backwards run into one ``index_copy_``: on CUDA it replaces a kernel launch per tensor; on CPU
    a copy per tensor costs little to issue and ``index_copy_`` moves the bytes more slowly."""
    return t.is_cuda


def _fusable(dsts, specs) -> bool:
    return all(d.dtype == spec[0] and d.is_contiguous() and _contiguous(spec[2], spec[3])
               for d, spec in zip(dsts, specs))


def _batch(dsts: list[torch.Tensor], srcs: list[_Src]) -> list[tuple]:
    """One recorded copy step as the calls that replay it: ``("foreach", destinations, source specs)`` for
    a ``_foreach_copy_``, ``("index", destination, source spec, index)`` for an ``index_copy_``.

    ``_foreach_copy_`` takes CUDA's fused multi-tensor path only when every pair is contiguous with equal
    strides; a single strided pair (a row-parallel shard, e.g. each expert's ``down_proj`` at engine TP > 1,
    narrowed along its columns) sends the whole list to one ``copy_`` per tensor. So contiguous pairs go in
    one call and the others in a second, where copies of the same shape into one parameter at evenly spaced
    offsets on both sides (one tensor of every expert of the bucket) become one copy with a leading
    dimension. Contiguous pairs merge only when the merged pair is contiguous too, so they stay fused. When
    the two sides run in opposite directions (megatron's parameter buffer holds the experts in reverse, the
    engine in order) the merged copy is an ``index_copy_`` along that leading dimension (on CUDA, where it
    replaces a kernel launch per expert; on CPU those copies stay one per tensor). Merging reorders
    copies, so a step whose destinations overlap is replayed one copy at a time in the recorded order (two
    copies into one place must keep their order, which a fused kernel would not)."""
    spans = sorted((d.untyped_storage().data_ptr(), d.storage_offset() * d.itemsize,
                    (d.storage_offset() + _footprint(d.size(), d.stride())) * d.itemsize) for d in dsts)
    overlap = any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:]))
    if overlap:
        return [("foreach", [d], [spec]) for d, spec in zip(dsts, srcs)]
    fused: tuple[list, list] = ([], [])
    other: tuple[list, list] = ([], [])
    indexed: list = []

    def put(d: torch.Tensor, spec: _Src) -> None:
        side = fused if _fusable([d], [spec]) else other
        side[0].append(d)
        side[1].append(spec)

    groups: dict[tuple, list] = {}
    for d, spec in zip(dsts, srcs):
        key = (d.untyped_storage().data_ptr(), d.dtype, tuple(d.size()), tuple(d.stride()), spec[0], spec[3])
        groups.setdefault(key, []).append((d, spec))
    for items in groups.values():
        items.sort(key=lambda x: x[1][1])  # source order
        d0 = items[0][0]
        size, d_stride, s_stride = tuple(d0.size()), tuple(d0.stride()), items[0][1][3]
        contiguous = d0.is_contiguous() and _contiguous(size, s_stride)
        n_item = _footprint(size, d_stride)
        run: list = []

        def flush() -> None:
            if len(run) == 1:
                put(*run[0])
            elif run:
                (first, spec), last = run[0], run[-1][0]
                d_step = run[1][0].storage_offset() - first.storage_offset()
                src = (spec[0], spec[1], (len(run), *size), (run[1][1][1] - spec[1], *s_stride))
                if d_step > 0:
                    put(first.as_strided((len(run), *size), (d_step, *d_stride), first.storage_offset()), src)
                elif _index_backwards(first):  # destinations run backwards: source row i to row len - 1 - i
                    dst = last.as_strided((len(run), *size), (-d_step, *d_stride), last.storage_offset())
                    indexed.append(("index", dst, src, torch.arange(len(run) - 1, -1, -1, device=dst.device)))
                else:
                    for d, spec in run:
                        put(d, spec)
            run.clear()

        for d, spec in items:
            if run:
                d_step = d.storage_offset() - run[-1][0].storage_offset()
                s_step = spec[1] - run[-1][1][1]
                steady = len(run) == 1 or (d_step == run[1][0].storage_offset() - run[0][0].storage_offset()
                                           and s_step == run[1][1][1] - run[0][1][1])
                # contiguous pairs only join a run that stays contiguous on both sides
                joins = steady and abs(d_step) >= n_item and s_step > 0 and (
                    not contiguous or d_step == s_step == n_item)
                if not joins:
                    flush()
            run.append((d, spec))
        flush()
    return [("foreach", *side) for side in (fused, other) if side[0]] + indexed


class _Recorder(TorchDispatchMode):
    def __init__(self, flat: torch.Tensor, params: dict[int, tuple[torch.nn.Module, str]]):
        super().__init__()
        self.flat_ptr, self.params = _storage(flat), params
        self.steps, self.written = [], {}
        self.scalar: tuple[float, _Src] | None = None  # the flat value the previous op read with .item()
        self.refusal: str | None = None

    def _refuse(self, why: str) -> None:
        if self.refusal is None:  # where in the model's code: the innermost frame outside torch and this file
            frames = [f for f in traceback.extract_stack()[:-2]
                      if "/torch/" not in f.filename and not f.filename.endswith("replayed_load.py")]
            self.refusal = why + (f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refusal is None:
            scalar, self.scalar = self.scalar, None
            self._check(func, args, kwargs, out, scalar)
        return out

    def _step(self, dst: torch.Tensor, what: _Src | float) -> None:
        """One write, joined to the previous step when it is of the same kind (copies, or fills of one value)."""
        last = self.steps[-1][1] if self.steps else None
        if isinstance(what, tuple) and isinstance(last, list):
            self.steps[-1][0].append(dst)
            last.append(what)
        elif not isinstance(what, tuple) and not isinstance(last, list) and last == what:
            self.steps[-1][0].append(dst)
        else:
            self.steps.append(([dst], [what] if isinstance(what, tuple) else what))
        self.written[_storage(dst)] = self.params[_storage(dst)]

    def _check(self, func, args, kwargs, out, scalar) -> None:
        if func.is_view or func in _METADATA or func in _LIKE:
            return
        tensors = list(_tensors(args, kwargs))
        ours = [t for t in tensors if _storage(t) == self.flat_ptr or _storage(t) in self.params]
        if all(t.numel() == 0 for t in ours):  # nothing read or written (an empty shard of a padded tensor)
            return
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if _storage(dst) in self.params:
                if _storage(src) != self.flat_ptr:
                    return self._refuse(f"a parameter is copied from a computed tensor ({tuple(src.shape)})")
                if src.dtype != dst.dtype or src.shape != dst.shape:
                    return self._refuse(f"a copy converts or broadcasts ({src.dtype}{tuple(src.shape)} -> "
                                        f"{dst.dtype}{tuple(dst.shape)})")
                return self._step(dst, (src.dtype, src.storage_offset(), tuple(src.size()), tuple(src.stride())))
            return self._refuse(f"loaded data is copied into a tensor that is not a parameter ({func})")
        if func is _aten._local_scalar_dense.default and _storage(args[0]) == self.flat_ptr:
            t = args[0]  # a one-element weight read as a number, for the fill that follows
            self.scalar = (out, (t.dtype, t.storage_offset(), (), ()))
            return
        if func in (_aten.fill_.Scalar, _aten.zero_.default) and _storage(args[0]) in self.params:
            dst, value = args[0], (args[1] if func is _aten.fill_.Scalar else 0)
            if scalar is not None and scalar[0] == value:  # fill_(w.item()): a copy of that one element
                if scalar[1][0] != dst.dtype:
                    return self._refuse(f"a one-element weight is converted ({scalar[1][0]} -> {dst.dtype})")
                dtype, offset, _, _ = scalar[1]
                return self._step(dst, (dtype, offset, tuple(dst.size()), (0,) * dst.dim()))
            return self._step(dst, value)
        self._refuse(f"the load computes on loaded or parameter data ({func})")


def record_load(load, flat: torch.Tensor, model: torch.nn.Module) -> tuple[LoadPlan | None, str]:
    """Run ``load()`` (which loads views of ``flat`` into ``model``) and record it. Returns the plan, or
    None and why the load cannot be replayed; the load itself has run either way."""
    params = {_storage(t): (m, a) for m in model.modules()
              for a, t in (*m._parameters.items(), *m._buffers.items()) if t is not None}
    rec = _Recorder(flat, params)
    with rec:
        load()
    if rec.refusal is not None:
        return None, rec.refusal
    if not rec.steps:
        return None, "the load copied nothing into the model's parameters"
    owners = [(m, a, ptr) for ptr, (m, a) in rec.written.items()]
    plan = LoadPlan(rec.steps, owners)
    names = {id(m): n for n, m in model.named_modules()}
    some = ", ".join(f"{names.get(id(m), '?')}.{a}" for m, a, _ in owners[:3]) + (", ..." if len(owners) > 3 else "")
    return plan, f"{plan.copies} copies and {plan.fills} fills into {len(owners)} tensors ({some})"


def bucket_views(flat: torch.Tensor, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a flat bucket, packed back to back as SGLang's ``FlattenedTensorBucket``
    does (each tensor's bytes, no padding), as views of ``flat``."""
    out, at = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        n = dtype.itemsize * int(torch.Size(shape).numel())
        out.append((name, flat[at:at + n].view(dtype).reshape(shape)))
        at += n
    return out


def bucket_nbytes(dtypes, shapes) -> int:
    return sum((d if isinstance(d, torch.dtype) else getattr(torch, d)).itemsize * int(torch.Size(s).numel())
               for d, s in zip(dtypes, shapes))
