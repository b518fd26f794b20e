"""Built-in reward functions (``reward.fn=mrl.reward.builtin.<name>``).

Contract of every reward fn, built-in or user (loaded by dotted path, see ``mrl.reward.load_reward_fn``):

    def fn(prompt: mrl.data.Prompt, response_text: str) -> float        # or: async def fn(...)

``response_text`` is the decoded response alone (no prompt). Return a finite number; raising,
timing out or returning anything else is a counted error (``reward.on_error``). A sync fn runs in a
worker thread or process (``reward.executor``), so it may block; an async fn runs on the event loop
under ``executor=thread`` (it must not block) or under ``asyncio.run`` in a worker process.
"""

from __future__ import annotations

import regex

from mrl.data.prompt import Prompt

STOP_TEXTS = ("\n", "<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")
"""The answer ends at the first of these (EOS texts of the tiny model and common chat models)."""

FORMAT_CREDIT = 0.1
"""``format_and_correct``: reward of a well-formed but wrong answer."""

PATTERN_TIMEOUT_S: float | None = 30.0
"""Limit of one ``answer_pattern`` match (patterns come with the data: one can backtrack for hours, holding
the GIL, where no thread timeout could stop it). The reward scorer sets it to ``reward.timeout_s``."""


def extract_answer(response_text: str) -> str:
    """The response up to the first newline or EOS text, stripped of surrounding whitespace."""
    cut = len(response_text)
    for stop in STOP_TEXTS:
        i = response_text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return response_text[:cut].strip()


def exact_match(prompt: Prompt, response_text: str) -> float:
    """1.0 when the extracted answer equals ``prompt.answer`` (both stripped), else 0.0."""
    return float(extract_answer(response_text) == prompt.answer.strip())


def prefix_match(prompt: Prompt, response_text: str) -> float:
    """1.0 when the extracted answer starts with ``prompt.answer`` (lenient about trailing text)."""
    answer = prompt.answer.strip()
    return float(bool(answer) and extract_answer(response_text).startswith(answer))


def contains(prompt: Prompt, response_text: str) -> float:
    """1.0 when ``prompt.answer`` appears anywhere in the response (for free-form responses)."""
    answer = prompt.answer.strip()
    return float(bool(answer) and answer in response_text)


def format_and_correct(prompt: Prompt, response_text: str) -> float:
    """Partial credit: 1.0 correct; ``FORMAT_CREDIT`` well-formed but wrong; 0.0 malformed.

    Well-formed: the extracted answer is non-empty and fully matches ``prompt.meta["answer_pattern"]``
    when the prompt has one (built-in tasks do; a JSONL column may), else contains no whitespace.
    An example of shaping: early in training it also rewards answering in the right form.
    """
    answer = extract_answer(response_text)
    if answer == prompt.answer.strip():
        return 1.0
    pattern = prompt.meta.get("answer_pattern") or r"\S+"
    if not answer:
        return 0.0
    try:  # the regex package: re-compatible syntax, a timeout, and it releases the GIL while matching
        well_formed = regex.fullmatch(pattern, answer, timeout=PATTERN_TIMEOUT_S, concurrent=True)
    except TimeoutError:
        raise TimeoutError(f"answer_pattern {pattern!r} of prompt {prompt.id!r} did not finish matching within "
                           f"{PATTERN_TIMEOUT_S} s (reward.timeout_s)") from None
    return FORMAT_CREDIT if well_formed else 0.0
