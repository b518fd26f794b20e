"""Weight-sync planner: a pure function from the trainer layout and the bridge's parameter maps to
ordered buckets of HF-named full tensors, and which trainer rank sends each.

No torch.distributed, no model: unit-tested on CPU with layouts up to 64 ranks. Rules:
- every HF tensor of the checkpoint is sent exactly once (tied embeddings: once, from the embedding);
- a megatron parameter's HF tensors travel together (q/k/v of one ``linear_qkv``, gate/up of one
  ``linear_fc1``), so each bucket needs whole gathers only;
- senders: for each PP stage, the dense params are sent by (tp=0, cp=0, dp=0) of that stage; experts
  by (etp=0, edp=0) of the EP rank that holds them. Each sender owns one weight-update group, so PP
  stages and EP ranks stream in parallel;
- buckets of one sender keep parameter order and stay <= ``bucket_bytes`` (a single tensor larger
  than that gets a bucket of its own);
- FP8 syncs (``fp8``): each block-FP8 target travels as its e4m3 weight and fp32 scales in the engine's
  checkpoint names (``fp8_param``), both in its param, so buckets fill by FP8 bytes;
- in place (``placements``): params a sender holds already as their HF tensors back to back (no
  gather, no regrouping, the sync dtype) and that follow each other in one storage without a gap
  (megatron's DDP parameter buffer) form buckets of their own, in memory order, which the sender
  broadcasts straight from its parameters: no copy. Only runs of at least ``min_inplace_bytes`` do
  (a layer's norms between two QKV params would cost a request and a broadcast of their own); these
  buckets come first.
Global ranks follow megatron-core's default order "tp-cp-ep-dp-pp" (first varies fastest).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from mrl.models.bridge import ParamMap
from mrl.quant.fp8_format import BLOCK_SIZE, scale_shape
from mrl.quant.fp8_targets import is_fp8_target, scale_inv_name

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
"""Bytes per element of the dtypes a bucket holds (e4m3: FP8 syncs, ``mrl.weight_sync.fp8``)."""
FP8_DTYPE = "float8_e4m3fn"
"""An FP8 target's weight on its way to a block-FP8 engine (``fp8_entries``)."""
SCALE_DTYPE = "float32"
"""Its ``weight_scale_inv``."""
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class TrainerLayout:
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    cp: int = 1
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers per PP stage (uneven pipelines); None = even split."""

    def __post_init__(self) -> None:
        if self.world_size % (self.tp * self.cp * self.pp) or self.world_size % (self.etp * self.ep * self.pp):
            raise ValueError(f"world_size {self.world_size} does not fit tp={self.tp} cp={self.cp} pp={self.pp} "
                             f"ep={self.ep} etp={self.etp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def dense_rank(self, *, pp: int, tp: int = 0, cp: int = 0, dp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def expert_rank(self, *, pp: int, ep: int, etp: int = 0, edp: int = 0) -> int:
        return etp + self.etp * (ep + self.ep * (edp + self.edp * pp))


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PlannedParam:
    mcore_name: str
    """Global megatron name (TP1/EP1/PP1 numbering)."""
    stage: int
    expert: int | None
    """Global expert index, None for dense params."""
    sender: int
    tensors: tuple[HFTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Placement:
    """Where a sender holds a param whose first ``numel`` elements are its HF tensors back to back:
    from element ``offset`` of storage ``storage`` (any id that is equal for params sharing storage)."""

    storage: int
    offset: int
    numel: int


@dataclass
class Bucket:
    sender: int
    group: str
    index: int
    params: list[PlannedParam] = field(default_factory=list)
    inplace: bool = False
    """The params lie back to back in the sender's memory (``Placement``): sent without a copy."""

    @property
    def tensors(self) -> list[HFTensor]:
        return [t for p in self.params for t in p.tensors]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


@dataclass
class SyncPlan:
    layout: TrainerLayout
    buckets: list[Bucket]
    groups: dict[int, str]
    """sender global rank -> weight-update group name"""

    def for_sender(self, rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.sender == rank]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def fp8_entries(t: HFTensor, ignored: Sequence[str] = (), block_size: tuple[int, int] = BLOCK_SIZE
                ) -> tuple[HFTensor, ...]:
    """``t`` as it travels to a block-FP8 engine: its e4m3 weight and fp32 scales, or itself."""
    if len(t.shape) != 2 or not is_fp8_target(t.name, ignored):
        return (t,)
    return (HFTensor(t.name, t.shape, FP8_DTYPE),
            HFTensor(scale_inv_name(t.name), scale_shape(t.shape, block_size), SCALE_DTYPE))


def fp8_param(p: PlannedParam, ignored: Sequence[str] = (), block_size: tuple[int, int] = BLOCK_SIZE
              ) -> PlannedParam:
    """A planned param with its FP8 targets replaced by their (weight, scale) pairs."""
    return replace(p, tensors=tuple(e for t in p.tensors for e in fp8_entries(t, ignored, block_size)))


