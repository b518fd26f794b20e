"""Process rewards and the KL reference on engines through ``mrl train`` (real SGLang engines for the policy, the
PRM and the reference, Megatron trainer, Keep Routing on): the run starts both pools, every trained group carries
the PRM's step rewards and the reference's logprobs, the KL is 0 where the policy still is the reference (step 1:
the reference is ``model.hf_path``) and grows as it moves, and no scoring engine outlives the run."""

from __future__ import annotations

import os
import re

import psutil

from mrl.config.load import compose
from mrl.config.schema import TinyPreset
from mrl.models.tiny import make_tiny_model
from tests.e2e.test_train_loop import mrl_train


def _processes(run, name) -> list[int]:
    log = open(os.path.join(run, "engines", f"{name}0.log")).read()
    port = re.search(r"--port (\d+)", log).group(1)
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]


def test_prm_and_engine_reference_run(tmp_path):
    prm = make_tiny_model(str(tmp_path / "prm"), TinyPreset.tiny_lora, seed=11)  # other weights, same tokenizer
    run = tmp_path / "prm_ref"
    _, rows = mrl_train(run, "scoring=prm", f"scoring.prm.hf_path={prm}", "scoring.prm.separator=' '",
                        "algo.token_reward_discount=1", "scoring.reference.enabled=true", "algo.kl_coef=0.1",
                        "train.steps=3", "train.sft_warmup_steps=0", "train.eval_every=0", "train.prompts_per_step=4")
    steps = [r for r in rows if "step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    last = steps[-1]
    for pool in ("prm", "reference"):
        assert last[f"rollout/scoring_{pool}_groups"] >= last["rollout/groups_buffered"] > 0, last
        assert last[f"rollout/scoring_{pool}_groups_failed"] == 0
        assert last[f"rollout/scoring_{pool}_engines_healthy"] == 1
    n = compose([]).rollout.n_samples_per_prompt
    assert last["rollout/scoring_prm_steps"] > n * last["rollout/scoring_prm_groups"]  # responses of several steps
    assert all(r["token_reward"] != 0 for r in steps)
    # the reference engine serves model.hf_path: at step 1 the policy is those weights (engine vs trainer, fp32)
    assert steps[0]["kl_ref"] < 1e-5 and steps[-1]["kl_ref"] > steps[0]["kl_ref"], [r["kl_ref"] for r in steps]
    assert all(r["mismatch/numerics_kl"] <= 1e-6 for r in steps if r["mismatch/numerics_tokens"] > 0)
    assert not _processes(run, "prm") and not _processes(run, "reference")
