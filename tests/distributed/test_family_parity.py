"""Model families beyond Qwen3 (GLM-4.5, DeepSeek-V3) against transformers (gloo, fp32), each in TP1,
TP2+SP, EP2, TP2xEP2 and PP2 (uneven 2+1) within one 2-process launch (``family_parity_job``): logits and
next-token logprobs within 1e-4, every router picks transformers' experts for every token (the
score-correction bias and group limits included), and HF -> Megatron -> HF is bit-exact."""

import pytest

from tests.conftest import read_json, run_torchrun

LAYOUTS = ["tp=1", "tp=2", "ep=2", "tp=2,ep=2,etp=1", "pp=2,pp_first=2"]
# HF tensors of each family's tiny checkpoint (every one must come back from the export)
TENSORS = {"glm4_moe": 97, "deepseek_v3": 91}


@pytest.mark.dist
@pytest.mark.parametrize("family", sorted(TENSORS))
def test_family_matches_transformers_in_every_layout(ckpt_dir, tmp_path, family):
    out = tmp_path / "report.json"
    r = run_torchrun("tests.distributed.family_parity_job",
                     ["--hf", ckpt_dir[family], "--out", str(out), "--layouts", *LAYOUTS], 2, timeout=600)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    reports = read_json(out)
    assert [rep["name"] for rep in reports] == LAYOUTS
    for rep in reports:
        assert rep["logits_max_abs_diff"] <= 1e-4, rep
        assert rep["logprobs_max_abs_diff"] <= 1e-4, rep
        assert rep["routed_tokens"] > 0 and rep["routing_mismatches"] == 0, rep
        assert rep["roundtrip_bit_exact"] is True and rep["roundtrip_tensors"] == TENSORS[family], rep
