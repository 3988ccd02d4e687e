"""Output comparison: whether a program's answer equals a test's expected answer.

klear's judge rules (the paper only says a test passes or fails, Sec. 3.2.4):

- ``stdio`` tests (:func:`outputs_match`): token by token, so whitespace and blank lines never
  matter. An expected integer token must be printed exactly (as text: integers of any length
  work, and ``1000000000.0`` never passes for ``1000000007``); an expected non-integer number
  is matched by any finite float within ``float_tol`` (absolute or relative, default
  :data:`DEFAULT_FLOAT_TOL`; ``0`` = numeric equality).
- ``call`` tests (:func:`values_match`): tuples compare as lists, with the same number rules.
- ``case_insensitive`` (a ground-truth field, for statements such as Codeforces' "You can
  output YES and NO in any case"): tokens (``call``: strings) equal after ``str.casefold``
  match. It applies to EVERY token, so set it only for problems whose statement says so; loading
  code rows sets it from the statement (:func:`klear.data.code_data.with_statement_case_rule`).
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

#: Default ``float_tol`` of a ground truth: absolute, or relative for ``|expected| > 1``.
DEFAULT_FLOAT_TOL = 1e-6

_TOKEN = re.compile(r"\S+")


def _float_token(tok: str) -> float | None:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _is_int_token(tok: str) -> bool:
    t = tok[1:] if tok[:1] in "+-" else tok
    return t.isdigit()


def _close(a: float, b: float, tol: float) -> bool:
    return a == b or abs(a - b) <= tol * max(1.0, abs(b))


def outputs_match(
    actual: str | bytes, expected: str, float_tol: float = DEFAULT_FLOAT_TOL, case_insensitive: bool = False
) -> bool:
    """Token-wise comparison of a program's stdout with the expected output.

    Whitespace (trailing spaces, blank lines, ``\\r``) never matters. Tokens equal as text match.
    An expected integer token must be matched exactly (as text: 5000-digit integers are fine, and
    ``1000000000.0`` never passes for ``1000000007``). Otherwise, when the expected token is a
    non-integer number, both must parse as finite floats with ``|a - b| <= float_tol * max(1, |b|)``.
    With ``case_insensitive`` tokens equal after ``str.casefold`` match too (``yes`` for ``YES``).
    *actual* bytes are decoded as UTF-8 (invalid bytes replaced).
    """
    if isinstance(actual, bytes):
        actual = actual.decode("utf-8", errors="replace")
    # token streams (no list of millions of tokens for a 30 MB output)
    a = (m.group(0) for m in _TOKEN.finditer(actual))
    e = (m.group(0) for m in _TOKEN.finditer(expected))
    for x, y in itertools.zip_longest(a, e):  # tokens are str: None marks the shorter stream's end
        if x is None or y is None:
            return False
        if x == y or (case_insensitive and x.casefold() == y.casefold()):
            continue
        if _is_int_token(y):  # an integer answer must be printed exactly (1e9 is not 1000000007)
            return False
        fx, fy = _float_token(x), _float_token(y)
        if fx is None or fy is None or not _close(fx, fy, float_tol):
            return False
    return True


def values_match(
    actual: Any, expected: Any, float_tol: float = DEFAULT_FLOAT_TOL, case_insensitive: bool = False
) -> bool:
    """Equality for call-based results: tuples compare as lists, an expected float is matched within
    ``float_tol`` by an int or float, an expected int only by the same int (bools are never
    numbers here); with ``case_insensitive`` strings (not dict keys) equal after ``casefold``
    match. *actual* must already be plain data (decoded)."""
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(expected, tuple):
        expected = list(expected)
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int):  # integer answers are exact (a float 1e9 is not 1000000007)
        return isinstance(actual, int) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, float):
        return math.isfinite(actual) and math.isfinite(expected) and _close(float(actual), float(expected), float_tol)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            values_match(x, y, float_tol, case_insensitive) for x, y in zip(actual, expected)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            values_match(actual[k], expected[k], float_tol, case_insensitive) for k in actual
        )
    if case_insensitive and type(actual) is str and type(expected) is str:
        return actual.casefold() == expected.casefold()
    return type(actual) in (str, type(None), set, frozenset) and actual == expected
