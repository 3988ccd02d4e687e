"""Binary math reward with math-verify (Klear-Reasoner, Sec. 3.2.4).

A response earns ``+1.0`` when its final answer is mathematically equivalent to the
ground truth and ``-1.0`` otherwise (Klear's code uses +1/-1, not 1/0). Everything that
is not a verified correct answer is ``-1.0``: wrong, missing, truncated, unparseable,
timed out, or scored against an unusable ground truth. A truncated response therefore
never scores better than a wrong one. The one exception: a comparison the worker pool could not
run at all (the pool broke, or the worker was killed under it, on every attempt of the backoff in
``_timeout``) is UNSCORED, ``nan`` (:data:`klear.rewards.correctness.UNSCORED_REWARD`, reason
``"unscored"``), never ``-1``.

Pipeline (:func:`math_score_detailed`):

1. **Think block** (:func:`klear.rewards.think_format.answer_region`, shared with the code
   reward). Klear's format: ONE closed think block, then the answer; the answer is searched in
   the text after ``</think>``. In every mode a response whose ``<think>`` is never closed
   (reason ``"unclosed_think"``: cut off while thinking) or that has more than one ``<think>`` or
   ``</think>`` (``"multiple_think"``) scores ``-1``. With ``require_think=True`` a response
   without ``</think>`` scores ``-1`` (``"missing_think"``); the opening ``<think>`` is optional
   because many chat templates put it in the prompt.
2. **Final answer** (:func:`extract_last_boxed`). The answer is the content of the LAST
   top-level ``\\boxed{...}`` / ``\\fbox{...}`` (``\\boxed 18`` also works), found with a
   brace-matching scan (escaped ``\\{``/``\\}`` do not count). Earlier boxes are ignored
   (self-correction: only the last counts). If the last box is never closed (truncated
   output) the answer is missing, even if an earlier box was complete. No box, an
   unclosed last box or an empty box all score ``-1``.
3. **Fast path.** When the ground truth is a plain number (``-?\\d+(\\.\\d+)?``) and the
   boxed content is the identical string, the answer is correct without further work.
4. **Comparison** (:func:`verify_answer`), in a worker process with a wall-clock limit (see
   ``_timeout``). Delimiter sizing commands are dropped like ``\\left``/``\\right``
   (:func:`strip_sizing`: ``\\bigl(3,\\,-1\\bigr)`` == ``(3,-1)``; ``\\big``, ``\\Big``, ``\\bigg``,
   ``\\Bigg`` with ``l``/``r``/``m``), and ``\\mathrm{e}`` / ``\\mathrm{i}`` are read as Euler's number
   and the imaginary unit (:func:`upright_constants`). Then, in order:

   a. **Same text** (:func:`same_text`): equal when both read the same without formatting
      (``\\text{}``/``\\mathrm{}`` wrappers, ``$``, spacing, whitespace, trailing periods):
      ``4:30 \\text{ p.m.}`` == ``\\text{4:30 p.m.}``; case-insensitive for ``\\text`` golds.
   b. **Clock** (:func:`compare_clock_times`): two clock times with am/pm are equal when they are
      the same time, whatever the meridiem's spelling (am, a.m., AM, A.M.): ``4:30 pm`` ==
      ``\\text{4:30 PM}`` == ``\\text{4:30 p.m.}``, but ``4:30 am`` != ``4:30 p.m.`` (a bare ``2am`` is
      left to math-verify: it may be the product ``2am``). A gold such as
      ``4:30 p.m.`` is a valid answer although math-verify extracts no expression from it.
   c. **Bases** (:func:`compare_base_numerals`): when a numeral carries a base subscript, equal
      means the same digits and, where both write one, the same base: ``52_8`` == ``52_{8}`` ==
      ``52``, but ``52_8`` != ``52_9`` and != ``42_{10}``.
   d. **Unit exponents** (:func:`compare_unit_exponents`): when both end in a ``\\text{}``/
      ``\\mbox{}`` unit, the unit's exponent must agree (``15\\mbox{ cm}^3`` != ``15\\mbox{ cm}^2``;
      "square"/"cubic" count as 2/3). A bare number still matches a number with a unit
      (``15`` == ``15\\text{ cm}^2``, either way round), as math-verify strips units.
   e. **Brackets at infinity** (:func:`compare_closed_infinities`): an interval closed at an
      infinity is a different answer from one open there (``[-\\infty, 0]`` != ``(-\\infty, 0]``);
      sympy's intervals are always open at infinity, so math-verify cannot tell them apart.
   f. **math-verify**: the gold is parsed as ``\\boxed{<gold>}`` and the prediction as
      ``\\boxed{<answer>}``, both with ``[LatexExtractionConfig(boxed_match_priority=0),
      ExprExtractionConfig()]``; then ``verify(gold, pred)`` is called GOLD FIRST (verify is not
      symmetric) with ``numeric_precision=100`` (:data:`NUMERIC_PRECISION`) and
      ``allow_set_relation_comp=True``: an inequality in one variable equals the interval it
      describes, either way round (``x \\geq \\sqrt{2}`` == ``[\\sqrt{2}, \\infty)``), and
      inequalities joined by "or" are their union (``x<2 \\text{ or } x>3`` ==
      ``(-\\infty,2)\\cup(3,\\infty)``; "and" is left to math-verify, which drops it).
      math-verify's numeric test is replaced (:func:`_numeric_eq`, also inside tuples, sets,
      intervals and matrices): integers and fractions compare exactly (an integer gold is
      never matched by a rounded decimal); a decimal, or an expression that evaluates to a
      number, compares with the RELATIVE tolerance :data:`NUMERIC_REL_TOL` (``5e-10``), so a
      different last significant digit is wrong (``.0000673`` != ``.0000672``, ``0.000067`` !=
      ``.0000672``); integer expressions (sums, products and powers of integers) compare
      exactly (:func:`_integer_eq`; also in place of math-verify's ``simplify``, which ran for
      minutes on ``2^{2^{16}}``): evaluated when the value has at most about
      :data:`INT_EVAL_MAX_BITS` bits (``2^{2^{2^{2^2}}}`` == ``2^{65536}``), else compared as a base
      without perfect powers and its exponent, itself such a form in a tower (``2^{2^{100}}`` ==
      ``4^{2^{99}}``, ``7^{7^{7^7}}`` == ``7^{7^{823543}}``, ``(-2)^{3^{99}}`` == ``-2^{3^{99}}``); a comparison
      that still cannot finish ends at the time limit (-1, "timeout"), never hangs the judge;
      other exact expressions are different when their values differ relatively by
      more than :data:`EXACT_REL_TOL` (``1e-50``), so tiny values are not all equal
      (``1/2006!`` != ``1/2004!``), and closer ones keep math-verify's exact tests; a decimal
      matches an exact irrational or repeating value only when it agrees to about 10
      significant digits: ``0.5`` == ``\\frac12`` and ``0.75`` == ``\\frac34``, but ``0.3333``
      and ``0.333333`` != ``\\frac13`` and ``3.141593`` != ``\\pi``. What math-verify already did
      stays: thousands separators, ``\\dfrac``, units and degree signs stripped, ``x=5`` == ``5``.

   math-verify's signal-based timeouts are disabled (``parsing_timeout=None``,
   ``timeout_seconds=None``): the worker pool enforces the limit instead, so scoring works from
   any thread. A timeout (the comparison itself is too hard) or an exception raised by the
   comparison scores ``-1`` and logs a warning; a pool failure or a killed worker is retried with
   backoff, then reported as unscored (``nan``); nothing is raised to the caller.
5. **Ground truth** that is ``None``/empty/not a string or number, or from which
   math-verify extracts no expression (only a raw-string fallback or nothing) and that is not a
   clock time, is a DATA error: a warning naming it is logged once per distinct gold and the
   reward is ``-1`` for every response (never ``+1``, not even for an identical string). These
   functions take ONE gold; several acceptable answers (a real list, or
   ``extra_info["acceptable_answers"]``) are expanded by :func:`klear.rewards.compute_score` /
   ``compute_scores`` (:mod:`klear.rewards.gold`); a string gold is never split.
"""

