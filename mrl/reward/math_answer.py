"""Math answers checked for equivalence, not string equality (``reward=math``).

    reward.fn=mrl.reward.math_answer.equivalent                # 1.0 / 0.0
    grade_math_answer("so \\boxed{\\frac{3}{4}}", "0.75")   # MathGrade("\\frac{3}{4}", parsed=True, correct=True)

The final answer is read by ``mrl.reward.builtin.extract_final_answer`` (the last ``\\boxed{}``, GSM8K's
``#### 42``, "The answer is 42", or the last line); the label ``prompt.answer`` may be plain ("42", "3/4",
"1,000") or LaTeX, or a whole reference solution with a box or ``####`` in it. Both are parsed and compared
by Hugging Face's ``math-verify`` (0.9.0, Apache-2.0; its LaTeX grammar is ``latex2sympy2_extended``, MIT,
on the ANTLR runtime hydra already pins): fractions and decimals (3/4 = 0.75 = \\frac{3}{4}), thousands
separators, units and ``\\text{}`` dropped, percent signs, sets and intervals, tuples, equations (``x=5``
matches 5), symbolic equality through sympy. Why it: it parses both sides and compares values, where the
string normalizers peers also carry (the Hendrycks MATH ``is_equiv`` of verl's ``math.py``, DAPO's) compare
rewritten strings; and it is the field's maintained verifier (open-r1, TRL's accuracy reward, verl's
``math_verify`` score and NeMo-RL's math environment use it) rather than one more of our own.

Scores: 1.0 equivalent; 0.0 wrong; ``UNPARSED_REWARD`` (0.0) when the response states no answer or its answer
does not parse. The scorer takes a number only, so an unparsed answer is not counted apart from a wrong one;
``grade_math_answer`` tells them apart for callers that count. A label that does not parse is an error of
the data: it raises (a counted reward error, ``reward.on_error``).

Timeouts: math-verify bounds its parsing and comparing with ``signal.alarm``, which works in a process's
main thread only (elsewhere it raises). The scorer's process workers (``reward.executor=process``, what
``auto`` picks for this module) run calls in their main thread: there the alarm is set (``TIMEOUT_S`` per
step), so a pathological answer (``9^{9^{9^{9}}}``) scores 0.0 and the worker lives on. In a thread, as
TRL's accuracy reward does, the alarm is off and only ``reward.timeout_s`` bounds the call, which cannot
stop a thread: keep this reward in processes.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import math_verify
from math_verify.errors import TimeoutException

from mrl.data.prompt import Prompt
from mrl.reward.builtin import extract_final_answer

UNPARSED_REWARD = 0.0
"""Reward of a response with no final answer, or one math-verify cannot parse."""
TIMEOUT_S = 3
"""math-verify's limit per parse and per comparison, in whole seconds (``signal.alarm``), main thread only."""
MAX_ANSWER_CHARS = 1000
"""Longer final answers count as unparsed (MATH's longest labels are a few hundred characters)."""


@dataclass(frozen=True)
class MathGrade:
    """What ``grade_math_answer`` found: the extracted answer (None: none stated), whether it parsed, and
    whether it is equivalent to the label."""

    answer: str | None
    parsed: bool
    correct: bool


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(answer: str) -> list:
    """math-verify's parse of one final answer: as one LaTeX/plain expression when it is one, as text to
    search when it holds words ("5 apples", "x = 3/4 cm"). [] when nothing parses or the time is up."""
    has_words = any(len(w) > 1 and w.isalpha() for w in _words_outside_commands(answer))
    try:
        if has_words:
            return math_verify.parse(answer, parsing_timeout=_timeout(), raise_on_error=True)
        return math_verify.parse(f"${answer}$", parsing_timeout=_timeout(), raise_on_error=True)
    except (Exception, TimeoutException):
        return []


def _words_outside_commands(text: str) -> list[str]:
    """Runs of letters not part of a LaTeX command (``\\frac``, ``\\pi``): prose, or bare units."""
    out, word, command = [], "", False
    for ch in text + " ":
        if ch.isalpha():
            word += ch
        else:
            if word and not command:
                out.append(word)
            word, command = "", ch == "\\"
    return out


@functools.lru_cache(maxsize=4096)
def _parsed_label(label: str) -> tuple:
    answer = extract_final_answer(label) if ("\\boxed" in label or "####" in label) else label.strip()
    parsed = _parse(answer) if answer else []
    if not parsed:
        raise ValueError(f"prompt.answer {label!r}: math-verify cannot parse it")
    return tuple(parsed)


def grade_math_answer(response_text: str, label: str) -> MathGrade:
    """The response's final answer (``extract_final_answer``) against ``label`` (see the module docstring)."""
    gold = list(_parsed_label(label))
    answer = extract_final_answer(response_text)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return MathGrade(answer, parsed=False, correct=False)
    pred = _parse(answer)
    if not pred:
        return MathGrade(answer, parsed=False, correct=False)
    try:
        correct = math_verify.verify(gold, pred, timeout_seconds=_timeout(), raise_on_error=True)
    except (Exception, TimeoutException):
        correct = False
    return MathGrade(answer, parsed=True, correct=bool(correct))


def equivalent(prompt: Prompt, response_text: str) -> float:
    """1.0 when the response's final answer is mathematically equivalent to ``prompt.answer``, 0.0 when it is
    not, ``UNPARSED_REWARD`` when it states none or it does not parse (``reward=math``)."""
    grade = grade_math_answer(response_text, prompt.answer)
    if not grade.parsed:
        return UNPARSED_REWARD
    return float(grade.correct)
