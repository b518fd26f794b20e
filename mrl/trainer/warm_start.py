"""The supervised warm start (``train.sft_warmup_steps``): the policy learns the task's reference answers
before RL, so that its first groups already hold some reward signal."""

from __future__ import annotations

import torch

from mrl.config.schema import Config
from mrl.megatron.policy import Policy
from mrl.trainer.controller import RankDuties


def sft_warmup(cfg: Config, policy: Policy, hf_path: str, duties: RankDuties) -> None:
    """Supervised warm start on (prompt, reference answer + EOS), same Megatron trainer."""
    from mrl.data import build_prompt_source, load_tokenizer, prompt_ids

    t = cfg.train
    tok = load_tokenizer(hf_path)
    eos = policy.bridge.hf_config.eos_token_id
    src = build_prompt_source(cfg.data, model_dir=hf_path, max_new_tokens=cfg.rollout.max_new_tokens)
    g = torch.Generator().manual_seed(cfg.seed)
    for step in range(t.sft_warmup_steps):
        idx = torch.randint(0, len(src), (t.sft_batch,), generator=g).tolist()
        prompts = [src.sample(i) for i in idx]
        if hasattr(src, "warm_start_tokens"):  # a multi-turn task: its whole solving conversation
            tokens, p_lens = map(list, zip(*(src.warm_start_tokens(p, tok, eos) for p in prompts)))
        else:
            p_ids = [prompt_ids(p, tok) for p in prompts]
            tokens = [p + tok.encode(p_.answer, add_special_tokens=False).ids + [eos] for p, p_ in zip(p_ids, prompts)]
            p_lens = [len(p) for p in p_ids]
        nll = policy.sft_step(tokens, p_lens, t.sft_lr)
        duties.warm_start_progress(step, nll)