from __future__ import annotations

import decimal
import logging
import math
import numbers
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from klear.rewards._timeout import RETRIED_STATUSES, TaskOutcome, TimedProcessPool, limit_worker_memory
from klear.rewards.correctness import CORRECT_REWARD, UNSCORED_REWARD, WRONG_REWARD, is_correct
from klear.rewards.think_format import THINK_CLOSE, THINK_OPEN, answer_region  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

#: Default wall-clock limit (seconds) for parsing + verifying one answer.
DEFAULT_TIMEOUT_S = 5.0
#: math-verify ``float_rounding`` (decimal places kept when a float is compared). Passed for
#: completeness only: its one use, ``sympy_numeric_eq``, is replaced by the relative rule
#: (:data:`NUMERIC_REL_TOL`, :func:`_numeric_eq`).
FLOAT_ROUNDING = 6
#: math-verify ``numeric_precision``. Its default (15) compares non-atomic expressions with
#: ``(a - b).evalf(n=15, chop=True) == 0`` and ``chop`` zeroes any difference below
#: roughly 1e-17, so ``1/2^{99}`` "equals" ``1/2^{98}``. At 100 digits only differences
#: below roughly 1e-100 are chopped.
NUMERIC_PRECISION = 100

Reason = Literal[
    "correct",  # math-verify says equivalent
    "exact_match",  # fast path: identical plain-number strings
    "wrong",  # math-verify says not equivalent
    "unparseable_answer",  # math-verify extracted nothing from the boxed answer
    "no_box",
    "unclosed_box",
    "empty_box",
    "missing_think",
    "unclosed_think",
    "multiple_think",
    "invalid_response",  # the response is not a string
    "invalid_gold",  # data error, see module docstring
    "timeout",
    "error",  # the comparison raised (or an unexpected error in the cheap checks)
    "unscored",  # the pool could not run the comparison (score nan), see the module docstring
]


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True)
class MathScoreResult:
    """Outcome of scoring one response.

    Attributes:
        score: ``1.0`` (correct), ``-1.0`` (anything else), or ``nan`` when unscored (the pool
            could not run the comparison; see the module docstring).
        reason: why, one of :data:`Reason`.
        extracted: the final boxed answer taken from the response (``None`` if none).
        detail: extra diagnostic text (exception, timeout), may be empty.
    """

    score: float
    reason: str
    extracted: str | None = None
    detail: str = ""

    @property
    def correct(self) -> bool:
        return is_correct(self.score)

    def __float__(self) -> float:
        return float(self.score)


def _wrong(reason: str, extracted: str | None = None, detail: str = "") -> MathScoreResult:
    return MathScoreResult(WRONG_REWARD, reason, extracted, detail)


def _unscored(extracted: str | None, detail: str) -> MathScoreResult:
    return MathScoreResult(UNSCORED_REWARD, "unscored", extracted, detail)


# ------------------------------------------------------------------------ extraction
@dataclass(frozen=True)
class BoxedAnswer:
    """The last top-level box of a text: ``content`` (stripped) and ``status``.

    ``status`` is ``"ok"``, ``"no_box"``, ``"unclosed"`` (the last box runs to the end of
    the text without its closing brace) or ``"empty"``; ``content`` is set only for ``"ok"``.
    """

    content: str | None
    status: Literal["ok", "no_box", "unclosed", "empty"]


