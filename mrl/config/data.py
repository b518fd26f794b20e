"""Prompts (tasks, files) and their rewards."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from mrl.config.base import fail


class BadRowPolicy(str, enum.Enum):
    """What a dataset does with a malformed row."""

    skip = "skip"    # skip it, counted per reason in the dataset's stats
    error = "error"  # raise a ValueError naming file:line (file:row for data=hf)


class DataFormat(str, enum.Enum):
    """File formats of ``data=hf`` (Hugging Face ``datasets`` builders)."""

    json = "json"        # JSON Lines (or one JSON array)
    parquet = "parquet"
    arrow = "arrow"      # Arrow IPC, stream or file (what ``Dataset.save_to_disk`` writes as data-*.arrow)


HF_TASK = "hf"
"""``data.task`` of the ``data=hf`` preset: prompts from local files read through ``datasets``."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompt source: a built-in synthetic task (``task``), a JSONL file (``path``), or local JSONL / Parquet /
    Arrow files read through Hugging Face ``datasets`` (``task: hf`` with ``path``)."""

    task: str = "reverse"
    """Built-in synthetic task (``mrl.data.tasks.TASKS``: reverse, add_mod, copy_last, lookup, countdown),
    ``jsonl`` (the ``data=jsonl`` preset) or ``hf`` (the ``data=hf`` preset); both require ``path``. Other
    tasks are unused when ``path`` is set (the file is read as JSONL)."""
    path: Optional[str] = None
    """The prompt file: JSONL for ``data=jsonl``; for ``data=hf`` a JSONL, Parquet or Arrow file, or a glob of
    several (``data/train-*.parquet``)."""
    eval_path: Optional[str] = None
    """Held-out file (only with ``path``; built-in tasks hold out ``eval_fraction`` of their inputs, ``data=hf``
    holds out ``eval_fraction`` of ``path``'s rows when this is null)."""
    format: Optional[DataFormat] = None
    """``data=hf``: json, parquet or arrow; null = from the file extension (.jsonl/.json, .parquet, .arrow)."""
    prompt_key: str = "prompt"
    """Field (column) with the prompt text (a non-empty string)."""
    messages_key: Optional[str] = None
    """``data=hf``: column of chat messages (a list of ``{role, content}``) that replaces ``prompt_key``; they
    are rendered by the model's chat template with the generation prompt."""
    answer_key: Optional[str] = "answer"
    """Field with the label the reward needs (string or number); null when the reward needs none."""
    id_key: str = "id"
    """Field used as the prompt id when a row has it; otherwise the id is ``<file name>:<line or row>``."""
    on_bad_row: BadRowPolicy = BadRowPolicy.skip
    """Malformed rows (invalid JSON, missing key, wrong type, empty prompt): skip and count, or raise."""
    chat_template: Optional[bool] = None
    """``data=hf``: render prompts with the model's chat template (``tokenizer.apply_chat_template`` with the
    generation prompt). null: chat messages (``messages_key``) are rendered, plain prompts are not; true: plain
    prompts too, each as one user message. A model without a template is an error where one is needed."""
    max_prompt_tokens: Optional[int] = None
    """``data=hf``: prompts of more tokens (the model's tokenizer, template included) are left out and counted;
    null = the model's context (``max_position_embeddings``) less ``rollout.max_new_tokens``."""
    shuffle: bool = True
    """Visit prompts in a seeded random order, reshuffled each epoch (``seed`` + epoch)."""
    seed: int = 1234
    """Seed of the prompt order (and of nothing else)."""
    eval_fraction: float = 0.2
    """Built-in tasks: fraction of the input space held out for eval (a fixed hash of each input). ``data=hf``
    without ``eval_path``: fraction of the rows held out (a hash of each prompt and ``split_seed``); 0 = none."""
    split_seed: int = 0
    """``data=hf``: seed of the held-out rows, apart from ``seed`` so that runs of every seed hold out the same."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's constructor, e.g. ``+data.task_args.max_len=4`` for reverse; countdown's
    difficulty (``num_numbers``, ``max_number``, ``ops``, ``ordered``, ``num_problems``) is set here."""

    def __post_init__(self) -> None:
        hf = self.task == HF_TASK
        if not self.task:
            fail("data.task", "must name a built-in task")
        if self.path == "":
            fail("data.path", "must be a file path or null")
        if self.task in ("jsonl", HF_TASK) and self.path is None:
            fail("data.path", f"must be set for data.task={self.task} (data={self.task} data.path=FILE)")
        if self.eval_path is not None and self.path is None:
            fail("data.eval_path", "is only used with data.path (built-in tasks hold out data.eval_fraction)")
        if self.path is not None and self.task_args:
            fail("data.task_args", "is set but unused: data.path replaces the built-in task")
        if not self.prompt_key:
            fail("data.prompt_key", "must be a non-empty field name")
        if self.answer_key == "":
            fail("data.answer_key", "must be a non-empty field name or null")
        if not (0.0 <= self.eval_fraction < 1.0 if hf else 0.0 < self.eval_fraction < 1.0):
            fail("data.eval_fraction", f"must be in {'[0, 1)' if hf else '(0, 1)'}, got {self.eval_fraction}")
        for key in ("format", "messages_key", "chat_template", "max_prompt_tokens"):
            if getattr(self, key) is not None and not hf:
                fail(f"data.{key}", f"is read by data=hf only (data.task={self.task})")
        if self.messages_key == "":
            fail("data.messages_key", "must be a non-empty column name or null")
        if self.messages_key is not None and self.chat_template is False:
            fail("data.chat_template", f"=false with data.messages_key={self.messages_key}: chat messages reach the "
                 "model only through its chat template")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            fail("data.max_prompt_tokens", f"must be >= 1 or null, got {self.max_prompt_tokens}")


class RewardExecutor(str, enum.Enum):
    thread = "thread"    # quick or GIL-releasing reward fns
    process = "process"  # CPU-heavy verifiers; each worker re-imports the fn by its dotted path
    auto = "auto"        # thread for mrl's built-ins, process for any other fn (a hung one can be stopped)


# "raise" is a keyword, hence the functional form (OmegaConf matches member names).
RewardOnError = enum.Enum("RewardOnError", [("zero", "zero"), ("drop", "drop"), ("raise", "raise")], type=str)
RewardOnError.__doc__ = "A reward call that raised or timed out: score error_value, drop the sample, or raise."


@dataclass(kw_only=True)
class RewardConfig:
    """Reward function by dotted path, scored asynchronously (``mrl.reward.RewardScorer``)."""

    fn: str = "mrl.reward.builtin.exact_match"
    """Dotted path of ``fn(prompt: Prompt, response_text: str) -> float`` (a def or an async def)."""
    executor: RewardExecutor = RewardExecutor.auto
    """Where calls run: a thread pool, or a process pool for CPU-heavy verifiers; ``auto``: threads for
    ``mrl.reward.builtin`` fns, processes for user fns (a call past ``timeout_s`` can only be stopped there)."""
    num_workers: int = 4
    """Concurrent reward calls (threads or processes)."""
    timeout_s: Optional[float] = 30.0
    """Per-call limit, counted from when a worker takes the call; null for none."""
    on_error: RewardOnError = RewardOnError.zero
    """A call that raised, timed out or returned a non-number: ``zero`` scores ``error_value``,
    ``drop`` drops the sample, ``raise`` stops the run. Always counted."""
    error_value: float = 0.0
    """Reward of a failed call under ``on_error=zero``."""
    max_error_rate: float = 0.5
    """The run stops, naming the fn and its last error, once more than this share of the last 64 calls
    failed (raised, timed out, returned a non-number); 1 = never."""

    def __post_init__(self) -> None:
        if "." not in self.fn.strip("."):
            fail("reward.fn", f"must be a dotted path 'package.module.function', got {self.fn!r}")
        if self.num_workers < 1:
            fail("reward.num_workers", f"must be >= 1, got {self.num_workers}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            fail("reward.timeout_s", f"must be > 0 or null, got {self.timeout_s}")
        if not abs(self.error_value) < float("inf"):  # also catches nan
            fail("reward.error_value", f"must be finite, got {self.error_value}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            fail("reward.max_error_rate", f"must be in [0, 1], got {self.max_error_rate}")
