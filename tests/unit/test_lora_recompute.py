"""LoRA with activation recompute (``train.recompute``), the full-depth job's trainer: the adapters (attention and
every expert) get the same grads and the same update as without recompute, and the base stays frozen. Megatron's
recompute is a reentrant autograd function over each layer's input; with the base frozen that input would not
require grad, and the adapters would silently train on zeros (``mrl.megatron.lora._output_requires_grad``).
The policy is built from synthetic weights (``Policy(weights=...)``: config.json only, no checkpoint)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import one_rank_gloo_world


def _step(hf: str, recompute: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from mrl.config.load import compose
    from mrl.megatron.batch import RLBatch
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.policy import Policy
    from mrl.models.synthetic import SyntheticWeights

    cfg = compose(["model=tiny", f"model.hf_path={hf}", "model.make_tiny_if_missing=false", "model.lora.rank=4",
                   "model.lora.alpha=8", "model.lora.targets=[attention,experts]", "engine.cpu_mode=false",
                   "engine.dtype=bfloat16", "train.replay=false", "train.micro_batch_size=2", "algo.lr=1e-2",
                   f"train.recompute={recompute}"])
    layout = init_parallel(cfg.parallel, seed=cfg.seed)
    policy = Policy(cfg, layout, hf, weights=SyntheticWeights(hf, seed=3))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, 512, size=n).tolist() for n in (12, 9, 15, 10)]
    batch = RLBatch(tokens=tokens, prompt_lens=[4, 3, 5, 4], behav_logp=[[-6.0] * (len(t) - p) for t, p in
                                                                           zip(tokens, [4, 3, 5, 4])],
                    advantages=[1.0, -1.0, 0.5, -0.5], routes=None)
    base = {n: p.detach().clone() for n, p in policy.module.named_parameters() if not getattr(p, "lora_adapter", 0)}
    metrics = policy.rl_step(batch, float(sum(len(t) - p for t, p in zip(tokens, [4, 3, 5, 4]))))
    params = dict(policy.module.named_parameters())
    adapters = {n: p.detach().clone() for n, p in params.items() if getattr(p, "lora_adapter", 0)}
    assert all(torch.equal(params[n], t) for n, t in base.items())  # frozen
    return metrics["grad_norm"], adapters, base


@pytest.fixture()
def config_only(ckpt_dir, tmp_path):
    d = tmp_path / "tiny_config"
    d.mkdir()
    shutil.copy(os.path.join(ckpt_dir["tiny"], "config.json"), d)
    return str(d)


def test_adapters_train_the_same_with_full_recompute(config_only):
    with one_rank_gloo_world():
        norm_off, off, _ = _step(config_only, "off")
    with one_rank_gloo_world():
        norm_full, full, _ = _step(config_only, "full")
    assert norm_off > 0 and norm_full == pytest.approx(norm_off, rel=1e-5)
    assert off.keys() == full.keys() and any("experts" in n for n in off)
    for n in off:
        torch.testing.assert_close(full[n], off[n], rtol=1e-5, atol=1e-6)