_BOX_CMD_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _matching_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at *open_idx*, or None. Skips ``\\x`` escapes."""
    depth = 0
    i, n = open_idx, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_last_boxed(text: str) -> BoxedAnswer:
    """Return the content of the last top-level ``\\boxed``/``\\fbox`` in *text*.

    Boxes are scanned left to right with brace matching, so a box nested inside another
    belongs to the outer one. ``\\boxed{...}`` and ``\\fbox{...}`` take a braced group;
    ``\\boxed 18`` (no brace) takes the text up to the next ``$`` or newline. A box whose
    closing brace never comes (truncated output) is the last box and makes the result
    ``"unclosed"``, whatever came before it.

    Examples:
        >>> extract_last_boxed(r"\\boxed{1} then \\boxed{\\frac{1}{2}}").content
        '\\\\frac{1}{2}'
        >>> extract_last_boxed(r"\\boxed{1} then \\boxed{\\frac{1}").status
        'unclosed'
    """
    last = BoxedAnswer(None, "no_box")
    pos, n = 0, len(text)
    while True:
        m = _BOX_CMD_RE.search(text, pos)
        if m is None:
            return last
        i = m.end()
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return BoxedAnswer(None, "unclosed")
        if text[i] == "{":
            end = _matching_brace(text, i)
            if end is None:
                return BoxedAnswer(None, "unclosed")
            content = text[i + 1 : end]
            pos = end + 1
        else:  # "\boxed 18": one token, up to the end of the math span / line
            j = i
            while j < n and text[j] not in "$\n":
                j += 1
            content = text[i:j]
            pos = max(j, i + 1)
        content = content.strip()
        last = BoxedAnswer(content, "ok") if content else BoxedAnswer(None, "empty")


def _clean(answer: str) -> str:
    """Strip whitespace and one trailing sentence period (``17.`` -> ``17``)."""
    s = answer.strip()
    if s.endswith(".") and not s.endswith("\\.") and len(s) > 1:
        s = s[:-1].rstrip()
    return s


_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


# ----------------------------------------------------------------- equality rules
# What counts as equal, on top of math-verify (each rule is documented in the module docstring).

#: Relative tolerance for two numbers of which at least one is a decimal or neither is an exact
#: rational: equal when ``|a - b| <= NUMERIC_REL_TOL * max(|a|, |b|)``. math-verify's own rule
#: rounds both to ``float_rounding`` decimal PLACES, so ``.0000673`` "equalled" ``.0000672`` and 7
#: digits of pi "equalled" ``\pi``. Two different decimals of up to 9 significant digits differ
#: relatively by at least ``1/999999999`` (> 1e-9), twice this tolerance, so a different last
#: significant digit is always wrong; a decimal equals an exact value (``\pi``, ``1/3``) when it
#: agrees to about 10 significant digits.
NUMERIC_REL_TOL = 5e-10
#: Two EXACT expressions (no decimal in them) whose values, evaluated to ``NUMERIC_PRECISION``
#: digits, differ relatively by more than this are different, however small they are
#: (``1/2006!`` vs ``1/2004!``); closer ones are left to math-verify's exact tests, so that
#: ``9^{9^9} + 1`` is still not ``9^{9^9}``.
EXACT_REL_TOL = 1e-50

_TEXT_CMD_RE = re.compile(r"\\(text|textrm|textnormal|textup|textbf|textit|mbox|mathrm)\s*\{")
_CASELESS_TEXT_RE = re.compile(r"\\(?:text|textrm|textnormal|textup|textbf|textit|mbox)\s*\{")
_CMD_SPACE_RE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")  # "\pi r" must not become "\pir"
_LAYOUT_RE = re.compile(r"\\(?:left|right|displaystyle|quad|qquad)(?![A-Za-z])|\\[,;:! ]|[\s$~]")
#: ISO 80000-2 writes Euler's number and the imaginary unit upright; math-verify reads
#: ``\mathrm{e}`` as a unit and drops it (``2\mathrm{e}`` became ``2``, ``\frac{1}{\mathrm{e}}``
#: an unparseable ``\frac{1}{``).
_UPRIGHT_CONST_RE = re.compile(r"\\(?:mathrm|textrm|text|operatorname)\s*\{\s*([ei])\s*\}|\{\s*\\rm\s+([ei])\s*\}")
_NUMERAL_RE = re.compile(r"(-?)\(?([0-9A-Za-z]+)\)?(?:_\{?(\d+)\}?)?")
#: Delimiter sizing commands, read like ``\left``/``\right`` (math-verify could not parse
#: ``\bigl(3, -1\bigr)``); ``\bigcup``, ``\bigoplus``... are other commands and stay.
_SIZING_RE = re.compile(r"\\(?:[bB]igg?)[lrm]?(?![A-Za-z])")
#: A clock time with a meridiem, on :func:`_plain_text`: ``4:30p.m``, ``4:30PM``, ``11a.m``, ``4{:}30pm``.
_CLOCK_RE = re.compile(r"(\d{1,2})(?:\{?:\}?([0-5]\d))?(?:\{?:\}?([0-5]\d))?([ap])\.?m", re.IGNORECASE)
_BARE_MERIDIEM_RE = re.compile(r"\d{1,2}[ap]m", re.IGNORECASE)
#: An interval end closed at an infinity, on :func:`_plain_text`: ``[-\infty`` or ``\infty]``.
_CLOSED_INF_RE = re.compile(r"\[([-+]?)(?:\\infty|∞)|([-+]?)(?:\\infty|∞)\]")
#: A unit at the end of an answer, as math-verify strips it: ``\text{...}``/``\mbox{...}`` (or
#: ``\mathrm``) after a value, with an optional exponent (``^2``, ``^{2}``, ``{^2}``).
_TRAILING_UNIT_RE = re.compile(
    r"\\(?:text|textrm|textnormal|textup|mbox|mathrm)\s*\{(?P<unit>(?:\s|~|\\[,;: ])*[A-Za-z][A-Za-z. ]*)\}\s*"
    r"(?:\^\s*(?:\{\s*(?P<e1>\d+)\s*\}|(?P<e2>\d))|\{\s*\^\s*(?P<e3>\d+)\s*\})?\s*$"
)
_UNIT_POWER_WORDS = (("square", 2), ("sq", 2), ("cubic", 3), ("cube", 3), ("cu", 3))


def _strip_text_commands(s: str) -> str:
    """``\\text{4:30 p.m.}`` -> ``4:30 p.m.`` for every text-like command (brace matched)."""
    out, i = [], 0
    while (m := _TEXT_CMD_RE.search(s, i)) is not None:
        end = _matching_brace(s, m.end() - 1)
        if end is None:
            break
        out += [s[i : m.start()], _strip_text_commands(s[m.end() : end])]
        i = end + 1
    out.append(s[i:])
    return "".join(out)


def _plain_text(s: str) -> str:
    """The answer as written, without formatting: text/roman wrappers, ``$``, spacing commands,
    ``\\left``/``\\right``, whitespace and trailing periods removed; ``\\dfrac`` -> ``\\frac``."""
    s = _CMD_SPACE_RE.sub(r"\1{}", _strip_text_commands(s))
    return re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", _LAYOUT_RE.sub("", s)).rstrip(".")


def same_text(gold: str, answer: str) -> bool:
    """Rule "same text": equal when both read the same once formatting is removed
    (:func:`_plain_text`): ``4:30 \\text{ p.m.}`` == ``\\text{4:30 p.m.}``. Case-insensitive
    when the gold is (partly) a ``\\text`` answer, as math-verify is for words:
    ``\\text{Odd}`` == ``\\text{odd}``; otherwise this rule is case-sensitive. Only ever says
    "equal": answers that read differently go on to the next rules."""
    g, a = _plain_text(gold), _plain_text(answer)
    if not g:
        return False
    return g == a or (_CASELESS_TEXT_RE.search(gold) is not None and g.casefold() == a.casefold())


def _numeral(s: str) -> tuple[str, str, int | None] | None:
    """``(sign, digits, base)`` for a numeral such as ``52_8``, ``(52)_{8}``, ``\\text{A1}_{16}`` or
    ``52`` (base None); None for anything else. Digits must include a decimal digit (``b_{12}`` is
    a variable) and, with a base, be valid in it (``x_1`` is not a numeral)."""
    m = _NUMERAL_RE.fullmatch(_plain_text(s))
    if m is None or not any(c.isdigit() for c in m.group(2)):
        return None
    sign, digits, base = m.group(1), m.group(2).upper().lstrip("0") or "0", m.group(3)
    if base is None:
        return sign, digits, None
    b = int(base)
    if not 2 <= b <= 36 or any(int(c, 36) >= b for c in digits):
        return None
    return sign, digits, b


def compare_base_numerals(gold: str, answer: str) -> str | None:
    """Rule "bases": ``"correct"``/``"wrong"`` when one side is a numeral with a base subscript,
    None when the rule does not apply (math-verify drops subscripts: ``52_9`` "equalled" ``52_8``).

    Two numerals are equal when they write the same digits (leading zeros and letter case aside)
    and, if both write a base, the same base: ``52_8`` == ``52_{8}`` == ``052_8`` == ``52`` (digits
    in the base asked for), but ``52_8`` != ``52_9`` and != ``42_{10}`` (the same value written in
    another base is not the answer asked for).
    """
    g, a = _numeral(gold), _numeral(answer)
    if g is None or a is None or (g[2] is None and a[2] is None):
        return None
    if g[2] is not None and a[2] is not None and g[2] != a[2]:
        return "wrong"
    return "correct" if (g[0], g[1]) == (a[0], a[1]) else "wrong"


def upright_constants(s: str) -> str:
    """``\\mathrm{e}`` -> ``e`` and ``\\mathrm{i}`` -> ``i`` (also ``\\text``, ``\\textrm``, ``{\\rm e}``)."""
    return _UPRIGHT_CONST_RE.sub(lambda m: m.group(1) or m.group(2), s)


def strip_sizing(s: str) -> str:
    """Drop delimiter sizing commands: ``\\bigl(3,\\,-1\\bigr)`` -> ``(3,\\,-1)``, ``\\Bigl[0, 1\\Bigr)`` ->
    ``[0, 1)`` (``\\big``, ``\\Big``, ``\\bigg``, ``\\Bigg``, each also with ``l``/``r``/``m``)."""
    return _SIZING_RE.sub("", s)


def _clock(s: str) -> tuple[int, int, int, str] | None:
    """``(hour mod 12, minute, second, "a"|"p")`` for a clock time with a meridiem, else None. A bare
    ``2am``/``2PM`` (no minutes, space, periods or ``\\text``) is not one: it may be the product ``2am``."""
    if _BARE_MERIDIEM_RE.fullmatch(s.strip()):
        return None
    m = _CLOCK_RE.fullmatch(_plain_text(s))
    if m is None or not 1 <= int(m.group(1)) <= 12:
        return None
    return int(m.group(1)) % 12, int(m.group(2) or 0), int(m.group(3) or 0), m.group(4).lower()


def compare_clock_times(gold: str, answer: str) -> str | None:
    """Rule "clock": when both are clock times with a meridiem, equal means the same time:
    ``4:30 pm`` == ``\\text{4:30 PM}`` == ``4:30 \\text{ p.m.}`` (am, a.m., AM, A.M. alike; ``4 pm`` ==
    ``4:00 pm``), but ``4:30 am`` != ``4:30 p.m.``. None when either side is not such a time (a time
    without am/pm is left to the other rules)."""
    g, a = _clock(gold), _clock(answer)
    if g is None or a is None:
        return None
    return "correct" if g == a else "wrong"


def _closed_infinities(s: str) -> Counter[tuple[str, str]]:
    """The interval ends closed at an infinity: ``("[", "-")`` for ``[-\\infty``, ``("]", "+")`` for ``\\infty]``."""
    out: Counter[tuple[str, str]] = Counter()
    for m in _CLOSED_INF_RE.finditer(_plain_text(s)):
        left = m.group(1) is not None
        out["[" if left else "]", "-" if (m.group(1) if left else m.group(2)) == "-" else "+"] += 1
    return out


def compare_closed_infinities(gold: str, answer: str) -> str | None:
    """Rule "brackets at infinity": ``"wrong"`` when the two close an interval at an infinity
    differently (``[-\\infty, 0]`` != ``(-\\infty, 0]``), else None. sympy's intervals are always open
    at an infinity, so math-verify cannot see this bracket; finite ends keep math-verify's test."""
    return "wrong" if _closed_infinities(gold) != _closed_infinities(answer) else None


