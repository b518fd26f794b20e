"""Built-in synthetic verifiable tasks (``data.task=reverse|add_mod|copy_last|lookup|countdown``): seeded, split.

Why these tasks: the default run trains a 3-layer, hidden-64 MoE with a 512-token byte-level BPE on
two CPU cores in minutes, so a task must be
  - small: the whole input space is tens to a few hundred items, each seen many times in a short run;
  - verifiable: the answer is a pure function of the prompt, so ``exact_match`` is a noiseless 0/1
    reward and a rising reward curve means the policy improved, not that a judge drifted;
  - length-controlled: answers of 1-3 tokens ending the prompt's "=", so a short supervised warm start
    learns the format and RL works on correctness within a ``max_new_tokens`` of a few tokens.
Difficulty, easiest first: copy_last (point at one prompt token), add_mod (a 100-entry table),
reverse (a position-dependent copy). countdown is the reasoning task: a worked solution of a few lines
(``rollout.max_new_tokens`` of a few dozen), taught by the warm start, its difficulty set by its arguments.

Splits: each input goes to ``train`` or ``eval`` by a fixed hash of (task name, input), so the splits
are disjoint by content, not merely by index, and identical in every process and for every seed.
``sample(index)`` walks the split in a seeded permutation per epoch (every item once per epoch).

    task = build_task("reverse", split="train", seed=0)
    p = task.sample(0)      # Prompt(id="reverse/train/0", text="rev cab=", answer="bac", meta={...})
    task.reference(p)       # "bac": the response a supervised warm start trains on (caller adds EOS)
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import inspect
import itertools
import random
from typing import Any

from mrl.data.countdown import OPS, Chain, random_chain, worked_solution
from mrl.data.prompt import Prompt

SPLITS = ("train", "eval")
_COMMON_ARGS = ("split", "seed", "eval_fraction", "shuffle")  # set from data.*, not data.task_args


def in_eval_split(task_name: str, item: str, eval_fraction: float) -> bool:
    """Fixed assignment of an input to the eval split (sha256, so no PYTHONHASHSEED dependence)."""
    h = int.from_bytes(hashlib.sha256(f"{task_name}:{item}".encode()).digest()[:8], "big")
    return h / 2**64 < eval_fraction


def _strings(alphabet: str, min_len: int, max_len: int) -> list[str]:
    return ["".join(t) for n in range(min_len, max_len + 1) for t in itertools.product(alphabet, repeat=n)]


class SyntheticTask(abc.ABC):
    """A finite input space (strings), a prompt renderer, a solver, a hash split and a seeded order.

    Subclasses set ``name`` and ``answer_pattern`` and implement ``inputs``, ``render``, ``solve``.
    """

    name = ""
    answer_pattern = ""
    """Regex a well-formed answer fully matches (``meta["answer_pattern"]``, for format rewards)."""
    reward_fn = "mrl.reward.builtin.exact_match"
    """A reward that scores this task's reference 1.0 (``reward.fn``)."""

    def __init__(self, *, split: str = "train", seed: int = 0, eval_fraction: float = 0.2, shuffle: bool = True):
        if split not in SPLITS:
            raise ValueError(f"{self.name}: split must be one of {SPLITS}, got {split!r}")
        self.split, self.seed, self.shuffle = split, seed, shuffle
        self._items = [x for x in self.inputs() if in_eval_split(self.name, x, eval_fraction) == (split == "eval")]
        if not self._items:
            raise ValueError(f"{self.name}: the {split} split is empty (eval_fraction={eval_fraction}, "
                             f"{len(self.inputs())} inputs)")
        self._order_epoch, self._order = -1, list(range(len(self._items)))

    @abc.abstractmethod
    def inputs(self) -> list[str]:
        """Every input of the task (both splits), in a fixed order."""

    @abc.abstractmethod
    def render(self, item: str) -> str:
        """The prompt text for an input."""

    @abc.abstractmethod
    def solve(self, item: str) -> str:
        """The correct answer for an input."""

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[str]:
        """The inputs of this split (for disjointness checks and full evals)."""
        return list(self._items)

    def sample(self, index: int) -> Prompt:
        """The prompt at ``index``; deterministic in (seed, index), any index >= 0."""
        if index < 0:
            raise ValueError(f"{self.name}: index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self._items))
        item = self._items[self._epoch_order(epoch)[pos]]
        return Prompt(id=f"{self.name}/{self.split}/{index}", text=self.render(item), answer=self.solve(item),
                      meta={"task": self.name, "input": item, "answer_pattern": self.answer_pattern})

    def reference(self, prompt: Prompt) -> str:
        """The correct response text for a prompt of this task (EOS not included)."""
        return self.solve(prompt.meta["input"])

    def check_run(self, *, reward_fn: str, max_new_tokens: int) -> str | None:
        """Why a run's reward or token budget cannot train this task (None when they can); the preflight asks."""
        return None

    def _epoch_order(self, epoch: int) -> list[int]:
        if self.shuffle and epoch != self._order_epoch:
            self._order = list(range(len(self._items)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)  # str seeds hash with sha512: stable
            self._order_epoch = epoch
        return self._order


class _LetterTask(SyntheticTask):
    """Inputs: every string of ``min_len``..``max_len`` letters over a small alphabet."""

    def __init__(self, *, alphabet: str, min_len: int = 2, max_len: int = 3, **kw: Any):
        if not alphabet.isalpha() or not alphabet.islower() or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"{self.name}: alphabet must be distinct lowercase letters, got {alphabet!r}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"{self.name}: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len
        super().__init__(**kw)

    def inputs(self) -> list[str]:
        return _strings(self.alphabet, self.min_len, self.max_len)


class ReverseTask(_LetterTask):
    """``rev cab=`` -> ``bac``: reverse a short string over a small alphabet (default 80 inputs)."""

    name = "reverse"

    def __init__(self, *, alphabet: str = "abcd", min_len: int = 2, max_len: int = 3, **kw: Any):
        self.answer_pattern = f"[{alphabet}]{{{min_len},{max_len}}}"
        super().__init__(alphabet=alphabet, min_len=min_len, max_len=max_len, **kw)

    def render(self, item: str) -> str:
        return f"rev {item}="

    def solve(self, item: str) -> str:
        return item[::-1]


class AddModTask(SyntheticTask):
    """``3+9=`` -> ``2``: the sum of two digits modulo 10 (100 inputs, one-token answers)."""

    name = "add_mod"
    answer_pattern = "[0-9]"

    def inputs(self) -> list[str]:
        return [f"{a}+{b}" for a in range(10) for b in range(10)]

    def render(self, item: str) -> str:
        return f"{item}="

    def solve(self, item: str) -> str:
        a, b = item.split("+")
        return str((int(a) + int(b)) % 10)


class CopyLastTask(_LetterTask):
    """``last cab=`` -> ``b``: copy the last letter (default 252 inputs, one-token answers)."""

    name = "copy_last"

    def __init__(self, *, alphabet: str = "abcdef", min_len: int = 2, max_len: int = 3, **kw: Any):
        self.answer_pattern = f"[{alphabet}]"
        super().__init__(alphabet=alphabet, min_len=min_len, max_len=max_len, **kw)

    def render(self, item: str) -> str:
        return f"last {item}="

    def solve(self, item: str) -> str:
        return item[-1]


def lookup_value(salt: str, key: str) -> str:
    """The digit an episode's table holds for ``key`` (a fixed hash, identical in every process)."""
    return str(hashlib.sha256(f"{salt}:{key}".encode()).digest()[0] % 10)


class LookupTask(_LetterTask):
    """``find cab=`` -> a digit only the ``get`` tool knows (multi-turn; ``mrl.env.lookup.LookupEnv``).

    Each prompt draws a fresh table (a salt from the seed and the prompt's index): the same key maps to
    another digit in the next epoch, so the answer cannot be learnt from the prompt, only looked up.
    The solving episode: ``get(cab)`` -> observation ``" 7\nans="`` -> ``7``; answering without the tool
    is right one time in ten. ``env`` names the environment ``rollout.env.fn`` defaults to."""

    name = "lookup"
    answer_pattern = "[0-9]"
    env = "mrl.env.lookup.LookupEnv"

    def __init__(self, *, alphabet: str = "abcdef", min_len: int = 2, max_len: int = 2, **kw: Any):
        super().__init__(alphabet=alphabet, min_len=min_len, max_len=max_len, **kw)

    @property
    def max_turn_tokens(self) -> int:
        """Tokens a model turn needs here (``rollout.env.max_turn_tokens`` defaults to it): the tool call
        ``get(key)`` and EOS, at worst one token per character."""
        return len("get()") + self.max_len + 1

    def render(self, item: str) -> str:
        return f"find {item}="

    def solve(self, item: str) -> str:
        raise NotImplementedError("lookup: the answer depends on the prompt's table, see sample()")

    def sample(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"{self.name}: index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self._items))
        item = self._items[self._epoch_order(epoch)[pos]]
        salt = f"{self.seed}:{self.split}:{index}"
        return Prompt(id=f"{self.name}/{self.split}/{index}", text=self.render(item),
                      answer=lookup_value(salt, item),
                      meta={"task": self.name, "input": item, "answer_pattern": self.answer_pattern, "salt": salt,
                            "alphabet": self.alphabet, "min_len": self.min_len, "max_len": self.max_len})

    def reference(self, prompt: Prompt) -> str:
        return prompt.answer

    def warm_start_tokens(self, prompt: Prompt, tokenizer, eos: int) -> tuple[list[int], int]:
        """The solving conversation for the supervised warm start, as (token ids, prompt length): built
        piece by piece as the episode loop builds it (turns end with EOS, observations tokenized alone), so
        the warm start sees the token sequence the rollouts produce. Its observation tokens are trained too
        (the warm start has no loss mask): the looked-up digit is noise there, the copy after it is not."""
        def enc(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        ids = tokenizer.encode(prompt.text).ids
        rest = enc(f"get({prompt.meta['input']})") + [eos] + enc(f" {prompt.answer}\nans=") + enc(prompt.answer) + [eos]
        return ids + rest, len(ids)


class CountdownTask(SyntheticTask):
    """``3 5 7->22=`` -> ``3*5=15`` / ``15+7=22`` / ``#### 3*5+7``: reach the target with + - * /, each number once.

    Difficulty: ``num_numbers`` drawn from 1..``max_number``, joined by ``ops`` (any of ``+-*/``), to a target
    that is not one of them. Inputs are ``num_problems`` distinct problems (the numbers as a multiset and the
    target) from a generator seeded by those arguments, not by ``data.seed``: every process and seed sees the
    same problems and the same split (a small setting may have fewer problems than asked: then it has all
    there are). The prompt lists the numbers in the order the worked solution uses them when ``ordered``, else
    ascending (harder: the policy must find the order). ``answer`` is the target; ``meta`` holds ``numbers``
    and ``target`` for ``reward.fn=mrl.reward.builtin.countdown``, which accepts any valid expression. The
    warm start trains on the worked solution (``warm_start_tokens``)."""

    name = "countdown"
    reward_fn = "mrl.reward.builtin.countdown"  # reward=countdown

    def __init__(self, *, num_numbers: int = 3, max_number: int = 9, ops: str = "+-", ordered: bool = True,
                 num_problems: int = 2000, **kw: Any):
        if not 2 <= num_numbers <= 8:
            raise ValueError(f"data.task_args.num_numbers: must be in [2, 8], got {num_numbers}")
        if not 2 <= max_number <= 999:
            raise ValueError(f"data.task_args.max_number: must be in [2, 999], got {max_number}")
        if not ops or set(ops) - set(OPS) or len(set(ops)) != len(ops):
            raise ValueError(f"data.task_args.ops: must be distinct operators out of {OPS!r}, got {ops!r}")
        if num_problems < 2:
            raise ValueError(f"data.task_args.num_problems: must be >= 2, got {num_problems}")
        self.num_numbers, self.max_number, self.ops, self.ordered = num_numbers, max_number, ops, ordered
        self._chains = self._problems(num_problems)
        super().__init__(**kw)

    def _problems(self, num_problems: int) -> dict[str, Chain]:
        """Problem key ("3 5 7:22", numbers ascending) -> its generated solution, in generation order."""
        rng = random.Random(f"countdown:{self.num_numbers}:{self.max_number}:{self.ops}")
        chains: dict[str, Chain] = {}
        misses = 0
        while len(chains) < num_problems and misses < 2000:  # 2000 draws in a row with nothing new: all found
            chain = random_chain(rng, num_numbers=self.num_numbers, max_number=self.max_number, ops=self.ops)
            trivial = chain is None or chain.target in chain.numbers  # "#### 4" would solve "6 4 6->4="
            key = None if trivial else f"{' '.join(map(str, sorted(chain.numbers)))}:{chain.target}"
            if key is None or key in chains:
                misses += 1
            else:
                chains[key], misses = chain, 0
        return chains

    def _shown(self, chain: Chain) -> list[int]:
        return list(chain.numbers) if self.ordered else sorted(chain.numbers)

    def inputs(self) -> list[str]:
        return list(self._chains)

    def render(self, item: str) -> str:
        chain = self._chains[item]
        return f"{' '.join(map(str, self._shown(chain)))}->{chain.target}="

    def solve(self, item: str) -> str:
        return str(self._chains[item].target)

    def sample(self, index: int) -> Prompt:
        p = super().sample(index)
        chain = self._chains[p.meta["input"]]
        return dataclasses.replace(p, meta=p.meta | {"numbers": self._shown(chain), "target": chain.target})

    def reference(self, prompt: Prompt) -> str:
        return worked_solution(self._chains[prompt.meta["input"]])

    def warm_start_tokens(self, prompt: Prompt, tokenizer, eos: int) -> tuple[list[int], int]:
        """(prompt + worked solution + EOS token ids, prompt length): the warm start learns the solution's steps,
        not the bare target that ``prompt.answer`` holds."""
        ids = tokenizer.encode(prompt.text).ids
        return ids + tokenizer.encode(self.reference(prompt), add_special_tokens=False).ids + [eos], len(ids)

    @functools.cached_property
    def max_response_tokens(self) -> int:
        """A bound on the tokens a worked solution takes, EOS included: its characters + 1 (no tokenizer of
        ours makes more than one token of an ASCII character)."""
        return max(len(worked_solution(c)) for c in self._chains.values()) + 1

    def check_run(self, *, reward_fn: str, max_new_tokens: int) -> str | None:
        if max_new_tokens < self.max_response_tokens:
            return (f"rollout.max_new_tokens={max_new_tokens}: data.task=countdown's worked solutions take up to "
                    f"{self.max_response_tokens} tokens with data.task_args num_numbers={self.num_numbers}, "
                    f"max_number={self.max_number}, ops={self.ops}; set rollout.max_new_tokens="
                    f"{self.max_response_tokens} or more")
        if reward_fn.startswith("mrl.reward.") and reward_fn != self.reward_fn:
            return (f"reward.fn={reward_fn} cannot score data.task=countdown, whose responses are worked solutions "
                    f"ending in '#### <expression>': use reward=countdown (reward.fn={self.reward_fn}), which checks "
                    "that the expression reaches the target using each given number at most once")
        return None


TASKS: dict[str, type[SyntheticTask]] = {"reverse": ReverseTask, "add_mod": AddModTask, "copy_last": CopyLastTask,
                                         "lookup": LookupTask, "countdown": CountdownTask}


def build_task(name: str, *, split: str = "train", seed: int = 0, eval_fraction: float = 0.2, shuffle: bool = True,
               task_args: dict[str, Any] | None = None) -> SyntheticTask:
    """The built-in task ``name``; ``task_args`` go to its constructor (``data.task_args``)."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; built-in tasks: {sorted(TASKS)} (or set data.path)")
    cls, task_args = TASKS[name], dict(task_args or {})
    params = inspect.signature(cls.__init__).parameters
    allowed = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in _COMMON_ARGS)
    unknown = sorted(set(task_args) - set(allowed))
    if unknown:
        raise ValueError(f"data.task_args: task {name!r} takes {allowed or 'no arguments'}, got {unknown}")
    return cls(split=split, seed=seed, eval_fraction=eval_fraction, shuffle=shuffle, **task_args)
