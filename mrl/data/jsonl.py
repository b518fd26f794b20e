"""JSONL prompt datasets (``data.path``): one JSON object per line; malformed rows skipped and counted.

A row needs ``data.prompt_key`` (a non-empty string) and, unless ``data.answer_key`` is null,
``data.answer_key`` (a string or a number). ``data.id_key`` (string or integer) is optional; the other
fields go to ``Prompt.meta``. Blank lines are not rows. Every other bad row is counted per reason in
``RowStats`` (``data.on_bad_row=skip``, the default) or raises ``BadRowError`` naming file:line
(``data.on_bad_row=error``).

    ds = JsonlDataset("prompts.jsonl", seed=0)
    ds.stats.summary()   # 'prompts.jsonl: 98 rows, 2 skipped (invalid_json: 1 at line 7; ...)'
    ds.sample(i)         # epoch i // len(ds), seeded shuffle per epoch
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from mrl.config.schema import BadRowPolicy
from mrl.data.prompt import Prompt, PromptList, budget_error

logger = logging.getLogger(__name__)

REASONS = ("invalid_json", "missing_key", "wrong_type", "empty_prompt")
_NUM_EXAMPLE_LINES = 5


class BadRowError(ValueError):
    """A malformed row under ``data.on_bad_row=error``; the message starts with ``file:line``."""


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason = reason


@dataclass
class RowStats:
    """Rows kept, and rows skipped per reason with the first few line (or row) numbers of each."""

    path: str
    num_rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_lines: dict[str, list[int]] = field(default_factory=dict)
    unit: str = "line"
    """What the numbers count: JSONL lines, or rows of a table (``data=hf``)."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def add(self, reason: str, line: int) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        lines = self.first_lines.setdefault(reason, [])
        if len(lines) < _NUM_EXAMPLE_LINES:
            lines.append(line)

    def skipped_summary(self) -> str:
        """``, N skipped (reason: n at lines 3, 7; ...)``, or "" when none was."""
        parts = []
        for reason, n in self.skipped.items():
            lines = ", ".join(map(str, self.first_lines[reason])) + (", ..." if n > _NUM_EXAMPLE_LINES else "")
            parts.append(f"{reason}: {n} at {self.unit}{'s' if n > 1 else ''} {lines}")
        return f", {self.num_skipped} skipped ({'; '.join(parts)})" if parts else ""

    def summary(self) -> str:
        return f"{self.path}: {self.num_rows} rows{self.skipped_summary()}"


class JsonlDataset(PromptList):
    """Prompts of a JSONL file, loaded and checked once; ``sample(index)`` walks seeded epochs."""

    def __init__(self, path: str, *, prompt_key: str = "prompt", answer_key: str | None = "answer",
                 id_key: str = "id", on_bad_row: BadRowPolicy | str = BadRowPolicy.skip, seed: int = 0,
                 shuffle: bool = True):
        self.path, self.name = path, os.path.basename(path)
        self.prompt_key, self.answer_key, self.id_key = prompt_key, answer_key, id_key
        on_bad_row = BadRowPolicy(on_bad_row)
        self.stats = RowStats(path)
        prompts: list[Prompt] = []
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    prompts.append(self._parse(raw, line_no))
                except _BadRow as e:
                    if on_bad_row is BadRowPolicy.error:
                        raise BadRowError(f"{path}:{line_no}: {e.reason}: {e} (data.on_bad_row=error)") from None
                    self.stats.add(e.reason, line_no)
        self.stats.num_rows = len(prompts)
        if not prompts:
            raise ValueError(f"no usable rows in {self.stats.summary()}")
        if self.stats.num_skipped:
            logger.warning("skipped malformed rows: %s", self.stats.summary())
        super().__init__(prompts, seed=seed, shuffle=shuffle)

    def _parse(self, raw: bytes, line_no: int) -> Prompt:
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _BadRow("invalid_json", str(e)) from None
        if not isinstance(row, dict):
            raise _BadRow("wrong_type", f"row is a JSON {type(row).__name__}, expected an object")
        text = self._field(row, self.prompt_key, (str,))
        if not text.strip():
            raise _BadRow("empty_prompt", f"{self.prompt_key!r} is empty")
        answer = "" if self.answer_key is None else str(self._field(row, self.answer_key, (str, int, float)))
        row_id = str(self._field(row, self.id_key, (str, int))) if self.id_key in row else f"{self.name}:{line_no}"
        known = (self.prompt_key, self.answer_key, self.id_key)
        meta: dict[str, Any] = {k: v for k, v in row.items() if k not in known}
        if "max_new_tokens" in meta and (why := budget_error(meta["max_new_tokens"])) is not None:
            raise _BadRow("wrong_type", why)
        meta["line"] = line_no
        return Prompt(id=row_id, text=text, answer=answer, meta=meta)

    @staticmethod
    def _field(row: dict, key: str, types: tuple[type, ...]) -> Any:
        if key not in row:
            raise _BadRow("missing_key", f"no field {key!r} (fields: {sorted(row)})")
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, types):  # bool is an int subclass
            names = " or ".join(t.__name__ for t in types)
            raise _BadRow("wrong_type", f"field {key!r} is {type(value).__name__}, expected {names}")
        return value