def _unit_exponent(s: str) -> int | None:
    """The exponent of the unit ending *s* (``15\\text{ cm}^2`` -> 2, ``15\\text{ cm}`` -> 1,
    ``15\\text{ square cm}`` -> 2), None when no unit ends it."""
    s = s.strip().rstrip(".")
    m = _TRAILING_UNIT_RE.search(s)
    if m is None or not re.search(r"[0-9A-Za-z}]", _LAYOUT_RE.sub("", s[: m.start()])):  # no value before it
        return None
    power = m.group("e1") or m.group("e2") or m.group("e3")
    if power is not None:
        return int(power)
    words = m.group("unit").replace(".", " ").casefold().split()
    return next((p for w, p in _UNIT_POWER_WORDS if w in words), 1)


def compare_unit_exponents(gold: str, answer: str) -> str | None:
    """Rule "unit exponents": when both end in a unit (``\\text{}``/``\\mbox{}``), an exponent on it
    is part of the answer: ``15\\mbox{ cm}^3`` != ``15\\mbox{ cm}^2``. math-verify strips a unit
    together with its exponent. None otherwise (a bare number still matches a number with a unit:
    ``15`` == ``15\\text{ cm}^2``; the values are compared by the next rules)."""
    g, a = _unit_exponent(gold), _unit_exponent(answer)
    if g is None or a is None or g == a:
        return None
    return "wrong"


def _relative_eq(a, b, digits: int, tol: float = NUMERIC_REL_TOL) -> bool | None:
    """Rule "relative": ``|a - b| <= tol * max(|a|, |b|)`` on values evaluated to *digits*
    significant digits (a relative error, however small the values: ``1/2006!`` is not
    ``1/2004!``). None when either side does not evaluate to a finite number."""
    try:
        va, vb = a.evalf(digits), b.evalf(digits)
        if not (va.is_number and vb.is_number and va.is_finite and vb.is_finite):
            return None
        return bool(abs(va - vb) <= tol * max(abs(va), abs(vb)))
    except Exception:  # not comparable as numbers: let math-verify decide
        return None


_OR_RE = re.compile(r"(?<![A-Za-z])or(?![A-Za-z])|\\lor(?![A-Za-z])|\\vee(?![A-Za-z])")
_AND_RE = re.compile(r"(?<![A-Za-z])and(?![A-Za-z])|\\land(?![A-Za-z])|\\wedge(?![A-Za-z])")


