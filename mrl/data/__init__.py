"""Prompt sources for the RL loop: built-in synthetic tasks (``data.task``) or JSONL files (``data.path``).

    train = build_prompt_source(cfg.data)                 # PromptSource: sample(index) -> Prompt
    held_out = build_prompt_source(cfg.data, split="eval")
    ids = encode_prompts([train.sample(i) for i in range(8)], tokenizer,
                         chat_template=cfg.data.apply_chat_template)
"""

from __future__ import annotations

from mrl.config.schema import DataConfig
from mrl.data.jsonl import BadRowError, JsonlDataset, RowStats
from mrl.data.prompt import Prompt, PromptSource, encode_prompts, iter_prompts
from mrl.data.tasks import SPLITS, TASKS, SyntheticTask, build_task

__all__ = ["BadRowError", "JsonlDataset", "Prompt", "PromptSource", "RowStats", "SyntheticTask", "TASKS",
           "build_prompt_source", "build_task", "encode_prompts", "iter_prompts"]


def build_prompt_source(cfg: DataConfig, *, split: str = "train") -> PromptSource:
    """The train or eval prompts of ``cfg``: ``data.path``/``data.eval_path`` if set, else ``data.task``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if cfg.path is None:
        return build_task(cfg.task, split=split, seed=cfg.seed, eval_fraction=cfg.eval_fraction,
                          shuffle=cfg.shuffle, task_args=cfg.task_args)
    if split == "eval" and cfg.eval_path is None:
        raise ValueError("data.eval_path: not set, so a JSONL run (data.path) has no eval split")
    return JsonlDataset(cfg.path if split == "train" else cfg.eval_path, prompt_key=cfg.prompt_key,
                        answer_key=cfg.answer_key, id_key=cfg.id_key, on_bad_row=cfg.on_bad_row,
                        seed=cfg.seed, shuffle=cfg.shuffle)
