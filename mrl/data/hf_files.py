"""Prompts from local JSONL, Parquet and Arrow files (``data=hf``), read through Hugging Face ``datasets``.

    ds = HfFilesDataset.from_model(cfg.data, split="train", model_dir=cfg.model.hf_path, max_new_tokens=32)
    ds.summary()   # 'train.parquet: 950 prompts of 1000 rows (50 held out), 50 skipped (too_long: 48 at rows ...)'
    ds.counts()    # {'data_train_prompts': 950, 'data_train_too_long': 48, 'data_train_skipped': 2}
    ds.sample(i)   # epoch i // len(ds), seeded shuffle per epoch: a resumed run continues the same order

A file goes through these steps; the first it fails raises a ValueError naming the file and the ``data.*`` key:
  1. ``data.path`` (a file or a glob) names existing files, of ``data.format`` or a known extension;
  2. ``datasets.load_dataset(format, data_files=file)`` reads each (an unreadable file is named with the cause);
  3. the prompt column (``prompt_key``: text, or ``messages_key``: a list of ``{role, content}``) and
     ``answer_key`` (text or numbers) exist with those types;
  4. the split: ``eval_path``'s rows, or the rows whose prompt hashes with ``split_seed`` under
     ``eval_fraction`` (duplicates of one prompt on one side; the same rows whatever ``data.seed``);
  5. rows: a missing value, an empty prompt, malformed messages or a bad ``max_new_tokens`` is skipped and
     counted per reason (``data.on_bad_row=error``: raises with ``file:row N``);
  6. the chat template: messages, or every prompt with ``chat_template=true``, rendered by
     ``apply_chat_template(..., add_generation_prompt=True)`` of the model's tokenizer (``Prompt.templated``);
     a row the template itself refuses (roles that do not alternate, ...) is skipped as ``template_error``;
  7. the prompt budget: prompts of more tokens than ``max_prompt_tokens`` (counted with the model's
     ``tokenizer.json`` as the rollout encodes them, ``prompt_ids``) are skipped and counted as ``too_long``;
  8. no prompt left: an error with the counts.
Rows are read into memory once per process (the rollout process, each warm-start rank, the preflight).
Columns other than the prompt, answer and id go to ``Prompt.meta`` as JSON values (a checkpoint stores the
prompts of buffered groups as JSON); ``meta["row"]`` is the 1-based row in its file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Any, Iterator

from mrl.config.schema import HF_TASK, BadRowPolicy, DataConfig, DataFormat
from mrl.data.jsonl import BadRowError, RowStats
from mrl.data.prompt import Prompt, PromptList, budget_error, load_tokenizer
from mrl.data.tasks import in_eval_split

EXTENSIONS = {".jsonl": DataFormat.json, ".json": DataFormat.json, ".parquet": DataFormat.parquet,
              ".arrow": DataFormat.arrow}
TOO_LONG = "too_long"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def resolve_files(pattern: str, key: str = "data.path") -> list[str]:
    """The files ``pattern`` names (a path or a glob), sorted; a ValueError naming ``key`` when none."""
    if os.path.isdir(pattern):
        raise ValueError(f"{key}={pattern}: is a directory; name its files (e.g. {key}={pattern}/*.parquet)")
    if glob.has_magic(pattern):
        files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
        if not files:
            raise ValueError(f"{key}={pattern}: no file matches")
        return files
    if not os.path.isfile(pattern):
        raise ValueError(f"{key}={pattern}: no such file")
    return [pattern]


def file_format(path: str, fmt: DataFormat | None, key: str = "data.path") -> DataFormat:
    if fmt is not None:
        return DataFormat(fmt)
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"{key}={path}: cannot tell the format from the extension {ext or '(none)'!r}; set "
                         f"data.format to one of {[f.value for f in DataFormat]}")
    return EXTENSIONS[ext]


@contextlib.contextmanager
def _quiet_datasets():
    """``datasets`` logs a failed read at ERROR before raising: the error raised here says it once."""
    import datasets

    logger, level = logging.getLogger("datasets"), logging.getLogger("datasets").level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)


def read_file(path: str, fmt: DataFormat, key: str = "data.path"):
    """One file as a ``datasets.Dataset``; a ValueError naming it when ``datasets`` cannot read it."""
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(fmt.value, data_files=os.path.abspath(path), split="train")
        except Exception as e:  # pyarrow's, datasets' and json's errors alike: the file is unreadable as fmt
            cause = e.__cause__ or e
            raise ValueError(f"{key}={path}: cannot be read as {fmt.value}: {type(cause).__name__}: {cause}") from e


def _is_text(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    names = {t.value_type.field(i).name for i in range(t.value_type.num_fields)}
    return {"role", "content"} <= names


def check_columns(ds, path: str, cfg: DataConfig) -> None:
    """The mapped columns exist with usable types (step 3), else a ValueError naming file and key."""
    import pyarrow as pa

    schema = ds.data.schema
    names = schema.names

    def column(key: str, name: str, ok, want: str) -> None:
        if name not in names:
            hint = "; chat rows: set data.messages_key" if key == "data.prompt_key" and "messages" in names else ""
            raise ValueError(f"{key}={name}: no column {name!r} in {path} (columns: {names}){hint}")
        t = schema.field(name).type
        if not ok(t):
            raise ValueError(f"{key}={name}: column {name!r} of {path} holds {t}, not {want}")

    if cfg.messages_key is not None:
        column("data.messages_key", cfg.messages_key, _is_messages, "chat messages (a list of {role, content})")
    else:
        column("data.prompt_key", cfg.prompt_key, _is_text, "text")
    if cfg.answer_key is not None:
        column("data.answer_key", cfg.answer_key,
               lambda t: _is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t), "text or numbers")


def has_chat_template(model_dir: str) -> bool:
    """Whether transformers finds a chat template in ``model_dir``: in tokenizer_config.json or a file of its
    own (read here without importing transformers, so a missing template fails the preflight in seconds)."""
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in _TEMPLATE_FILES):
        return True
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def model_context(model_dir: str) -> int | None:
    """``max_position_embeddings`` of the model's config.json (its text model's), None when absent."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return None
    n = c.get("max_position_embeddings") or (c.get("text_config") or {}).get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