def _or_of_inequalities(parsed: list, latex: str) -> list:
    """Rule "or": ``x < 2 \\text{ or } x > 3`` is the union of the two solution sets. math-verify
    turns "or" (and "and") into a comma and returns a plain set of relations, which never equals
    an interval; when the text says "or" (and never "and") and every element is an inequality in
    the same single variable, that set is replaced by the union of the inequalities' sets."""
    if _OR_RE.search(latex) is None or _AND_RE.search(latex) is not None:
        return parsed
    from sympy import FiniteSet, Union
    from sympy.core.relational import Eq, Ne, Relational

    out = []
    for x in parsed:
        if (
            isinstance(x, FiniteSet)
            and len(x) > 1
            and all(isinstance(r, Relational) and not isinstance(r, (Eq, Ne)) for r in x.args)
            and len(x.free_symbols) == 1
        ):
            try:
                x = Union(*(r.as_set() for r in x.args))
            except Exception:  # leave it to math-verify
                pass
        out.append(x)
    return out


#: Integer expressions (sums, products and powers of integers) are evaluated exactly up to about
#: this many bits (Python integers: ``2^{65536}`` takes microseconds). A larger power ``b^e`` is kept
#: as its base without perfect powers and its exponent (:class:`_HugePower`).
INT_EVAL_MAX_BITS = 1 << 20
#: Largest base (in bits) whose perfect-power root is looked for in an unevaluated huge power.
_TOWER_BASE_MAX_BITS = 4096


@dataclass(frozen=True)
class _HugePower:
    """``sign * root**exponent``, too large to evaluate (more than about :data:`INT_EVAL_MAX_BITS` / 2
    bits). ``root >= 2`` is not itself a perfect power and ``exponent >= 1`` is an int or, for a
    tower such as ``7^{7^{7^7}}``, again a :class:`_HugePower` (positive). Every integer above 1 is
    ``r**e`` for exactly one such ``r``, so two such values are equal exactly when their signs and
    roots are and their exponents are equal (:func:`_int_values_eq`)."""

    sign: int
    root: int
    exponent: int | _HugePower


_IntValue = int | _HugePower


def _is_odd(v: _IntValue) -> bool:
    return v.root % 2 == 1 if isinstance(v, _HugePower) else v % 2 == 1


def _root_valuation(k: int, root: int) -> int | None:
    """``j`` with ``k == root**j`` (``k >= 1``), or None (also for ``k`` over
    :data:`_TOWER_BASE_MAX_BITS` bits)."""
    if k.bit_length() > _TOWER_BASE_MAX_BITS:
        return None
    j = 0
    while k % root == 0:
        k //= root
        j += 1
    return j if k == 1 else None


def _times_exponent(k: int, x: _IntValue) -> _IntValue | None:
    """``k * x`` for an exponent ``x >= 1`` and ``k >= 1``: exact for an int; for a huge power
    ``r^e``, ``r^{e + j}`` when ``k = r^j`` (``2 \\cdot 2^{2^{100}}``), else None (not a power form)."""
    if type(x) is int:
        return k * x
    assert isinstance(x, _HugePower)
    if k == 1:
        return x
    j = _root_valuation(k, x.root)
    if j is None or type(x.exponent) is not int:
        return None
    return _HugePower(1, x.root, x.exponent + j)


def _scaled_power(c: int, h: _HugePower) -> _IntValue | None:
    """``c * h``: ``-2^{3^{100}}`` is ``(-1, 2, 3^100)``, ``2 \\cdot 2^{2^{100}}`` is ``(1, 2, 2^100 + 1)``;
    None when ``c`` is not ``±1`` times a power of the root."""
    if c == 0:
        return 0
    sign = -h.sign if c < 0 else h.sign
    j = _root_valuation(abs(c), h.root)
    if j is None:
        return None
    if j == 0:
        return _HugePower(sign, h.root, h.exponent)
    return _HugePower(sign, h.root, h.exponent + j) if type(h.exponent) is int else None


def _power(base: _IntValue, exp: _IntValue) -> _IntValue | None:
    """``base ** exp`` (``exp >= 0``) as an int when it has at most about :data:`INT_EVAL_MAX_BITS`
    bits, else as a :class:`_HugePower`; None when no exact form is found."""
    if exp == 0:
        return 1
    if isinstance(base, _HugePower):  # (s r^e)^x = s^x r^(e x)
        if type(exp) is not int:
            return None  # a huge power to a huge power: not needed, left undecided
        e = base.exponent * exp if type(base.exponent) is int else _times_exponent(exp, base.exponent)
        return None if e is None else _HugePower(base.sign if exp % 2 else 1, base.root, e)
    if base in (0, 1):
        return base
    if base == -1:
        return -1 if _is_odd(exp) else 1
    size = abs(base).bit_length()
    if type(exp) is int and exp * size <= INT_EVAL_MAX_BITS:
        return base**exp
    if size > _TOWER_BASE_MAX_BITS:
        return None
    from sympy.ntheory import perfect_power

    root, k = perfect_power(abs(base)) or (abs(base), 1)
    e = _times_exponent(int(k), exp)
    return None if e is None else _HugePower(-1 if base < 0 and _is_odd(exp) else 1, int(root), e)


def _exact_integer(e) -> _IntValue | None:
    """The exact value of an expression made of integers, ``+``, ``*`` and powers with non-negative
    integer exponents (unevaluated, as math-verify parses them: ``2^{2^{2^{2^2}}}``), or None for
    anything else (a fraction, a symbol, a decimal) and for sums/products that would exceed
    :data:`INT_EVAL_MAX_BITS`. A power too large to evaluate is a :class:`_HugePower`:
    ``2^{2^{100}}`` -> ``(1, 2, 2^100)``, ``4^{2^{99}}`` the same; ``7^{7^{7^7}}`` -> ``(1, 7, (1, 7, 823543))``."""
    from sympy import Add, Integer, Mul, Pow

    if isinstance(e, Integer):
        return int(e)
    if isinstance(e, (Add, Mul)):
        ints: list[int] = []
        huge: list[_HugePower] = []
        for x in e.args:
            v = _exact_integer(x)
            if v is None:  # a fraction, a symbol, a decimal...: stop here
                return None
            if isinstance(v, _HugePower):
                huge.append(v)
            else:
                ints.append(v)
        if huge:  # only c * (huge power) with c = ±1 or ±root^j has a form here
            if isinstance(e, Add) or len(huge) > 1 or sum(v.bit_length() for v in ints) > _TOWER_BASE_MAX_BITS:
                return None
            return _scaled_power(math.prod(ints), huge[0])
        if isinstance(e, Add):
            total = sum(ints)
            return total if total.bit_length() <= INT_EVAL_MAX_BITS else None
        if 0 in ints:
            return 0
        if sum(v.bit_length() for v in ints) > INT_EVAL_MAX_BITS:
            return None
        prod = 1
        for v in ints:
            prod *= v
        return prod
    if isinstance(e, Pow):
        base, exp = _exact_integer(e.base), _exact_integer(e.exp)
        if base is None or exp is None or (exp.sign if isinstance(exp, _HugePower) else exp) < 0:
            return None
        return _power(base, exp)
    return None


