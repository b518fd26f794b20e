"""FP8 weight sync pieces (mrl.weight_sync.fp8): the FP8 entries of the planner's params for every trainer
layout equal the tensors of the block-FP8 checkpoint the engine starts from, and a bucket quantized into its
flat buffer is byte for byte what SGLang's flattened_bucket format decodes, batched over experts."""

from __future__ import annotations

import pytest
import torch
import transformers

from mrl.config.schema import TinyPreset
from mrl.models import BRIDGES
from mrl.models.tiny import FAMILIES, PRESETS
from mrl.quant.fp8 import quantize_block_fp8
from mrl.quant.fp8_targets import is_fp8_target
from mrl.weight_sync import fp8 as sync_fp8
from mrl.weight_sync import planner
from mrl.weight_sync.planner import HFTensor, TrainerLayout, plan_params

LAYOUTS = {"tp1": TrainerLayout(1, 1, 1, 1, 1), "tp2": TrainerLayout(2, 1, 1, 2, 2),
           "ep2": TrainerLayout(1, 1, 2, 1, 2), "tp2xep2": TrainerLayout(2, 1, 2, 1, 4),
           "pp2": TrainerLayout(1, 2, 1, 1, 2, stage_layers=(2, 1)), "tp2xpp2": TrainerLayout(2, 2, 1, 2, 4,
                                                                                           stage_layers=(2, 1)),
           "tp2xep2xetp2_dp2": TrainerLayout(2, 1, 2, 2, 8)}


def _bridge(preset):
    config_cls, arch = FAMILIES[preset]
    cfg = getattr(transformers, config_cls)(architectures=[arch], **PRESETS[preset])
    return BRIDGES[arch](cfg)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("preset", [TinyPreset.tiny, TinyPreset.deepseek_v3])
def test_fp8_entries_are_the_fp8_checkpoints_tensors_for_every_layout(layout, preset):
    b = _bridge(preset)
    pv = b.padded_vocab(128, LAYOUTS[layout].tp)
    params = plan_params(b.param_maps(pv), LAYOUTS[layout], num_layers=b.num_layers, num_experts=b.num_experts,
                         dtype="bfloat16", tied=b.tied_embeddings)
    fp8 = [planner.fp8_param(p) for p in params]
    names = [t.name for p in fp8 for t in p.tensors]
    assert len(names) == len(set(names))
    shapes = b.hf_tensor_shapes(b.vocab_size)
    quantized = {n for n in shapes if is_fp8_target(n)}
    assert set(names) == set(shapes) | {n + "_scale_inv" for n in quantized}  # what mrl export-fp8 writes
    for p, q in zip(params, fp8):
        assert (q.sender, q.stage, q.expert) == (p.sender, p.stage, p.expert)
        for t in q.tensors:
            if t.name in quantized:
                assert t.dtype == "float8_e4m3fn"
                s = next(x for x in q.tensors if x.name == t.name + "_scale_inv")  # same param, same bucket
                assert s.dtype == "float32" and s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            elif not t.name.endswith("_scale_inv"):
                assert t.dtype == "bfloat16"


