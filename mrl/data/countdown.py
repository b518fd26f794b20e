"""Countdown's rules: reach a target from given numbers with + - * /, each number used at most once.

    chain = random_chain(random.Random(1), num_numbers=3, max_number=9, ops="+-*")
    chain.numbers, chain.target        # (3, 2, 5), 25: the numbers in the order the solution uses them
    worked_solution(chain)             # "3+2=5\\n5*5=25\\n#### (3+2)*5"
    countdown_value("(5+2)*3", [3, 2, 5])   # Fraction(21); None: not a valid answer for these numbers

Problems are made forward: numbers drawn, then combined left to right with random operators, so every
problem has a known solution and every intermediate value is a positive integer (subtraction never goes
below 1, division is exact). The worked solution shows those steps, one per line, and ends in GSM8K's
``#### <expression>``, the format ``mrl.reward.builtin.extract_final_answer`` reads.

Answers are checked without ``eval``: the expression is parsed by ``ast`` and only integer literals and
the four binary operators are accepted, evaluated in exact fractions. Any solution counts, not only the
generated one: other orders, parentheses, fractional intermediate values, unused numbers.
"""

from __future__ import annotations

import ast
import warnings
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

OPS = "+-*/"
MAX_EXPRESSION_CHARS = 200
"""Longer answers are rejected unparsed (a valid one over 6 numbers is a few dozen characters)."""
_BINOPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
           ast.Div: Fraction.__truediv__}


@dataclass(frozen=True)
class Chain:
    """A solution built left to right: ``((numbers[0] ops[0] numbers[1]) ops[1] numbers[2]) ...``."""

    numbers: tuple[int, ...]
    ops: str

    @property
    def values(self) -> list[int]:
        """The intermediate results, one per operator; the last is the target."""
        out, acc = [], self.numbers[0]
        for op, b in zip(self.ops, self.numbers[1:]):
            acc = _apply(op, acc, b)
            out.append(acc)
        return out

    @property
    def target(self) -> int:
        return self.values[-1]

    def expression(self) -> str:
        """The chain as one expression, parenthesized only where precedence needs it."""
        expr, prev = str(self.numbers[0]), ""
        for op, b in zip(self.ops, self.numbers[1:]):
            if op in "*/" and prev in ("+", "-"):
                expr = f"({expr})"
            expr, prev = f"{expr}{op}{b}", op
        return expr


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b


def _allowed(op: str, a: int, b: int) -> bool:
    """Operators that keep the running value a positive integer (and division informative)."""
    return op in "+*" or (op == "-" and a > b) or (op == "/" and b > 1 and a % b == 0)


def random_chain(rng: random.Random, *, num_numbers: int, max_number: int, ops: str) -> Chain | None:
    """Numbers drawn from 1..max_number and joined left to right by operators allowed at each step; None
    when some step allows none of ``ops`` (e.g. ``ops="-"`` after a 1): the caller draws again."""
    numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
    chosen, acc = [], numbers[0]
    for b in numbers[1:]:
        allowed = [op for op in ops if _allowed(op, acc, b)]
        if not allowed:
            return None
        op = rng.choice(allowed)
        chosen.append(op)
        acc = _apply(op, acc, b)
    return Chain(tuple(numbers), "".join(chosen))


def worked_solution(chain: Chain) -> str:
    """One line per step (``3*5=15``), then ``#### <expression>``."""
    steps, acc = [], chain.numbers[0]
    for op, b, value in zip(chain.ops, chain.numbers[1:], chain.values):
        steps.append(f"{acc}{op}{b}={value}")
        acc = value
    return "\n".join(steps + [f"#### {chain.expression()}"])


def countdown_value(expression: str, numbers: list[int]) -> Fraction | None:
    """The exact value of ``expression`` when it is a valid answer over ``numbers``: integer literals each
    drawn from ``numbers`` (a number given twice may be used twice), + - * / and parentheses only, no
    division by zero. None otherwise. A trailing ``= value`` is ignored (``3*5+7=22``); ``×``/``÷`` are read
    as ``*``/``/``."""
    text = expression.replace("×", "*").replace("÷", "/").split("=")[0].strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        with warnings.catch_warnings():  # a policy's "2a+3" draws a SyntaxWarning per sample on the console
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used: list[int] = []
    value = _evaluate(tree, used)
    if value is None or Counter(used) - Counter(numbers):  # a number not given, or used too often
        return None
    return value


def _evaluate(node: ast.AST, used: list[int]) -> Fraction | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if left is None or right is None or (isinstance(node.op, ast.Div) and right == 0):
            return None
        return _BINOPS[type(node.op)](left, right)
    return None  # names, calls, unary minus, powers, floats: not a countdown answer