def _int_values_eq(x: _IntValue, y: _IntValue) -> bool | None:
    """Whether two exact values (:func:`_exact_integer`) are equal; None when deciding it would need a
    value too large to build."""
    if type(x) is int and type(y) is int:
        return x == y
    if isinstance(x, _HugePower) and isinstance(y, _HugePower):
        if (x.sign, x.root) != (y.sign, y.root):
            return False
        return _int_values_eq(x.exponent, y.exponent)
    small, huge = (x, y) if type(x) is int else (y, x)
    assert type(small) is int and isinstance(huge, _HugePower)
    if type(huge.exponent) is not int:  # a tower: at least 2^(2^19) bits, far beyond any int here
        return False
    min_bits = huge.exponent * (huge.root.bit_length() - 1) + 1  # |huge| >= 2^(min_bits - 1)
    if small.bit_length() < min_bits:
        return False
    if huge.exponent * huge.root.bit_length() > 2 * INT_EVAL_MAX_BITS:
        return None
    return small == huge.sign * huge.root**huge.exponent


def _integer_eq(a, b) -> bool | None:
    """Rule "exact integers": two integer expressions (:func:`_exact_integer`) are equal exactly when
    their values are: ``2^{2^{2^{2^2}}}`` == ``2^{65536}`` == ``2^{2^{16}}`` == ``4^{32768}``, and
    ``2^{2^{100}}`` == ``4^{2^{99}}``, ``7^{7^{7^7}}`` == ``7^{7^{823543}}`` without evaluating them;
    ``2^{65536}`` != ``2^{65536} + 1``. None when either side is not such an expression or the
    comparison would need a value too large to build (left to math-verify, under the worker's
    time limit)."""
    try:
        x, y = _exact_integer(a), _exact_integer(b)
        if x is None or y is None:
            return None
        return _int_values_eq(x, y)
    except (RecursionError, MemoryError, ValueError, TypeError):
        return None


_MV_NUMERIC_EQ: Callable[..., bool] | None = None  # math-verify's own sympy_numeric_eq, for the cases left to it
_MV_SYMBOLIC_EQ: Callable[..., bool] | None = None  # math-verify's own sympy_symbolic_eq


def _numeric_eq(a, b, float_rounding: int, numeric_precision: int) -> bool:
    """Replacement for ``math_verify.grader.sympy_numeric_eq`` (installed in the workers, so it
    also applies inside tuples, sets, intervals and matrices).

    - Matrices, and exact numbers against exact numbers (``Integer``, ``Rational``): math-verify's
      exact comparison.
    - A decimal (``Float``, or a decimal percentage) against anything: an integer on the other
      side must be matched exactly (``18.0`` == ``18``; a long integer is never matched by a
      rounded float); otherwise rule "relative".
    - Two non-atomic expressions that evaluate to numbers: with a decimal in either, rule
      "relative"; both exact, different when their values differ relatively by more than
      :data:`EXACT_REL_TOL`, else math-verify's test. math-verify only tested
      ``(a - b).evalf(chop=True) == 0``, and ``chop`` zeroes any difference below ~1e-100.
    - Anything else (expressions with free symbols): math-verify's test.
    """
    from math_verify import grader
    from sympy import Float, Integer, MatrixBase, MatrixExpr, Number, Rational

    mv_numeric_eq = _MV_NUMERIC_EQ
    assert mv_numeric_eq is not None  # _install_numeric_rule saves it before installing this function
    if isinstance(a, (MatrixBase, MatrixExpr)) or isinstance(b, (MatrixBase, MatrixExpr)):
        return mv_numeric_eq(a, b, float_rounding, numeric_precision)
    exact = _integer_eq(a, b)
    if exact is not None:
        return exact
    atomic = grader.is_atomic_or_pct_atomic
    if atomic(a, Float) or atomic(b, Float):
        a, b = grader.safe_sympy_doit(a), grader.safe_sympy_doit(b)
        for x, y in ((a, b), (b, a)):
            if isinstance(x, Integer):
                return isinstance(y, Float) and Rational(y) == x
        return bool(_relative_eq(a, b, numeric_precision))
    if atomic(a, Number) or atomic(b, Number):
        return mv_numeric_eq(a, b, float_rounding, numeric_precision)
    if a.has(Float) or b.has(Float):
        verdict = _relative_eq(a, b, numeric_precision)
    else:
        different = _relative_eq(a, b, numeric_precision, EXACT_REL_TOL) is False
        verdict = False if different else None  # exact: this test only ever says "different"
    return mv_numeric_eq(a, b, float_rounding, numeric_precision) if verdict is None else verdict


def _symbolic_eq(a, b) -> bool:
    """Replacement for ``math_verify.grader.sympy_symbolic_eq`` (``simplify(a - b) == 0``): integer
    expressions are decided by rule "exact integers" (:func:`_integer_eq`) instead, because
    ``simplify`` on powers such as ``2^{2^{16}}`` runs for minutes."""
    exact = _integer_eq(a, b)
    if exact is not None:
        return exact
    mv_symbolic_eq = _MV_SYMBOLIC_EQ
    assert mv_symbolic_eq is not None  # _install_numeric_rule saves it before installing this function
    return mv_symbolic_eq(a, b)


def _install_numeric_rule() -> None:
    global _MV_NUMERIC_EQ, _MV_SYMBOLIC_EQ
    import math_verify.grader as grader

    if grader.sympy_numeric_eq is not _numeric_eq:
        _MV_NUMERIC_EQ = grader.sympy_numeric_eq
        grader.sympy_numeric_eq = _numeric_eq
    if grader.sympy_symbolic_eq is not _symbolic_eq:
        _MV_SYMBOLIC_EQ = grader.sympy_symbolic_eq
        grader.sympy_symbolic_eq = _symbolic_eq


# ------------------------------------------------------------------ worker-side code
_WORKER_CONFIG = None


