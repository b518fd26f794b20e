"""mrl's Megatron model vs transformers from the same checkpoint, per layout (gloo, fp32): logits and
next-token logprobs within 1e-4, every router picks transformers' experts, HF -> Megatron -> HF bit-exact.

The Qwen3-MoE stress checkpoints run every layout the foundation issue names within one launch per world
size (``tests.jobs.parity``: one start-up, each checkpoint and layout built in the same processes);
stress_a has a dense layer, head_dim != H/heads and vocab padding; stress_b tied embeddings, MoE every 2nd
layer and norm_topk_prob off. The production job (``mrl.jobs.check_model``, what ``mrl check-model``
runs) is checked on the tiny checkpoint and on a wrong mapping, which it must report.
"""

import pytest

from tests.conftest import read_json, run_torchrun

TENSORS = {"tiny": 102, "stress_a": 113, "stress_b": 138, "glm4_moe": 97, "deepseek_v3": 91}
# (processes, [(checkpoint, layouts), ...]) per launch: a layout smaller than the world runs data-parallel over
# the rest; the checkpoints of one launch share its start-up
CASES = [
    (2, [("stress_a", ["tp=1", "ep=2", "ep=2,dispatcher=allgather", "tp=2,ep=2,etp=1", "pp=2"]),
         ("stress_b", ["tp=2", "pp=2"])]),
    (4, [("stress_a", ["tp=2,ep=2,etp=2"]), ("stress_b", ["tp=2,pp=2"])]),
    # model families beyond Qwen3 (GLM-4.5, DeepSeek-V3: score-correction bias and group limits), PP2 uneven
    (2, [("glm4_moe", ["tp=1", "tp=2", "ep=2", "tp=2,ep=2,etp=1", "pp=2,pp_first=2"]),
         ("deepseek_v3", ["tp=1", "tp=2", "ep=2", "tp=2,ep=2,etp=1", "pp=2,pp_first=2"])]),
]


def check_layouts(ckpt_dir, tmp_path, nproc: int, cases: list[tuple[str, list[str]]]) -> None:
    out = tmp_path / "report.json"
    args = [a for preset, layouts in cases for a in ("--case", ckpt_dir[preset], *layouts)]
    r = run_torchrun("tests.jobs.parity", ["--out", str(out), *args], nproc, timeout=600)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    reports = read_json(out)
    expected = [(preset, layout) for preset, layouts in cases for layout in layouts]
    assert [(rep["hf"], rep["name"]) for rep in reports] == [(ckpt_dir[p], x) for p, x in expected]
    for rep, (preset, _) in zip(reports, expected):
        assert rep["logits_max_abs_diff"] <= 1e-4, rep
        assert rep["logprobs_max_abs_diff"] <= 1e-4, rep
        assert rep["routed_tokens"] > 0 and rep["routing_mismatches"] == 0, rep
        assert rep["roundtrip_bit_exact"] is True and rep["roundtrip_tensors"] == TENSORS[preset], rep


@pytest.mark.dist
@pytest.mark.parametrize("nproc,cases", CASES,
                         ids=lambda v: "+".join(p for p, _ in v) if isinstance(v, list) else str(v))
def test_megatron_matches_transformers_in_every_layout(ckpt_dir, tmp_path, nproc, cases):
    check_layouts(ckpt_dir, tmp_path, nproc, cases)


@pytest.mark.dist
def test_check_model_job_passes_the_tiny_checkpoint(ckpt_dir, tmp_path):
    out = tmp_path / "report.json"
    r = run_torchrun("mrl.jobs.check_model", ["--hf", ckpt_dir["tiny"], "--out", str(out)], 1)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = read_json(out)
    assert rep["logits_max_abs_diff"] <= 1e-4 and rep["logprobs_max_abs_diff"] <= 1e-4, rep
    assert rep["roundtrip_bit_exact"] is True and rep["roundtrip_tensors"] == TENSORS["tiny"], rep
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