def prompt_budget(cfg: DataConfig, context: int | None, max_new_tokens: int | None) -> tuple[int | None, str]:
    """(max prompt tokens, where it comes from): ``data.max_prompt_tokens``, else the model's context
    (``max_position_embeddings``) less the response budget; (None, why) when neither is known."""
    if cfg.max_prompt_tokens is not None:
        return cfg.max_prompt_tokens, "data.max_prompt_tokens"
    if context is None or max_new_tokens is None:
        return None, "no limit: the model's context is unknown"
    if context - max_new_tokens < 1:
        raise ValueError(f"rollout.max_new_tokens={max_new_tokens}: leaves no room for a prompt in the model's "
                         f"context of {context} tokens (max_position_embeddings)")
    return context - max_new_tokens, f"the model's context {context} - rollout.max_new_tokens {max_new_tokens}"


def _json_value(v: Any) -> Any:
    """A column value as plain JSON (dates, bytes, decimals as text): checkpoints store prompts as JSON."""
    return json.loads(json.dumps(v, default=str))


class HfFilesDataset(PromptList):
    """The train or eval prompts of ``data=hf``, loaded and checked once (module docstring)."""

    def __init__(self, cfg: DataConfig, *, split: str = "train", tokenizer: Any = None,
                 template_dir: str | None = None, max_prompt_tokens: int | None = None, budget_note: str = ""):
        """``tokenizer``: a ``tokenizers.Tokenizer`` that counts prompt tokens (None: no budget, nothing counted);
        ``template_dir``: where ``transformers.AutoTokenizer`` finds the chat template (None: no template)."""
        if cfg.task != HF_TASK:
            raise ValueError(f"data.task={cfg.task}: HfFilesDataset reads data=hf (data.task={HF_TASK})")
        if max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("a prompt budget needs the tokenizer that counts the tokens")
        self.cfg, self.split = cfg, split
        self.max_prompt_tokens, self.budget_note = max_prompt_tokens, budget_note
        key, pattern, files = self._files()
        self.name = os.path.basename(pattern)
        self.held_out = 0
        self.stats = RowStats(pattern, unit="row")
        self._check_template(template_dir, pattern)  # before reading: a missing template fails in seconds
        tables = []
        for f in files:
            ds = read_file(f, file_format(f, cfg.format, key), key)
            check_columns(ds, f, cfg)
            tables.append((f, ds))
        self._template = self._chat_tokenizer(template_dir)
        prompts = self._within_budget([r for f, ds in tables for r in self._rows(f, ds)], tokenizer)
        self.stats.num_rows = len(prompts)
        if split == "eval" and self._holds_out() and not self.stats.num_rows + self.stats.num_skipped:
            raise ValueError(f"data.eval_fraction={cfg.eval_fraction}: holds out none of the rows of {key}={pattern} "
                             "(a hash of each prompt decides); raise it, set data.eval_path, or train.eval_every=0")
        if not prompts:
            raise ValueError(f"{key}={pattern}: no usable prompt in the {split} split: {self.summary()}")
        super().__init__(prompts, seed=cfg.seed, shuffle=cfg.shuffle)

    @classmethod
    def from_model(cls, cfg: DataConfig, *, split: str = "train", model_dir: str,
                   max_new_tokens: int | None = None) -> "HfFilesDataset":
        """Counting and templating with the model's tokenizer in ``model_dir`` (tokenizer.json, and its chat
        template for transformers), the budget from ``data.max_prompt_tokens`` or its context."""
        budget, note = prompt_budget(cfg, model_context(model_dir), max_new_tokens)
        return cls(cfg, split=split, tokenizer=load_tokenizer(model_dir), template_dir=model_dir,
                   max_prompt_tokens=budget, budget_note=note)

    # -- steps 1-5 ------------------------------------------------------------------------------------------
    def _files(self) -> tuple[str, str, list[str]]:
        c = self.cfg
        if self.split == "train" or c.eval_path is None:
            if self.split == "eval" and c.eval_fraction == 0:
                raise ValueError(f"data.eval_path: not set and data.eval_fraction=0, so data.path={c.path} has no "
                                 "held-out split; set one of them (or train.eval_every=0)")
            key, pattern = "data.path", c.path
        else:
            key, pattern = "data.eval_path", c.eval_path
        files = resolve_files(pattern, key)
        for f in files:
            file_format(f, c.format, key)
        return key, pattern, files

    def _holds_out(self) -> bool:
        """Whether rows of ``data.path`` are split by hash (no eval file)."""
        return self.cfg.eval_path is None and self.cfg.eval_fraction > 0

    def _rows(self, path: str, ds) -> Iterator[tuple[dict, int, str]]:
        """(row, 1-based row number, file) of this split's rows of ``ds``, read from ``path``."""
        c = self.cfg
        number = 0
        for batch in ds.iter(batch_size=1024):
            columns = list(batch)
            for values in zip(*(batch[k] for k in columns)):
                number += 1
                row = dict(zip(columns, values))
                if self._holds_out():
                    prompt = row.get(c.messages_key or c.prompt_key)
                    held = in_eval_split(f"hf:{c.split_seed}", json.dumps(prompt, sort_keys=True), c.eval_fraction)
                    if held != (self.split == "eval"):
                        self.held_out += self.split == "train"
                        continue
                yield row, number, path

    def _bad(self, e: _BadRow, path: str, number: int) -> None:
        if self.cfg.on_bad_row is BadRowPolicy.error:
            raise BadRowError(f"{path}:row {number}: {e.reason}: {e} (data.on_bad_row=error)") from None
        self.stats.add(e.reason, number)

    def _prompt(self, row: dict, number: int, path: str) -> Prompt:
        c = self.cfg
        if c.messages_key is not None:
            messages, templated = self._messages(row[c.messages_key]), True
        else:
            text = row[c.prompt_key]
            if text is None:
                raise _BadRow("missing_value", f"{c.prompt_key!r} is null")
            if not text.strip():
                raise _BadRow("empty_prompt", f"{c.prompt_key!r} is empty")
            messages, templated = [{"role": "user", "content": text}], c.chat_template is True
        if c.answer_key is None:
            answer = ""
        elif (value := row[c.answer_key]) is None:
            raise _BadRow("missing_value", f"{c.answer_key!r} is null")
        else:  # a float column of whole numbers (pandas makes one of ints with a gap) reads as ints
            answer = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        row_id = row.get(c.id_key)
        known = (c.prompt_key, c.messages_key, c.answer_key, c.id_key)
        meta = {k: _json_value(v) for k, v in row.items() if k not in known}
        # a column holds every row: null is a row without a budget of its own
        if meta.get("max_new_tokens") is not None and (why := budget_error(meta["max_new_tokens"])) is not None:
            raise _BadRow("wrong_type", why)
        if c.messages_key is not None:
            meta["messages"] = messages
        meta["row"] = number
        text = self._render(messages) if templated else messages[0]["content"]
        row_id = f"{os.path.basename(path)}:{number}" if row_id is None else str(row_id)
        return Prompt(id=row_id, text=text, answer=answer, meta=meta, templated=templated)

    @staticmethod
    def _messages(value: Any) -> list[dict]:
        if value is None:
            raise _BadRow("missing_value", "messages are null")
        if not value:
            raise _BadRow("bad_messages", "no messages")
        out = []
        for m in value:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _BadRow("bad_messages", f"a message without a text role and content: {m!r}")
            out.append({"role": m["role"], "content": m["content"]})
        if out[-1]["role"] == "assistant":
            raise _BadRow("bad_messages", "the last message is the assistant's: the prompt would ask for a reply "
                                          "after its own answer (drop the reference turn, put it in data.answer_key)")
        return out

    # -- step 6: the chat template ----------------------------------------------------------------------------
    def _wants_template(self) -> bool:
        return self.cfg.messages_key is not None or self.cfg.chat_template is True

    def _check_template(self, template_dir: str | None, pattern: str) -> None:
        c = self.cfg
        if not self._wants_template() or (template_dir is not None and has_chat_template(template_dir)):
            return
        why = (f"data.messages_key={c.messages_key}: {pattern} holds chat messages" if c.messages_key is not None
               else "data.chat_template=true")
        raise ValueError(f"{why}, but the model's tokenizer ({template_dir or 'none'}) has no chat template to render "
                         "them (tokenizer_config.json's chat_template or chat_template.jinja); use a chat model's "
                         "tokenizer, or plain-text prompts (data.prompt_key) without data.chat_template=true")

    def _chat_tokenizer(self, template_dir: str | None):
        if not self._wants_template():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(template_dir)

    def _render(self, messages: list[dict]) -> str:
        try:
            return self._template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template's own checks (roles must alternate, ...) refuse this row alone
            raise _BadRow("template_error", f"the chat template refused it: {type(e).__name__}: {e}") from None

    # -- steps 7-8 ------------------------------------------------------------------------------------------
    def _within_budget(self, rows: list[tuple[dict, int, str]], tokenizer: Any) -> list[Prompt]:
        kept: list[Prompt] = []
        for row, number, path in rows:
            try:
                kept.append(self._prompt(row, number, path))
            except _BadRow as e:
                self._bad(e, path, number)
        if tokenizer is None:
            return kept
        lengths = [len(e.ids) for e in tokenizer.encode_batch([p.text for p in kept if not p.templated])]
        lengths_t = [len(e.ids) for e in tokenizer.encode_batch([p.text for p in kept if p.templated],
                                                                add_special_tokens=False)]
        plain, templated = iter(lengths), iter(lengths_t)
        out = []
        for p in kept:
            n = next(templated) if p.templated else next(plain)
            if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
                self.stats.add(TOO_LONG, p.meta["row"])
            else:
                out.append(p)
        return out

    # -- reports --------------------------------------------------------------------------------------------
    @property
    def num_too_long(self) -> int:
        return self.stats.skipped.get(TOO_LONG, 0)

    def summary(self) -> str:
        """One line for the console: prompts kept of the rows read, held out, skipped per reason, the budget."""
        rows = self.stats.num_rows + self.stats.num_skipped
        held = f" ({self.held_out} held out for eval)" if self.held_out else ""
        tail = self.stats.skipped_summary()
        budget = (f"; prompt budget {self.max_prompt_tokens} tokens ({self.budget_note})"
                  if self.max_prompt_tokens is not None else "")
        return (f"{self.stats.path} [{self.split}]: {self.stats.num_rows} prompts of {rows} row{'s' * (rows != 1)}"
                f"{held}{tail}{budget}"
                f"{'; chat template applied' if self._template is not None else ''}")

    def counts(self) -> dict[str, int]:
        """For the run's metrics: prompts kept, left out over the budget, skipped as malformed."""
        s = f"data_{self.split}"
        return {f"{s}_prompts": len(self), f"{s}_too_long": self.num_too_long,
                f"{s}_skipped": self.stats.num_skipped - self.num_too_long}