def _worker_init(cap_memory: bool = False) -> None:
    """Runs once in each pool worker: import math-verify, silence its warnings about the
    signal timeouts we disable on purpose (the pool enforces the limit), install the numeric
    rule (:func:`_numeric_eq`) and, in pool workers, cap the address space (see
    ``_timeout.limit_worker_memory``)."""
    global _WORKER_CONFIG
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # Python refuses int<->str conversions above 4,300 digits (a DoS guard); math-verify
    # converts golds and answers that way, so long integer golds became "invalid_gold".
    # Here the pool's time limit bounds the cost instead.
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    _install_numeric_rule()
    _WORKER_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    if cap_memory:
        limit_worker_memory()


def _has_expression(parsed: list) -> bool:
    return any(not isinstance(x, str) for x in parsed)


def verify_answer(gold: str, answer: str, float_rounding: int, numeric_precision: int) -> str:
    """Parse and compare in the CURRENT process, without any timeout (steps 4-5 of the module
    docstring: the rules, then math-verify).

    Returns ``"correct"``, ``"wrong"``, ``"unparseable_answer"`` or ``"invalid_gold"``.
    Used inside pool workers; call it directly only on trusted input (it can hang). It installs
    the numeric rule into math-verify for the whole process.
    """
    from math_verify import parse, verify

    if _WORKER_CONFIG is None:
        _worker_init()
    gold, answer = upright_constants(strip_sizing(gold)), upright_constants(strip_sizing(answer))
    gold_parsed = _or_of_inequalities(parse("\\boxed{" + gold + "}", _WORKER_CONFIG, parsing_timeout=None), gold)
    if not _has_expression(gold_parsed) and _clock(gold) is None:  # "4:30 p.m." is an answer, not a data error
        return "invalid_gold"
    if same_text(gold, answer):
        return "correct"
    for rule in (compare_clock_times, compare_base_numerals, compare_unit_exponents, compare_closed_infinities):
        verdict = rule(gold, answer)
        if verdict is not None:
            return verdict
    pred_parsed = _or_of_inequalities(parse("\\boxed{" + answer + "}", _WORKER_CONFIG, parsing_timeout=None), answer)
    if not pred_parsed:
        return "unparseable_answer"
    ok = verify(  # GOLD FIRST: verify is not symmetric
        gold_parsed,
        pred_parsed,
        float_rounding=float_rounding,
        numeric_precision=numeric_precision,
        allow_set_relation_comp=True,  # x \geq \sqrt{2} == [\sqrt{2}, \infty), both ways
        timeout_seconds=None,
    )
    if ok:
        return "correct"
    return "wrong" if _has_expression(pred_parsed) else "unparseable_answer"


# ------------------------------------------------------------------ parent-side code
_POOL = TimedProcessPool(initializer=_worker_init, initargs=(True,), name="klear-math-reward")

_invalid_golds: set[str] = set()  # cleaned string golds math-verify cannot parse
_warned_golds: set[str] = set()  # keys already warned about (strings and non-strings)
_invalid_lock = threading.Lock()


def _reset_lock_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _invalid_lock
    _invalid_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def get_math_pool() -> TimedProcessPool:
    """The shared worker pool used by the math scorer."""
    return _POOL


def configure_math_pool(*, max_workers: int | None = None) -> None:
    """Set the number of math-verify worker processes (default ``min(8, cpu_count)`` or
    ``KLEAR_REWARD_WORKERS``). Queued work on a resized pool still completes."""
    if max_workers is not None:
        _POOL.resize(max_workers)


def shutdown_math_pool() -> None:
    """Stop the math-verify workers now; the next call starts a new pool."""
    _POOL.shutdown()


def _short(s: object, limit: int = 200) -> str:
    r = repr(s)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _flag_invalid_gold(gold: object, why: str) -> None:
    """Record a bad ground truth and log a data-error warning once per distinct gold."""
    key = ("s:" + gold) if isinstance(gold, str) else ("o:" + repr(gold))
    with _invalid_lock:
        if isinstance(gold, str):
            _invalid_golds.add(gold)
        if key in _warned_golds:
            return
        _warned_golds.add(key)
    logger.warning(
        "math reward: unusable ground truth %s (%s); every response to it scores -1. "
        "This is a data error: fix or drop the example.",
        _short(gold),
        why,
    )


def _gold_string(ground_truth: object) -> str | None:
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Integral) and not isinstance(ground_truth, bool):
        return str(decimal.Decimal(int(ground_truth)))  # str(int) fails above 4,300 digits
    if isinstance(ground_truth, numbers.Number) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    return None


def final_answer(solution_str: str, *, require_think: bool = False) -> tuple[str | None, str]:
    """The answer the math judge reads: the raw content of the last ``\\boxed{}`` in the think format's
    answer region (steps 1-2 of the module docstring).

    Args:
        solution_str: the decoded response.
        require_think: the think block is mandatory (:func:`klear.rewards.think_format.requires_think`
            decides it from the data source).

    Returns:
        ``(content, "")``, or ``(None, reason)`` with the judge's reason: ``missing_think``,
        ``unclosed_think``, ``multiple_think``, ``no_box``, ``unclosed_box``, ``empty_box``.
    """
    region, reason = answer_region(solution_str, require_think=require_think)
    if region is None:
        return None, reason or "missing_think"
    boxed = extract_last_boxed(region)
    if boxed.status != "ok" or boxed.content is None:
        return None, {"no_box": "no_box", "unclosed": "unclosed_box"}.get(boxed.status, "empty_box")
    return boxed.content, ""


@dataclass(frozen=True)
class _Job:
    gold: str
    answer: str  # cleaned boxed content sent to math-verify
    extracted: str  # raw boxed content, for the result


def _prepare(solution_str: object, ground_truth: object, require_think: bool) -> MathScoreResult | _Job:
    """All the cheap, in-process checks. Returns a final result or a job for the pool."""
    gold = _gold_string(ground_truth)
    if gold is None or not gold.strip():
        _flag_invalid_gold(ground_truth, "empty, or not a string or number")
        return _wrong("invalid_gold")
    gold_clean = _clean(gold)
    if gold_clean in _invalid_golds:  # already known bad: skip the worker
        return _wrong("invalid_gold")
    if not isinstance(solution_str, str):
        return _wrong("invalid_response")
    extracted, reason = final_answer(solution_str, require_think=require_think)
    if extracted is None:
        return _wrong(reason)
    answer = _clean(extracted)
    if not answer:
        return _wrong("empty_box", extracted)
    if answer == gold_clean and _PLAIN_NUMBER_RE.fullmatch(gold_clean):
        return MathScoreResult(CORRECT_REWARD, "exact_match", extracted)
    return _Job(gold_clean, answer, extracted)