def layer_stage(layer: int, num_layers: int, pp: int, stage_layers: tuple[int, ...] | None = None) -> int:
    """PP stage holding a global layer index (``stage_layers``: per-stage counts of an uneven split)."""
    if stage_layers is None:
        if num_layers % pp:
            raise ValueError(f"parallel.pp={pp} does not divide {num_layers} layers")
        stage_layers = (num_layers // pp,) * pp
    if len(stage_layers) != pp or sum(stage_layers) != num_layers:
        raise ValueError(f"stage layer counts {stage_layers} do not split {num_layers} layers over pp={pp}")
    end = 0
    for stage, n in enumerate(stage_layers):
        end += n
        if layer < end:
            return stage
    raise ValueError(f"layer {layer} is beyond the model's {num_layers} layers")


def plan_params(maps: list[ParamMap], layout: TrainerLayout, *, num_layers: int, num_experts: int,
                dtype: str = "float32", tied: bool = False, fp8: bool = False,
                fp8_ignore: tuple[str, ...] = ()) -> list[PlannedParam]:
    """Every param to send, with its sender and HF tensors; ``fp8``: the block-FP8 targets (but the modules
    ``fp8_ignore`` keeps in high precision, as the engines' export does) as (e4m3 weight,
    fp32 scales) pairs, for engines started from a block-FP8 checkpoint."""
    if num_experts and num_experts % layout.ep:
        raise ValueError(f"parallel.ep={layout.ep} does not divide {num_experts} experts")
    per_ep = num_experts // layout.ep if num_experts else 0
    out = []
    for pm in maps:
        if tied and pm.mcore_name == "output_layer.weight":
            continue
        m = _LAYER.match(pm.mcore_name)
        if m:
            stage = layer_stage(int(m.group(1)), num_layers, layout.pp, layout.stage_layers)
        elif pm.mcore_name.startswith("embedding."):
            stage = 0
        else:  # final norm, output layer
            stage = layout.pp - 1
        e = _EXPERT.search(pm.mcore_name)
        expert = int(e.group(1)) if e else None
        sender = (layout.expert_rank(pp=stage, ep=expert // per_ep) if expert is not None
                  else layout.dense_rank(pp=stage))
        shapes: dict[str, int] = {}
        for seg in pm.segments:
            for p in seg:
                if p.hf_name is not None:
                    shapes[p.hf_name] = shapes.get(p.hf_name, 0) + p.num_rows
        tensors = tuple(HFTensor(n, (rows,) + ((pm.num_cols,) if pm.num_cols else ()), dtype)
                        for n, rows in shapes.items())
        p = PlannedParam(pm.mcore_name, stage, expert, sender, tensors)
        out.append(fp8_param(p, fp8_ignore) if fp8 else p)
    return out


def _inplace_runs(params: list[PlannedParam], placements: dict[str, Placement], min_bytes: int
                  ) -> list[list[PlannedParam]]:
    """Runs of params that follow each other in one storage without a gap, in memory order, of at
    least ``min_bytes`` each."""
    placed = sorted((p for p in params if p.mcore_name in placements),
                    key=lambda p: (placements[p.mcore_name].storage, placements[p.mcore_name].offset))
    runs: list[list[PlannedParam]] = []
    for p in placed:
        at, prev = placements[p.mcore_name], runs[-1][-1] if runs else None
        before = placements[prev.mcore_name] if prev is not None else None
        if before is None or before.storage != at.storage or before.offset + before.numel != at.offset:
            runs.append([])
        runs[-1].append(p)
    return [r for r in runs if sum(p.nbytes for p in r) >= min_bytes]


def plan_sync(maps: list[ParamMap], layout: TrainerLayout, *, num_layers: int, num_experts: int,
              bucket_bytes: int, dtype: str = "float32", tied: bool = False, group_prefix: str = "mrl",
              placements: dict[str, Placement] | None = None, min_inplace_bytes: int | None = None,
              fp8: bool = False, fp8_ignore: tuple[str, ...] = ()) -> SyncPlan:
    """Ordered buckets per sender; bucket i of every sender can be streamed concurrently.
    ``placements``: every sender's params that can go out in place (module docstring). Runs shorter
    than ``min_inplace_bytes`` (default: a quarter bucket) are copied: each bucket costs a request and
    a broadcast, and a short run (a layer's o_proj and norms between two QKV params) is cheaper to copy
    into a bucket with others."""
    if bucket_bytes <= 0:
        raise ValueError(f"weight_sync.bucket_mb must be > 0, got {bucket_bytes} bytes")
    params = plan_params(maps, layout, num_layers=num_layers, num_experts=num_experts, dtype=dtype, tied=tied,
                         fp8=fp8, fp8_ignore=fp8_ignore)
    senders = sorted({p.sender for p in params})
    groups = {r: f"{group_prefix}-r{r}" for r in senders}
    buckets: list[Bucket] = []
    for r in senders:
        mine = [p for p in params if p.sender == r]
        runs = _inplace_runs(mine, placements or {},
                             bucket_bytes // 4 if min_inplace_bytes is None else min_inplace_bytes)
        taken = {p.mcore_name for run in runs for p in run}
        n = 0
        for run, inplace in [(run, True) for run in runs] + [([p for p in mine if p.mcore_name not in taken], False)]:
            cur: Bucket | None = None
            for p in run:
                if cur is None or (cur.params and cur.nbytes + p.nbytes > bucket_bytes):
                    cur = Bucket(sender=r, group=groups[r], index=n, inplace=inplace)
                    buckets.append(cur)
                    n += 1
                cur.params.append(p)
    return SyncPlan(layout=layout, buckets=buckets, groups=groups)
