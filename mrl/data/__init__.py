"""Prompt sources for the RL loop: built-in synthetic tasks (``data.task``), JSONL files (``data=jsonl``) or local
JSONL / Parquet / Arrow files read through Hugging Face ``datasets`` (``data=hf``).

    train = build_prompt_source(cfg.data, model_dir=hf_path, max_new_tokens=cfg.rollout.max_new_tokens)
    held_out = build_prompt_source(cfg.data, split="eval", model_dir=hf_path, ...)
    ids = prompt_ids(train.sample(0), load_tokenizer(hf_path))   # what the engines get
"""

from __future__ import annotations

from mrl.config.schema import HF_TASK, DataConfig
from mrl.data.hf_files import HfFilesDataset
from mrl.data.jsonl import BadRowError, JsonlDataset, RowStats
from mrl.data.prompt import (Prompt, PromptList, PromptSource, encode_prompts, iter_prompts, load_tokenizer,
                             prompt_ids)
from mrl.data.tasks import SPLITS, TASKS, SyntheticTask, build_task

__all__ = ["BadRowError", "HfFilesDataset", "JsonlDataset", "Prompt", "PromptList", "PromptSource", "RowStats",
           "SyntheticTask", "TASKS", "build_prompt_source", "build_task", "encode_prompts", "iter_prompts",
           "load_tokenizer", "prompt_ids"]


def build_prompt_source(cfg: DataConfig, *, split: str = "train", model_dir: str | None = None,
                        max_new_tokens: int | None = None) -> PromptSource:
    """The train or eval prompts of ``cfg``: ``data=hf`` files, a JSONL ``data.path``/``data.eval_path``, else
    ``data.task``. ``data=hf`` needs ``model_dir`` (the model's tokenizer counts and templates its prompts) and
    takes its prompt budget from ``max_new_tokens`` unless ``data.max_prompt_tokens`` is set."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if cfg.task == HF_TASK:
        if model_dir is None:
            raise ValueError("data=hf: the model's directory is needed to count and template prompts")
        return HfFilesDataset.from_model(cfg, split=split, model_dir=model_dir, max_new_tokens=max_new_tokens)
    if cfg.path is None:
        return build_task(cfg.task, split=split, seed=cfg.seed, eval_fraction=cfg.eval_fraction,
                          shuffle=cfg.shuffle, task_args=cfg.task_args)
    if split == "eval" and cfg.eval_path is None:
        raise ValueError("data.eval_path: not set, so a JSONL run (data.path) has no eval split")
    return JsonlDataset(cfg.path if split == "train" else cfg.eval_path, prompt_key=cfg.prompt_key,
                        answer_key=cfg.answer_key, id_key=cfg.id_key, on_bad_row=cfg.on_bad_row,
                        seed=cfg.seed, shuffle=cfg.shuffle)
