"""A procedural teacher: worked, step-by-step solutions for integer arithmetic problems.

The Klear recipe distils long chain-of-thought answers of a strong teacher (DeepSeek-R1-0528, paper
Sec. 3.1, 5.1.2) into the base model. On a CPU demo there is no teacher model, so klear writes its own
demonstrations: for a reasoning-gym arithmetic problem (``basic_arithmetic``, ``chain_sum``,
``products``, or any task whose ``metadata["expression"]`` is integers joined by ``+``, ``-``,
``*``) it writes schoolbook column arithmetic inside ``<think>...</think>`` and then the answer in
``\\boxed{}``::

    <think>
    47+85
    ones: 7+5=12, write 2 carry 1
    tens: 4+8+1=13, write 13
    So 47+85=132.
    </think>
    The answer is \\boxed{132}.

Expressions are written without spaces (``7+5=12``): with SmolLM2's tokenizer a space before a
number is a token of its own, so this is ~25% shorter than ``7 + 5 = 12``.

Every number in the text is computed with Python integers, and :func:`teacher_response` checks the
final answer against reasoning-gym's own answer (and its ``score_answer``) before returning: a
wrong solution is never emitted (:class:`TeacherMismatch` is raised instead), unless slips are asked for.

Flawed solutions (a teacher of known quality, for the SFT data ablations of paper Sec. 5.1, Tables 2, 4-5): with
``slip_rate`` p > 0, each column fact of column addition and multiplication (``4+8+1=13``) is stated one too high
or one too low with probability p, and the rest of the work follows from the slip as written (its digit, its
carry, the sums built on it), so the response is as coherent as a correct one. A two-operand addition with c
column facts is flawed with probability 1-(1-p)^c (more digits, more flaws) and its final answer is then always
wrong; in longer work two slips can cancel (about 2% of 2-digit products at p = 0.15), leaving flawed work with a
right answer. One-digit facts stated directly (``7+5=12``) and subtraction columns are never slipped.

Procedures (each reduces multi-digit work to one-digit facts, which a small model knows):

* one-digit facts (``7+5``, ``9-3``, ``6*7``) are stated directly;
* addition: column by column from the ones, ``a+b(+carry)=s, write s mod 10 carry 1``; the
  last column writes its whole sum; a shorter number contributes ``0`` digits;
* subtraction ``a-b`` with ``a >= b``: column by column with borrows
  (``2-3, borrow 1: 12-3=9, write 9``); with ``a < b``: ``a-b=-(b-a)``;
* signed terms: ``-a+b=b-a``, ``-a+(-b)=-(a+b)``, ``a+(-b)=a-b``;
* multiplication: ``x*d`` for a one-digit ``d`` column by column (``digit*d+carry``); a
  longer multiplier is split into its digits, ``x*93=x*3+x*90``, and the partial
  products are added with the addition procedure; the shorter factor is the multiplier;
* expressions with several operators: all ``*`` first (left to right), then ``+``/``-`` left to
  right, one numbered step per operation.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from klear.data.procedural import SUMS_CODE, SUMS_CODE_FN, sums_code_ground_truth
from klear.recipe import is_slip_rate

__all__ = [
    "TeacherError",
    "TeacherMismatch",
    "Solution",
    "check_slip_rate",
    "solve_expression",
    "teacher_response",
    "tokenize_expression",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_PLACE_NAMES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands", "millions")


class TeacherError(ValueError):
    """The teacher cannot solve this problem (unsupported expression or task)."""


class TeacherMismatch(RuntimeError):
    """The teacher's answer disagrees with the dataset's answer (a bug: never emitted)."""


@dataclass(frozen=True)
class Solution:
    """A worked solution: ``thinking`` (the lines inside the think block), the integer ``answer`` it reaches and
    the number of ``slips`` in it (0: the answer is the expression's value)."""

    thinking: str
    answer: int
    slips: int = 0

    def response(self) -> str:
        """The full assistant response: ``<think>\\n...\\n</think>\\nThe answer is \\boxed{answer}.``"""
        return f"{THINK_OPEN}\n{self.thinking}\n{THINK_CLOSE}\nThe answer is \\boxed{{{self.answer}}}."


# --------------------------------------------------------------------------- parsing

_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
_STEP = re.compile(r"^Step \d+: (.*)$")


def tokenize_expression(expression: str) -> list[int | str]:
    """Split ``"98 + 93 - 77"`` into ``[98, "+", 93, "-", 77]`` (signed integers and ``+ - *``).

    A ``-`` at the start or right after an operator is a sign (``"3 * -4"`` -> ``[3, "*", -4]``).

    Raises:
        TeacherError: any other character, division, parentheses, or a malformed expression.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise TeacherError(f"expected a non-empty expression string, got {expression!r}")
    raw: list[str] = []
    pos = 0
    text = expression.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            bad = text[pos:].lstrip()[0]  # the character itself, not the blank before it
            raise TeacherError(f"unsupported character {bad!r} in expression {expression!r}")
        raw.append(m.group(1))
        pos = m.end()
    out: list[int | str] = []
    sign = 1
    expect_number = True
    for tok in raw:
        if tok in "/()":
            raise TeacherError(f"expression {expression!r}: {tok!r} is not supported (only + - * on integers)")
        if expect_number:
            if tok == "-":
                sign = -sign
                continue
            if tok == "+":
                continue
            if not tok.isdigit():
                raise TeacherError(f"expression {expression!r}: expected a number, got {tok!r}")
            out.append(sign * int(tok))
            sign = 1
            expect_number = False
        else:
            if tok.isdigit():
                raise TeacherError(f"expression {expression!r}: two numbers in a row")
            out.append(tok)
            expect_number = True
    if expect_number:
        raise TeacherError(f"expression {expression!r} ends with an operator")
    return out


# --------------------------------------------------------------------------- procedures


def _place(k: int) -> str:
    return _PLACE_NAMES[k] if k < len(_PLACE_NAMES) else f"10^{k}"


def _digits(n: int) -> list[int]:
    """Decimal digits of a non-negative int, ones first."""
    return [int(c) for c in reversed(str(n))]


def _fmt(n: int) -> str:
    return str(n)


class _Slips:
    """The slips of one solution: each column fact is off by one with probability ``rate`` (drawn from ``rng``)."""

    def __init__(self, rate: float, rng: random.Random):
        self.rate, self.rng, self.count = rate, rng, 0

    def apply(self, s: int) -> int:
        if self.rng.random() >= self.rate:
            return s
        self.count += 1
        return s + 1 if s == 0 or self.rng.random() < 0.5 else s - 1


_SLIPS: ContextVar[_Slips | None] = ContextVar("klear_teacher_slips", default=None)


@contextmanager
def _slipping(slips: _Slips | None) -> Iterator[None]:
    token = _SLIPS.set(slips)
    try:
        yield
    finally:
        _SLIPS.reset(token)


def _exact() -> bool:
    """True while no slip has been made in the solution being written (its values must then be exact)."""
    slips = _SLIPS.get()
    return slips is None or slips.count == 0


def _write_columns(columns: list[tuple[str, int]], lines: list[str]) -> int:
    """Column arithmetic, ones first: each column is (its expression, its value before the carry); appends one
    line per column ("tens: 4+7+1=12, write 2 carry 1"; the last column writes its whole sum) and returns the
    number written (a slip, see the module docstring, changes the column's sum and everything after it)."""
    slips = _SLIPS.get()
    carry = 0
    written: list[str] = []
    for k, (expr0, value) in enumerate(columns):
        s = value + carry if slips is None else slips.apply(value + carry)
        expr = expr0 + (f"+{carry}" if carry else "")
        if k == len(columns) - 1:
            lines.append(f"{_place(k)}: {expr}={s}, write {s}")
            written.append(str(s))
        else:
            carry_text = f" carry {s // 10}" if s >= 10 else ""
            lines.append(f"{_place(k)}: {expr}={s}, write {s % 10}{carry_text}")
            written.append(str(s % 10))
            carry = s // 10
    return int("".join(reversed(written)))


def _add(a: int, b: int, lines: list[str]) -> int:
    """Column addition of two non-negative ints; appends the work and returns a + b."""
    assert a >= 0 and b >= 0
    total = a + b
    if a < 10 and b < 10:
        lines.append(f"{a}+{b}={total}")
        return total
    lines.append(f"{a}+{b}")
    da, db = _digits(a), _digits(b)
    columns = []
    for k in range(max(len(da), len(db))):
        x = da[k] if k < len(da) else 0
        y = db[k] if k < len(db) else 0
        columns.append((f"{x}+{y}", x + y))
    result = _write_columns(columns, lines)
    if result != total and _exact():  # pragma: no cover - a bug in the procedure
        raise TeacherMismatch(f"column addition {a} + {b} gave {result}")
    lines.append(f"{a}+{b}={result}")
    return result


def _sub_nonneg(a: int, b: int, lines: list[str]) -> int:
    """Column subtraction a - b of non-negative ints with a >= b; returns a - b."""
    assert a >= b >= 0
    diff = a - b
    if a < 10:
        lines.append(f"{a}-{b}={diff}")
        return diff
    lines.append(f"{a}-{b}")
    da, db = _digits(a), _digits(b)
    borrow = 0
    written: list[int] = []
    for k in range(len(da)):
        x = da[k]
        y = db[k] if k < len(db) else 0
        expr = f"{x}-{y}" + (f"-{borrow}" if borrow else "")
        value = x - y - borrow
        if value < 0:
            value += 10
            lines.append(f"{_place(k)}: {expr}, borrow 1: 1{expr}={value}, write {value}")
            borrow = 1
        else:
            lines.append(f"{_place(k)}: {expr}={value}, write {value}")
            borrow = 0
        written.append(value)
    result = int("".join(str(d) for d in reversed(written)))
    if borrow or result != diff:  # pragma: no cover - a bug in the procedure
        raise TeacherMismatch(f"column subtraction {a} - {b} gave {result}")
    lines.append(f"{a}-{b}={diff}")
    return diff


def _sub(a: int, b: int, lines: list[str]) -> int:
    """a - b for non-negative ints (negative results via a - b = -(b - a))."""
    if a >= b:
        return _sub_nonneg(a, b, lines)
    lines.append(f"{a}-{b}=-({b}-{a})")
    r = _sub_nonneg(b, a, lines)
    lines.append(f"So {a}-{b}={-r}")
    return -r


def _signed_add(x: int, y: int, lines: list[str]) -> int:
    """x + y for signed ints, reduced to non-negative addition or subtraction."""
    if x >= 0 and y >= 0:
        return _add(x, y, lines)
    if x >= 0 > y:
        lines.append(f"{x}+({y})={x}-{-y}")
        return _sub(x, -y, lines)
    if y >= 0 > x:
        lines.append(f"{x}+{y}={y}-{-x}")
        return _sub(y, -x, lines)
    lines.append(f"{x}+({y})=-({-x}+{-y})")
    r = _add(-x, -y, lines)
    lines.append(f"So {x}+({y})={-r}")
    return -r


def _signed_sub(x: int, y: int, lines: list[str]) -> int:
    """x - y for signed ints."""
    if y < 0:
        lines.append(f"{x}-({y})={x}+{-y}")
        return _signed_add(x, -y, lines)
    if x >= 0:
        return _sub(x, y, lines)
    lines.append(f"{x}-{y}=-({-x}+{y})")
    r = _add(-x, y, lines)
    lines.append(f"So {x}-{y}={-r}")
    return -r


def _mul_digit(x: int, d: int, lines: list[str]) -> int:
    """x * d for a non-negative x and a one-digit d, column by column."""
    assert x >= 0 and 0 <= d <= 9
    product = x * d
    if x < 10:
        lines.append(f"{x}*{d}={product}")
        return product
    lines.append(f"{x}*{d}")
    result = _write_columns([(f"{digit}*{d}", digit * d) for digit in _digits(x)], lines)
    if result != product and _exact():  # pragma: no cover
        raise TeacherMismatch(f"column multiplication {x} * {d} gave {result}")
    lines.append(f"{x}*{d}={result}")
    return result


def _mul_nonneg(a: int, b: int, lines: list[str]) -> int:
    """a * b for non-negative ints; the factor with fewer digits is the multiplier."""
    product = a * b
    if a < 10 and b < 10:
        lines.append(f"{a}*{b}={product}")
        return product
    x, y = a, b
    if len(str(b)) > len(str(a)):
        x, y = b, a
        lines.append(f"{a}*{b}={b}*{a}")
    if y < 10:
        return _mul_digit(x, y, lines)
    parts = [(d, k) for k, d in enumerate(_digits(y)) if d != 0]
    terms = [f"{x}*{d * 10**k}" for d, k in parts]
    if len(terms) > 1:
        lines.append(f"{x}*{y}=" + "+".join(terms))
    partials: list[int] = []
    for d, k in parts:
        p = _mul_digit(x, d, lines)
        if k:
            lines.append(f"so {x}*{d * 10**k}={p * 10**k}")
            p *= 10**k
        partials.append(p)
    acc = partials[0]
    for p in partials[1:]:
        acc = _add(acc, p, lines)
    if acc != product and _exact():  # pragma: no cover
        raise TeacherMismatch(f"long multiplication {a} * {b} gave {acc}")
    lines.append(f"So {a}*{b}={acc}")
    return acc


def _signed_mul(x: int, y: int, lines: list[str]) -> int:
    if x >= 0 and y >= 0:
        return _mul_nonneg(x, y, lines)
    negative = (x < 0) != (y < 0)
    left, right = f"({x})" if x < 0 else str(x), f"({y})" if y < 0 else str(y)
    sign = "-" if negative else ""
    lines.append(f"{left}*{right}={sign}({abs(x)}*{abs(y)})")
    r = _mul_nonneg(abs(x), abs(y), lines)
    lines.append(f"So {left}*{right}={-r if negative else r}")
    return -r if negative else r


def _render(tokens: list[int | str]) -> str:
    parts = []
    for i, t in enumerate(tokens):
        if isinstance(t, int) and t < 0 and i > 0:
            parts.append(f"({t})")
        else:
            parts.append(str(t))
    return "".join(parts)


def solve_expression(expression: str, *, slip_rate: float = 0.0, rng: random.Random | None = None) -> Solution:
    """Worked solution of an integer expression with ``+ - *`` (usual precedence).

    Args:
        expression: e.g. ``"98+93-77"`` or ``"23*60"``.
        slip_rate: the chance of a slip in each column fact, in [0, 1) (module docstring); 0: exact.
        rng: draws the slips (required when ``slip_rate > 0``).

    Returns:
        :class:`Solution` whose ``thinking`` is the work (one step per line) ending with
        ``So <expression> = <answer>.``, whose ``answer`` is the value the work reaches (the exact value when its
        ``slips`` is 0).

    Raises:
        TeacherError: the expression uses anything but integers, ``+``, ``-``, ``*`` (see
            :func:`tokenize_expression`); ``slip_rate`` outside [0, 1) or without ``rng``.
    """
    slips = _make_slips(slip_rate, rng)
    with _slipping(slips):
        solution = _solve(expression)
    return Solution(solution.thinking, solution.answer, slips.count if slips else 0)


def check_slip_rate(slip_rate: Any) -> None:
    """A slip rate by the one rule (:func:`klear.recipe.is_slip_rate`: a number in [0, 1)).

    Raises:
        TeacherError: anything else (names the value).
    """
    if not is_slip_rate(slip_rate):
        raise TeacherError(f"slip_rate must be a number in [0, 1), got {slip_rate!r}")


def _make_slips(slip_rate: float, rng: random.Random | None) -> _Slips | None:
    check_slip_rate(slip_rate)
    if slip_rate == 0:
        return None
    if not isinstance(rng, random.Random):
        raise TeacherError(f"slip_rate={slip_rate} needs rng (a random.Random), got {rng!r}")
    return _Slips(float(slip_rate), rng)


def _solve(expression: str) -> Solution:
    """:func:`solve_expression` under the current slips."""
    tokens = tokenize_expression(expression)
    shown = " ".join(str(t) for t in tokens) if len(tokens) == 1 else _render(tokens)
    lines: list[str] = []
    n_ops = (len(tokens) - 1) // 2
    step = 0

    def header(a: int, op: str, b: int) -> None:
        nonlocal step
        step += 1
        if n_ops > 1:
            lines.append(f"Step {step}: {_render([a, op, b])}")

    # multiplications first, left to right
    reduced: list[int | str] = [tokens[0]]
    for i in range(1, len(tokens), 2):
        op, b = tokens[i], tokens[i + 1]
        if op == "*":
            a = reduced.pop()
            assert isinstance(a, int) and isinstance(b, int)
            header(a, "*", b)
            reduced.append(_signed_mul(a, b, lines))
        else:
            reduced += [op, b]
    value = reduced[0]
    assert isinstance(value, int)
    for i in range(1, len(reduced), 2):
        op, b = reduced[i], reduced[i + 1]
        assert isinstance(b, int)
        header(value, str(op), b)
        value = _signed_add(value, b, lines) if op == "+" else _signed_sub(value, b, lines)
    if n_ops == 0:
        lines.append(f"The expression is just {value}")
    # drop a statement that repeats the line before it ("Step 1: a+b" then "a+b"), and the last
    # intermediate result when it is the final statement itself
    kept: list[str] = []
    for line in lines:
        if kept and (m := _STEP.match(kept[-1])) and m.group(1) == line:
            continue
        kept.append(line)
    if kept and kept[-1] in (f"{shown}={value}", f"So {shown}={value}"):
        kept.pop()
    kept.append(f"So {shown}={value}.")
    return Solution(thinking="\n".join(kept), answer=value)


def teacher_response(
    entry: Mapping[str, Any], *, dataset=None, slip_rate: float = 0.0, rng: random.Random | None = None
) -> str:
    """The verified worked response for one reasoning-gym entry.

    Args:
        entry: a reasoning-gym entry (``question``, ``answer``, ``metadata`` with ``expression``).
        dataset: the reasoning-gym dataset that produced ``entry``; if given, its
            ``score_answer`` must also accept the teacher's answer.
        slip_rate, rng: a flawed teacher (:func:`solve_expression`): the exact solution is checked as below, then
            the response is written again with slips drawn from ``rng`` (module docstring).

    Returns:
        ``"<think>\\n...work...\\n</think>\\nThe answer is \\boxed{N}."``.

        For klear's ``sums_code`` task (:mod:`klear.data.procedural`): each sum worked out in the think block
        (``<think>\\n47+85\\n...So 12+39=51.\\n</think>``), then the program in a fenced ``python`` block,
        ``def f(i):\\n    return [132, 51][i]``.

    Raises:
        TeacherError: the entry is not a dict, has no ``metadata["expression"]`` or an unsupported one (``sums_code``:
            no list of expressions); a bad ``slip_rate`` or ``rng``.
        TeacherMismatch: the computed answer differs from ``entry["answer"]`` (``sums_code``: the question, metadata
            or ground truth disagree with the computed sums); never emitted.
    """
    if not isinstance(entry, Mapping):
        raise TeacherError(f"expected a reasoning-gym entry (a dict with question, answer, metadata), got {entry!r}")
    metadata = entry.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise TeacherError(f"reasoning-gym entry: metadata must be a dict, got {metadata!r}")
    _make_slips(slip_rate, rng)  # bad settings fail before any work
    if metadata.get("source_dataset") == SUMS_CODE:
        return _sums_code_response(entry, dataset, slip_rate, rng)
    expression = metadata.get("expression")
    if not isinstance(expression, str):
        source = metadata.get("source_dataset", "?")
        raise TeacherError(
            f"reasoning-gym entry of task {source!r} has no metadata['expression']; the procedural "
            f"teacher supports integer +, -, * expressions (basic_arithmetic, chain_sum, products)"
        )
    solution = solve_expression(expression)
    gold = str(entry.get("answer", "")).strip()
    if gold != str(solution.answer):
        raise TeacherMismatch(
            f"teacher answer {solution.answer} != reasoning-gym answer {gold!r} for "
            f"{expression!r} (question {entry.get('question')!r})"
        )
    if dataset is not None:
        score = dataset.score_answer(str(solution.answer), entry)
        if score != 1.0:
            raise TeacherMismatch(
                f"reasoning-gym scores the teacher's answer {solution.answer} as {score} for {entry.get('question')!r}"
            )
    if slip_rate:
        solution = solve_expression(expression, slip_rate=slip_rate, rng=rng)
    return solution.response()


def _sums_code_response(entry: Mapping[str, Any], dataset, slip_rate: float, rng: random.Random | None) -> str:
    """The worked response to a ``sums_code`` entry (:func:`teacher_response`), after checking that its
    question, ``metadata`` and ground truth describe the same sums."""
    import json

    metadata = entry["metadata"]
    expressions = metadata.get("expressions")
    if not isinstance(expressions, list) or not expressions or not all(isinstance(e, str) for e in expressions):
        raise TeacherError(
            f"sums_code entry: metadata['expressions'] must be a non-empty list of 'a+b' strings, got {expressions!r}"
        )
    solutions = [solve_expression(e) for e in expressions]
    sums = [s.answer for s in solutions]
    where = f"sums_code entry {entry.get('question')!r}"
    if metadata.get("sums") != sums:
        raise TeacherMismatch(f"{where}: teacher sums {sums} != metadata['sums'] {metadata.get('sums')!r}")
    lines = str(entry.get("question", "")).split("\n")[1:]
    if lines != [f"{i}: {e}" for i, e in enumerate(expressions)]:
        raise TeacherMismatch(f"{where}: the question's lines {lines!r} do not list metadata['expressions']")
    try:
        answer = json.loads(entry.get("answer") or "")
    except (TypeError, ValueError):
        answer = None
    if answer != json.loads(sums_code_ground_truth(sums)):
        raise TeacherMismatch(
            f"{where}: answer {entry.get('answer')!r} is not the ground truth of the sums, "
            f"{sums_code_ground_truth(sums)}"
        )
    if dataset is not None and dataset.score_answer(json.dumps(sums), entry) != 1.0:
        raise TeacherMismatch(f"{where}: reasoning-gym scores the teacher's sums {sums} as wrong")
    if slip_rate:
        solutions = [solve_expression(e, slip_rate=slip_rate, rng=rng) for e in expressions]
        sums = [s.answer for s in solutions]
    thinking = "\n".join(s.thinking for s in solutions)
    program = f"def {SUMS_CODE_FN}(i):\n    return [{', '.join(map(str, sums))}][i]"
    return f"{THINK_OPEN}\n{thinking}\n{THINK_CLOSE}\n```python\n{program}\n```"
