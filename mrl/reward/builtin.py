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

from mrl.data.countdown import countdown_value
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


_BOX_OR_BRACE = regex.compile(r"\\(?:boxed|fbox)\s*\{|\{|\}")
_ANSWER_IS = regex.compile(r"\banswer\s*(?:is\s*:?|:)[ \t]*([^\n]*)", regex.IGNORECASE)
_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def extract_final_answer(response_text: str) -> str | None:
    """The final answer a worked solution states, or None when it states none. Read up to the first EOS text
    (``STOP_TEXTS`` but the newline), the first of these that is there:
      - the content of the last complete ``\\boxed{...}`` (or ``\\fbox``), nested braces included;
      - what follows the last ``####`` on its line (GSM8K's format);
      - what follows the last "answer is" / "answer:" on its line ("The answer is 42." -> "42");
      - the last non-empty line.
    Surrounding ``$...$``, ``\\(...\\)``, ``\\[...\\]``, spaces and a final period are stripped. One pass
    over the text, however it nests (a box left open by a cut-off response is skipped)."""
    text = response_text
    for stop in STOP_TEXTS[1:]:
        text = text.split(stop, 1)[0]
    answer = _last_box(text)
    if answer is None and (i := text.rfind("####")) >= 0:
        answer = text[i:].split("\n", 1)[0].lstrip("#")
    if not (answer or "").strip():
        said = [m.group(1) for m in _ANSWER_IS.finditer(text) if m.group(1).strip()]
        lines = [line for line in text.split("\n") if line.strip()]
        answer = said[-1] if said else lines[-1] if lines else ""
    answer = answer.strip().removesuffix(".").strip()
    for left, right in _DELIMITERS:
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left) + len(right):
            answer = answer[len(left):-len(right)].strip()
    return answer or None


def _last_box(text: str) -> str | None:
    """The content of the box that closes last (an enclosing box over the boxes inside it)."""
    opened: list[int] = []  # per open brace: where its box's content starts, or -1 for a plain brace
    last = None
    for m in _BOX_OR_BRACE.finditer(text):
        if m.group() == "}":
            if opened and (start := opened.pop()) >= 0:
                last = text[start:m.start()]
        else:
            opened.append(-1 if m.group() == "{" else m.end())
    return last


def countdown(prompt: Prompt, response_text: str) -> float:
    """1.0 when the final answer (``extract_final_answer``) is an expression of ``prompt.meta["numbers"]``, each
    used at most once, with + - * / and parentheses, equal to ``prompt.meta["target"]`` (``data=countdown``);
    0.0 otherwise, an answer that does not parse included."""
    answer = extract_final_answer(response_text)
    value = None if answer is None else countdown_value(answer, prompt.meta["numbers"])
    return float(value is not None and value == prompt.meta["target"])
