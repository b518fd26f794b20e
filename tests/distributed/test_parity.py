"""mrl's Megatron model vs transformers' Qwen3MoeForCausalLM from the same checkpoint, per layout
(gloo, fp32): logits and next-token logprobs within 1e-4, and HF -> Megatron -> HF bit-exact.

Each case runs ``mrl.jobs.check_model`` under torchrun (the production loader/exporter).
"""

import pytest

from tests.conftest import read_json, run_torchrun

# (checkpoint, nproc, layout args): each layout the foundation issue names, on the checkpoints that
# can tell a mapping mistake apart (stress_a: dense layer, head_dim != H/heads, vocab padding;
# stress_b: tied embeddings, MoE every 2nd layer, norm_topk_prob off). The tiny checkpoint runs
# unsharded only: its sharded layouts add nothing the stress checkpoints do not check.
CASES = [
    ("tiny", 1, []),
    ("stress_a", 1, []),
    ("stress_b", 2, ["--tp", "2"]),
    ("stress_a", 2, ["--ep", "2"]),
    ("stress_a", 2, ["--ep", "2", "--dispatcher", "allgather"]),
    ("stress_a", 2, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    ("stress_a", 2, ["--pp", "2"]),
    ("stress_b", 2, ["--pp", "2"]),
    ("stress_a", 4, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    ("stress_b", 4, ["--tp", "2", "--pp", "2"]),
]


@pytest.mark.dist
@pytest.mark.parametrize("preset,nproc,args", CASES,
                         ids=lambda v: "_".join(map(str, v)) if isinstance(v, list) else str(v))
def test_megatron_matches_transformers_and_exports_bit_exact(ckpt_dir, tmp_path, preset, nproc, args):
    out = tmp_path / "report.json"
    r = run_torchrun("mrl.jobs.check_model", ["--hf", ckpt_dir[preset], "--out", str(out), *args], nproc)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = read_json(out)
    assert rep["logits_max_abs_diff"] <= 1e-4, rep
    assert rep["logprobs_max_abs_diff"] <= 1e-4, rep
    assert rep["roundtrip_bit_exact"] is True, rep
    assert rep["roundtrip_tensors"] == {"tiny": 102, "stress_a": 113, "stress_b": 138}[preset]
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.dist
def test_check_detects_a_wrong_mapping(ckpt_dir, tmp_path):
    """The comparison is live: megatron loads a checkpoint with one expert scaled, transformers the
    original; the job must report the difference and exit non-zero."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "scaled"
    shutil.copytree(ckpt_dir["stress_a"], d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    sd["model.layers.0.mlp.experts.0.down_proj.weight"] = sd["model.layers.0.mlp.experts.0.down_proj.weight"] * 3
    save_file(sd, os.path.join(d, "model.safetensors"))
    out = tmp_path / "report.json"
    r = run_torchrun("mrl.jobs.check_model", ["--hf", str(d), "--reference-hf", ckpt_dir["stress_a"],
                                              "--out", str(out), "--ep", "2"], 2)
    rep = read_json(out)
    assert rep["logits_max_abs_diff"] > 1e-3 and rep["pass"] is False
    assert r.returncode == 1