def _finish(job: _Job, outcome: TaskOutcome) -> MathScoreResult:
    if outcome.ok:
        verdict = outcome.value
        if verdict == "correct":
            return MathScoreResult(CORRECT_REWARD, "correct", job.extracted)
        if verdict == "invalid_gold":
            _flag_invalid_gold(job.gold, "math-verify extracts no expression from it")
            return _wrong("invalid_gold", job.extracted)
        if verdict in ("wrong", "unparseable_answer"):
            return _wrong(verdict, job.extracted)
        return _wrong("error", job.extracted, f"unexpected verdict {verdict!r}")
    if outcome.status in RETRIED_STATUSES:  # the pool's failure, not the answer's: never -1
        logger.warning(
            "math reward: %s (%s) while verifying answer %s against gold %s; unscored (nan)",
            outcome.status,
            outcome.detail,
            _short(job.answer),
            _short(job.gold),
        )
        return _unscored(job.extracted, f"{outcome.status}: {outcome.detail}")
    reason = "timeout" if outcome.status == "timeout" else "error"
    logger.warning(
        "math reward: %s (%s) while verifying answer %s against gold %s; scoring -1",
        outcome.status,
        outcome.detail,
        _short(job.answer),
        _short(job.gold),
    )
    return _wrong(reason, job.extracted, f"{outcome.status}: {outcome.detail}")


def _check_timeout(timeout_s: float) -> float:
    if timeout_s is None or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def math_score_detailed(
    solution_str: str, ground_truth: str, *, require_think: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> MathScoreResult:
    """Score one response and say why (see :func:`math_score` for the rules).

    Returns:
        :class:`MathScoreResult` with ``score`` 1.0, -1.0 or nan (unscored), ``reason``, the
        extracted boxed answer and diagnostics.

    Raises:
        ValueError: ``timeout_s`` is not positive. Nothing else: a timeout or an exception of the
            verification becomes ``-1``, a pool failure (after the retries) ``nan``, each with a logged
            warning.
    """
    timeout_s = _check_timeout(timeout_s)
    try:
        prepared = _prepare(solution_str, ground_truth, require_think)
    except Exception as exc:  # never crash the trainer
        logger.warning("math reward: unexpected error %r; scoring -1", exc)
        return _wrong("error", detail=repr(exc))
    if isinstance(prepared, MathScoreResult):
        return prepared
    outcome = _POOL.run(
        verify_answer,
        (prepared.gold, prepared.answer, FLOAT_ROUNDING, NUMERIC_PRECISION),
        timeout_s=timeout_s,
    )
    return _finish(prepared, outcome)


def math_score(
    solution_str: str, ground_truth: str, *, require_think: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> float:
    """Klear-Reasoner's binary math reward (paper Sec. 3.2.4, via math-verify).

    Args:
        solution_str: the model's response (decoded text, prompt excluded).
        ground_truth: the reference answer, e.g. ``"18"`` or ``"\\frac{1}{2}"`` (a number
            is accepted too). It is wrapped as ``\\boxed{...}`` before parsing.
        require_think: if True, a response without a closing ``</think>`` scores -1
            (the paper penalises answers not preceded by a think block).
        timeout_s: wall-clock limit for math-verify (parsing + comparison), enforced in a
            worker process, so it works from any thread.

    Returns:
        ``1.0`` if the last ``\\boxed{}`` answer (after the last ``</think>``) is
        equivalent to ``ground_truth`` according to ``math_verify.verify(gold, pred)``;
        ``-1.0`` otherwise: wrong, no/empty/unclosed box, unclosed or (when required)
        missing think block, unparseable answer, unusable ground truth (logged once as a
        data error), timeout or an exception of the comparison (logged); ``nan`` (unscored) when
        the worker pool could not run the comparison after its retries (logged).

    Raises:
        ValueError: ``timeout_s`` is not positive. Scoring failures never raise.

    Thread-safe; the first call starts the worker pool (about a second with ``spawn``).
    """
    return math_score_detailed(solution_str, ground_truth, require_think=require_think, timeout_s=timeout_s).score


def math_score_batch_detailed(
    solution_strs: Sequence[str],
    ground_truths: Sequence[str],
    *,
    require_think: bool | Sequence[bool] = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_workers: int | None = None,
) -> list[MathScoreResult]:
    """Score many responses in parallel on the worker pool, preserving order.

    Each item is independent: its own time limit, its own failure handling; one
    pathological answer never changes another item's result. ``require_think`` may be a
    single bool or one per item. ``max_workers`` resizes the shared pool (see
    :func:`configure_math_pool`).

    Raises:
        ValueError: the sequences differ in length, or ``timeout_s`` is not positive.
    """
    timeout_s = _check_timeout(timeout_s)
    n = len(solution_strs)
    if len(ground_truths) != n:
        raise ValueError(f"got {n} responses but {len(ground_truths)} ground truths")
    if isinstance(require_think, bool):
        think_flags: Sequence[bool] = [require_think] * n
    else:
        think_flags = list(require_think)
        if len(think_flags) != n:
            raise ValueError(f"got {n} responses but {len(think_flags)} require_think flags")
    if max_workers is not None:
        configure_math_pool(max_workers=max_workers)

    results: list[MathScoreResult | None] = [None] * n
    pending: list[tuple[int, _Job]] = []
    for i in range(n):
        try:
            prepared = _prepare(solution_strs[i], ground_truths[i], bool(think_flags[i]))
        except Exception as exc:
            logger.warning("math reward: unexpected error %r on item %d; scoring -1", exc, i)
            prepared = _wrong("error", detail=repr(exc))
        if isinstance(prepared, MathScoreResult):
            results[i] = prepared
        else:
            pending.append((i, prepared))

    outcomes = _POOL.run_many(
        verify_answer,
        [(job.gold, job.answer, FLOAT_ROUNDING, NUMERIC_PRECISION) for _, job in pending],
        timeout_s=timeout_s,
    )
    for (i, job), outcome in zip(pending, outcomes, strict=True):
        results[i] = _finish(job, outcome)
    return [r if r is not None else _wrong("error") for r in results]


def math_score_batch(solution_strs: Sequence[str], ground_truths: Sequence[str], **options: Any) -> list[float]:
    """Batch form of :func:`math_score`: a list of 1.0 / -1.0 (nan: unscored) in input order.

    ``options`` are :func:`math_score_batch_detailed`'s keywords (``require_think``, ``timeout_s``,
    ``max_workers``), which also gives the parallelism and errors.
    """
    return [r.score for r in math_score_batch_detailed(solution_strs, ground_truths, **options)]
