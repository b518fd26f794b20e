"""The prompt item every data source yields, and its tokenization for the engines and the trainer."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol


@dataclass(frozen=True)
class Prompt:
    """One prompt and the label its reward needs.

    ``answer`` is whatever the reward fn compares against (the reference answer of a synthetic task,
    the ``data.answer_key`` field of a row, or "" when the reward needs no label). ``meta``
    carries the rest (task inputs, ``answer_pattern`` for format rewards, the row's other fields).
    Picklable, so process-pool reward workers receive it as is.
    """

    id: str
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    templated: bool = False
    """``text`` was rendered by the model's chat template, which writes its own special tokens (BOS, role
    markers): it is encoded without the tokenizer's (``prompt_ids``)."""


class PromptSource(Protocol):
    """What the RL loop draws prompts from: built-in tasks and datasets from files.

    ``sample(index)`` is deterministic in (seed, index) and defined for every index >= 0 (epochs
    wrap), so a resumed run continues from a stored index.
    """

    name: str

    def sample(self, index: int) -> Prompt: ...

    def __len__(self) -> int: ...  # distinct prompts in one epoch


def iter_prompts(source: PromptSource, start: int = 0) -> Iterator[Prompt]:
    """Endless ``source.sample(start), source.sample(start + 1), ...``."""
    index = start
    while True:
        yield source.sample(index)
        index += 1


class PromptList:
    """A dataset held as a list of prompts; ``sample(index)`` walks epochs of ``index // len``, each in an
    order shuffled with (seed, epoch) when ``shuffle`` (string seeds hash with sha512: the same order in
    every process, so a run resumed at index k continues as the uninterrupted run did)."""

    name = ""

    def __init__(self, prompts: list[Prompt], *, seed: int = 0, shuffle: bool = True):
        self._prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self._order_epoch, self._order = -1, list(range(len(prompts)))

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Prompt:
        """The i-th usable row in file order."""
        return self._prompts[i]

    def sample(self, index: int) -> Prompt:
        """The prompt at ``index``: epoch ``index // len``, shuffled with (seed, epoch) when ``shuffle``."""
        if index < 0:
            raise ValueError(f"{self.name}: index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self._prompts))
        if self.shuffle and epoch != self._order_epoch:
            self._order = list(range(len(self._prompts)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._prompts[self._order[pos]]


def load_tokenizer(model_dir: str) -> Any:
    """The model's ``tokenizer.json`` as the rollout encodes prompts with it: without the truncation or padding
    a tokenizer.json may configure, so that a long prompt is counted (and refused) whole, never cut short."""

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def prompt_ids(prompt: Prompt, tokenizer: Any) -> list[int]:
    """The token ids the engines get for ``prompt`` (a ``tokenizers.Tokenizer``): the tokenizer's special
    tokens added, unless a chat template already wrote them into the text (``Prompt.templated``)."""
    return list(tokenizer.encode(prompt.text, add_special_tokens=not prompt.templated).ids)


def encode_prompts(prompts: Iterable[Prompt], tokenizer: Any, *, chat_template: bool = True) -> list[list[int]]:
    """Token ids of each prompt.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer. With ``chat_template``
    and a tokenizer that has one, each prompt becomes a single user message rendered with the
    generation prompt; otherwise the plain text is encoded (the built-in tiny tokenizer has no
    template and adds no special tokens). The response is not part of the ids: a supervised warm
    start encodes ``task.reference(prompt)`` and appends the EOS id itself. Built-in prompts end in
    "=", a pre-tokenizer boundary, so encoding prompt and answer separately equals encoding them joined.
    """
    template = getattr(tokenizer, "chat_template", None) if chat_template else None
    out = []
    for p in prompts:
        if p.templated:  # rendered already (data=hf): its text holds the template's special tokens
            enc = tokenizer.encode(p.text, add_special_tokens=False)
            out.append(list(enc.ids) if hasattr(enc, "ids") else list(enc))
        elif template:
            # The rendered template already holds BOS and role markers: no special tokens on top.
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(list(tokenizer.encode(text, add_special_tokens=False)))
        else:
            enc = tokenizer.encode(p.text)
            out.append(list(enc.ids) if hasattr(enc, "ids") else list(enc))
    return out


def budget_error(budget: Any) -> str | None:
    """Why a row's ``max_new_tokens`` is unusable (None if it is fine): a positive integer, or a non-empty
    list of them (one per sample of the group, repeated to cover it)."""
    def ok(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    if ok(budget) or (isinstance(budget, list) and budget and all(map(ok, budget))):
        return None
    return f"max_new_tokens must be a positive integer or a non-empty list of them, got {budget!r}"
