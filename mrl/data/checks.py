"""The preflight's data check (``mrl.preflight.check_data``): the run's prompt sources load as the run will load
them, or one line says why.

    data_problem(cfg, tiny_tokenizer=...)   # None, or e.g. "data.path=/x/train.parquet: no such file"

A JSONL file must exist and yield a usable row; a built-in task must take its arguments and the run's reward and
budget; ``data=hf`` files are read whole (files, format, columns, rows, chat template, the prompt budget) with
the model's tokenizer, or the tiny model's when ``model.make_tiny_if_missing`` will write it (the caller builds
that one: ``tiny_tokenizer``, called only then; the model package sits above this one).
"""

from __future__ import annotations

import os

from collections.abc import Callable

from mrl.config.schema import HF_TASK, Config
from mrl.data import HfFilesDataset, build_prompt_source
from mrl.data.hf_files import prompt_budget


def _named(key: str, value, msg: str) -> str:
    """``key=value: msg``, or ``key: msg`` when the message already shows the value."""
    return f"{key}: {msg}" if str(value) in msg else f"{key}={value}: {msg}"


def _splits(cfg: Config) -> tuple[str, ...]:
    return ("train", "eval") if cfg.train.eval_every and cfg.train.eval_heldout else ("train",)


def data_problem(cfg: Config, tiny_tokenizer: Callable[[], tuple[object, int]] | None = None) -> str | None:
    """Why the run's prompts cannot be drawn (one line), or None. ``tiny_tokenizer``: () -> (tokenizer, context length)
    of the tiny model ``model.make_tiny_if_missing`` will write (``data=hf`` before it is written)."""
    d = cfg.data
    if d.task == HF_TASK:
        return hf_data_problem(cfg, tiny_tokenizer)
    for split in _splits(cfg):
        key, path = ("data.path", d.path) if split == "train" else ("data.eval_path", d.eval_path)
        if d.path is not None:
            if path is None:
                return (f"data.eval_path: not set, so the JSONL run (data.path={d.path}) has no held-out prompts "
                        f"for train.eval_every={cfg.train.eval_every}; set data.eval_path or train.eval_every=0")
            if not os.path.isfile(path):
                return _named(key, path, "is a directory, not a JSONL file" if os.path.isdir(path)
                              else "no such file")
        try:
            source = build_prompt_source(d, split=split)
        except (ValueError, TypeError, OSError) as e:
            msg = str(e)
            if path is None:  # a built-in task: its errors name data.task / data.task_args
                return msg if msg.startswith("data.") else f"data.task={d.task}: {msg}"
            return _named(key, path, msg)
    return None if d.path else source.check_run(reward_fn=cfg.reward.fn, max_new_tokens=cfg.rollout.max_new_tokens)


def hf_data_problem(cfg: Config, tiny_tokenizer: Callable[[], tuple[object, int]] | None = None) -> str | None:
    """``data=hf``: each split loaded as the run loads it. A model directory without tokenizer.json is left to the
    model check, which names it: its files, columns and rows are checked here, not its prompts' lengths."""
    d, path, max_new = cfg.data, cfg.model.hf_path, cfg.rollout.max_new_tokens
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        def load(split: str) -> HfFilesDataset:
            return HfFilesDataset.from_model(d, split=split, model_dir=path, max_new_tokens=max_new)
    elif not os.path.isfile(os.path.join(path, "config.json")) and cfg.model.make_tiny_if_missing:
        if tiny_tokenizer is None:
            raise ValueError(f"model.hf_path={path}: the tiny model is not written yet; data_problem needs "
                             "tiny_tokenizer to check data=hf with it")
        tok, context = tiny_tokenizer()

        def load(split: str) -> HfFilesDataset:  # the tiny model has no chat template
            budget, note = prompt_budget(d, context, max_new)
            return HfFilesDataset(d, split=split, tokenizer=tok, max_prompt_tokens=budget, budget_note=note)
    else:
        def load(split: str) -> HfFilesDataset:
            return HfFilesDataset(d, split=split, template_dir=path)
    try:
        for split in _splits(cfg):
            load(split)
    except (ValueError, OSError) as e:
        return str(e)
    return None