def test_planner_buckets_with_fp8_entries():
    """plan_sync(fp8=True) keeps each weight with its scales (next to each other, in the param's order) and
    fills buckets by FP8 bytes; every other tensor is where the bf16 plan has it."""
    b = _bridge(TinyPreset.tiny)
    kw = dict(num_layers=b.num_layers, num_experts=b.num_experts, bucket_bytes=64 * 1024, dtype="bfloat16")
    maps = b.param_maps(b.padded_vocab(128, 2))
    plan = planner.plan_sync(maps, LAYOUTS["tp2xep2"], fp8=True, **kw)
    plain = planner.plan_sync(maps, LAYOUTS["tp2xep2"], **kw)
    bf16_params = {p.mcore_name: p for x in plain.buckets for p in x.params}
    for bucket in plan.buckets:
        names = [t.name for t in bucket.tensors]
        for i, n in enumerate(names):
            if is_fp8_target(n):
                assert names[i + 1] == n + "_scale_inv"
        assert bucket.nbytes == sync_fp8.byte_offsets(bucket.tensors)[-1] <= 64 * 1024
        # the sender's staging layout is the bf16 plan's tensors of the same params
        assert sync_fp8.staged_bucket(bucket, "bfloat16").tensors == [
            t for p in bucket.params for t in bf16_params[p.mcore_name].tensors]
    assert [p.mcore_name for x in plan.buckets for p in x.params] == \
        [p.mcore_name for x in plain.buckets for p in x.params]  # same order (bigger buckets may merge)
    bf16 = [t for x in plain.buckets for t in x.tensors]
    q = [t for t in bf16 if is_fp8_target(t.name)]
    # one byte instead of two per quantized element, plus 4 bytes per block (one block each in the tiny model)
    assert plan.nbytes == sum(t.nbytes for t in bf16) - sum(t.nbytes // 2 for t in q) + 4 * len(q)
    assert planner.DTYPE_BYTES["float8_e4m3fn"] == 1


def test_high_precision_inverts_fp8_param():
    b = _bridge(TinyPreset.deepseek_v3)
    for p in plan_params(b.param_maps(b.padded_vocab(128, 1)), LAYOUTS["tp1"], num_layers=b.num_layers,
                         num_experts=b.num_experts, dtype="bfloat16"):
        assert sync_fp8.high_precision(planner.fp8_param(p), "bfloat16") == p


def _bucket(num_experts=4, inter=96, hidden=160, seed=0):
    """A bucket as the planner orders one: norms, attention, then whole experts (gate, up, down each)."""
    g = torch.Generator().manual_seed(seed)
    h = "model.layers.0."
    spec = [(h + "input_layernorm.weight", (hidden,)), (h + "self_attn.q_proj.weight", (256, hidden)),
            (h + "self_attn.k_proj.weight", (128, hidden)), (h + "mlp.gate.weight", (num_experts, hidden))]
    for e in range(num_experts):
        spec += [(f"{h}mlp.experts.{e}.gate_proj.weight", (inter, hidden)),
                 (f"{h}mlp.experts.{e}.up_proj.weight", (inter, hidden)),
                 (f"{h}mlp.experts.{e}.down_proj.weight", (hidden, inter))]
    tensors = [HFTensor(n, s, "bfloat16") for n, s in spec]
    values = [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for _, s in spec]
    return tensors, values


def _reference_flat(tensors, values):
    """SGLang's own flattening of the per-tensor quantized bucket."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = []
    for t, v in zip(tensors, values):
        if is_fp8_target(t.name):
            q, s = quantize_block_fp8(v)
            named += [(t.name, q), (t.name + "_scale_inv", s)]
        else:
            named.append((t.name, v))
    return FlattenedTensorBucket(named_tensors=named)


def test_bucket_bytes_equal_sglangs_flattened_bucket():
    tensors, values = _bucket()
    entries, flat = sync_fp8.quantize_bucket(tensors, values)
    ref = _reference_flat(tensors, values)
    assert torch.equal(flat, ref.get_flattened_tensor())
    meta = ref.get_metadata()
    assert [e.name for e in entries] == [m.name for m in meta]
    assert [tuple(e.shape) for e in entries] == [tuple(m.shape) for m in meta]
    assert [e.dtype for e in entries] == [str(m.dtype).removeprefix("torch.") for m in meta]
    decoded = dict(ref.__class__(flattened_tensor=flat, metadata=meta).reconstruct_tensors())
    assert decoded["model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"].shape == (1, 2)


def test_experts_are_quantized_in_one_call_per_kind(monkeypatch):
    import mrl.weight_sync.fp8 as mod

    calls = []
    real = mod.quantize_block_fp8
    monkeypatch.setattr(mod, "quantize_block_fp8", lambda w, *a, **k: calls.append(tuple(w.shape)) or real(w, *a,
                                                                                                          **k))
    tensors, values = _bucket(num_experts=5)
    sync_fp8.quantize_bucket(tensors, values)
    assert sorted(calls) == sorted([(1, 256, 160), (1, 128, 160), (5, 96, 160), (5, 96, 160), (5, 160, 96)])


def test_into_a_given_buffer_and_misaligned_runs_split():
    tensors, values = _bucket(num_experts=3, inter=33, hidden=100)  # 33 x 100 bytes: strides still x4
    _, flat = sync_fp8.quantize_bucket(tensors, values)
    buf = torch.full((flat.numel() + 64,), 7, dtype=torch.uint8)
    _, out = sync_fp8.quantize_bucket(tensors, values, flat=buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, flat)
    assert torch.equal(flat, _reference_flat(tensors, values).get_flattened_tensor())
    with pytest.raises(ValueError, match="1-D uint8 buffer of at least"):
        sync_fp8.quantize_bucket(tensors, values, flat=torch.empty(10, dtype=torch.uint8))


def test_runs_follow_the_byte_stride():
    assert sync_fp8._strided_runs([0, 1, 2, 3], [0, 100, 200, 300]) == [[0, 1, 2, 3]]
    assert sync_fp8._strided_runs([0, 1, 2, 3], [0, 100, 200, 404]) == [[0, 1, 2], [3]]
    assert sync_fp8._strided_runs([0, 1, 2], [0, 102, 204]) == [[0], [1], [2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the triton kernel writing strided views of "
                    "the send buffer runs on GPUs only (tests/gpu/fp8_quant.sh runs this on a GPU machine)")
def test_triton_fills_the_bucket_like_the_cpu_path():
    tensors, values = _bucket(num_experts=8, inter=256, hidden=384)
    _, cpu = sync_fp8.quantize_bucket(tensors, values)
    _, gpu = sync_fp8.quantize_bucket(tensors, [v.cuda() for v in values], backend="triton")
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_one_rank_copy_plan_sends_the_quantized_bucket(ckpt_dir, param_dtype):
    """TP1, no process group: every FP8 bucket the copy plan fills is, byte for byte, the per-tensor path
    (split_full, cast to bf16) quantized by ``quantize_bucket``; FP8 buckets never go in place."""
    from mrl.megatron.weights import LocalParam
    from mrl.models import get_bridge
    from mrl.models.bridge import split_full
    from mrl.weight_sync.copy_plan import build_steps, placement

    bridge = get_bridge(ckpt_dir["tiny_gpu"])
    vp = bridge.padded_vocab(128, 1)
    maps = {pm.mcore_name: pm for pm in bridge.param_maps(vp)}
    g = torch.Generator().manual_seed(0)
    local = {n: LocalParam(n, torch.nn.Parameter((torch.randn(pm.shape, generator=g) * 0.02).to(param_dtype),
                                                 requires_grad=False), n, ".experts." in n, None, None)
             for n, pm in maps.items()}
    plan = planner.plan_sync(bridge.param_maps(vp), LAYOUTS["tp1"], num_layers=bridge.num_layers,
                             num_experts=bridge.num_experts, bucket_bytes=256 << 10, dtype="bfloat16", fp8=True)
    steps, _ = build_steps(plan.buckets, local, maps, rank=0, dp_rank=0, edp_rank=0, dtype=torch.bfloat16,
                           device=torch.device("cpu"))
    fp8_steps = [s for s in steps if s.quantize is not None]
    assert len(fp8_steps) >= 3 and len(steps) > len(fp8_steps)  # the embedding and head: bf16 buckets
    for step in steps:
        step.flat.fill_(0xAB)  # poison: every byte must be written
        step.fill()
        bf16 = sync_fp8.staged_bucket(step.bucket, "bfloat16")
        values = [split_full(maps[p.mcore_name], local[p.mcore_name].param.detach())[t.name].to(torch.bfloat16)
                  for p in bf16.params for t in p.tensors]
        entries, want = sync_fp8.quantize_bucket(bf16.tensors, values)
        assert entries == step.bucket.tensors
        assert torch.equal(step.flat, want), step.bucket.index
    for p in (p for b in plan.buckets for p in b.params):
        lp = local[p.mcore_name]
        fp8 = any(t.dtype == "float8_e4m3fn" for t in p.tensors)
        if param_dtype == torch.bfloat16 and not fp8 and "layernorm" in p.mcore_name:
            assert placement(lp, maps[p.mcore_name], p, torch.bfloat16) is not None
        if fp8:
            assert placement(lp, maps[p.mcore_name], p, torch.bfloat16) is None


def test_disk_exports_are_the_fp8_checkpoint(ckpt_dir, tmp_path):
    """The disk transport (and repair path) to FP8 engines: ``quantize_checkpoint`` of the full tensors in the
    sync dtype is what ``mrl export-fp8`` writes for them, tensor for tensor."""
    from safetensors.torch import load_file, save_file

    from mrl.quant.export import export_fp8

    tensors = {k: v.to(torch.bfloat16) for k, v in
               load_file(f"{ckpt_dir['tiny_gpu']}/model.safetensors").items()}
    (tmp_path / "bf16").mkdir()
    save_file(tensors, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text(open(f"{ckpt_dir['tiny_gpu']}/config.json").read())
    export_fp8(str(tmp_path / "bf16"), str(tmp_path / "fp8"), log=lambda *_: None)
    want = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    got = sync_fp8.quantize_checkpoint({k: v.float() for k, v in tensors.items()}, torch.bfloat16)
    assert set(got) == set(want)
    for k, v in want.items():  # the rest keeps the trainer's dtype, as the disk transport writes it
        g = got[k] if got[k].dtype in (torch.float8_e4m3fn, torch.float32) and v.dtype != torch.bfloat16 \
            else got[k].to(torch.bfloat16)
        assert g.dtype == v.dtype and torch.equal(g.view(torch.uint8), v.view(torch.uint8)), k


def test_tensor_transport_sends_the_fp8_checkpoint(ckpt_dir, tmp_path):
    """The CUDA IPC transport to FP8 engines (colocated runs): a gathered bucket's tensors are, name for name
    and bit for bit, what ``mrl export-fp8`` writes for the same weights (vocab padding dropped)."""
    from safetensors.torch import load_file, save_file

    from mrl.models import get_bridge
    from mrl.models.bridge import full_from_parts
    from mrl.quant.export import export_fp8
    from mrl.weight_sync.tensor import bucket_tensors

    hf = {k: v.to(torch.bfloat16) for k, v in load_file(f"{ckpt_dir['tiny_gpu']}/model.safetensors").items()}
    (tmp_path / "bf16").mkdir()
    save_file(hf, str(tmp_path / "bf16" / "model.safetensors"))
    (tmp_path / "bf16" / "config.json").write_text(open(f"{ckpt_dir['tiny_gpu']}/config.json").read())
    export_fp8(str(tmp_path / "bf16"), str(tmp_path / "fp8"), log=lambda *_: None)
    want = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    bridge = get_bridge(ckpt_dir["tiny_gpu"])
    gathered = [(None, pm, full_from_parts(pm, hf)) for pm in bridge.param_maps(bridge.padded_vocab(128, 1))]
    got = dict(bucket_tensors(gathered, fp8_from=torch.bfloat16))
    assert set(got) == set(want) and any(v.dtype == torch.float8_e4m3fn for v in got.values())
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    plain = dict(bucket_tensors(gathered))
    assert set(plain) == set(hf) and all(torch.equal(plain[k], hf[k]) for k in hf)
