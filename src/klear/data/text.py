"""Prompt text of a row, and the two normalisations of ``klear data`` (dedup and 9-gram decontamination,
paper Sec. 3.1).

Which text a row stands for (:func:`row_text`)
----------------------------------------------
With ``field=None`` (the default of every ``klear data`` command):

1. ``prompt`` or ``messages`` holding a chat list (``[{"role", "content"}, ...]``, the verl RL
   layout and the chat SFT layout): the content of the LAST ``user`` message (few-shot
   demonstrations come before the problem; in an SFT conversation the last user turn is the
   one the response answers);
2. else the first of ``problem``, ``question``, ``prompt`` that is a string.

An explicit field is a dotted path (``extra_info.question``); its value may be a string or a
chat list (then again the last user message). Benchmark files are read with the same rule
(AIME ``messages``, MATH ``problem``, GSM8K ``question``). A row that gives no text fails
with ``<file>: row N: field 'X' ...``.

Dedup key (:func:`normalize_for_dedup`)
---------------------------------------
Unicode NFKC, then ``str.casefold`` (lower case, also ``ß`` -> ``ss``), then every run of
Unicode whitespace (spaces, tabs, line breaks) becomes one space and the ends are stripped.
Nothing else changes: punctuation and LaTeX stay, so ``x^2`` and ``x^3`` differ.

n-gram tokens (:func:`ngram_tokens`), the decontamination tokenisation
----------------------------------------------------------------------
1. superscript/subscript digits become ``^d`` / ``_d`` (so ``x²`` reads like ``x^2``);
2. Unicode NFKC, then ``str.casefold``;
3. LaTeX canonicalisation: ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\dbinom``/``\\tbinom``
   -> ``\\binom``, ``\\le``/``\\ge`` -> ``\\leq``/``\\geq``, and the presentation-only commands
   ``\\left \\right \\big.. \\displaystyle \\textstyle \\text \\textbf \\textit \\mathrm \\mathbf
   \\mathit \\operatorname \\mbox`` are removed (their braced argument stays);
4. tokens are the maximal runs of Unicode letters and digits (``[^\\W_]+``), except that each
   CJK ideograph, kana or hangul syllable is a token of its own. Everything else separates
   tokens: whitespace and line breaks (so a problem re-wrapped across lines gives the same
   tokens), punctuation, ``_``, ``^``, braces, backslashes and the math delimiters ``$``,
   ``$$``, ``\\(``, ``\\)``, ``\\[``, ``\\]``. Hence ``$x^2$``, ``x^2``, ``\\(x^{2}\\)`` and
   ``x²`` are all ``["x", "2"]``, and ``\\frac{1}{2}`` is ``["frac", "1", "2"]``.

The token list of a whole text is one sequence: n-grams run across line breaks and
sentences. Known limits: ``1,000`` is ``["1", "000"]`` but ``1000`` is ``["1000"]``; operators
(``+ - = <``) are separators, so ``a+b`` and ``a-b`` both read ``["a", "b"]``; scripts written
without spaces other than CJK (e.g. Thai) form one token per run.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "DEFAULT_TEXT_FIELDS",
    "VALID_ROLES",
    "check_messages",
    "dedup_digest",
    "get_path",
    "last_user_message",
    "messages_text",
    "ngram_tokens",
    "normalize_for_dedup",
    "normalize_for_ngrams",
    "row_text",
    "short_repr",
    "tokens_of_normalized",
]

DEFAULT_TEXT_FIELDS = ("problem", "question", "prompt")
"""String fields tried, in order, when a row has no chat ``prompt``/``messages`` list."""

_SCRIPT_DIGITS = {
    **{ord(c): f" ^{d} " for c, d in zip("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")},
    **{ord(c): f" _{d} " for c, d in zip("₀₁₂₃₄₅₆₇₈₉", "0123456789")},
}
_LATEX_DROP = re.compile(
    r"\\(?:left|right|bigl|bigr|biggl|biggr|big|bigg|displaystyle|textstyle|textbf|textit|textrm|text|"
    r"mathrm|mathbf|mathit|operatorname|mbox)(?![a-z])"
)
_LATEX_CANON = re.compile(r"\\(?:[dt](frac|binom)|(le|ge)(?![a-z]))")
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
TOKEN_PATTERN = rf"[{_CJK}]|[^\W_{_CJK}]+"
_TOKEN_RE = re.compile(TOKEN_PATTERN)
# ASCII fast path of the same rule: letters/digits stay, every other ASCII character separates.
# (``str.translate`` + ``str.split`` is ~3x faster than the regex on ASCII text.)
ASCII_SEPARATORS = str.maketrans({i: (chr(i) if chr(i).isalnum() else " ") for i in range(128)})


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (for error messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def get_path(row: Mapping, path: str, default: Any = None) -> Any:
    """The value at a dotted path (``"reward_model.ground_truth"``) of a row, or ``default``."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, Mapping) for m in value)


#: The chat roles a message may have (every reader of chat rows checks against these).
VALID_ROLES = ("system", "user", "assistant", "tool")


def check_messages(
    where: str, field: str, value: Any, *, allow_string: bool = False, require_user: bool = False
) -> list[dict]:
    """A row's chat messages, checked: a non-empty list of ``{"role", "content"}`` dicts.

    Args:
        where: ``"<file>: row N"``, the start of every error.
        field: the field's name in the row (``prompt``, ``messages``, ...).
        value: the field's value.
        allow_string: a non-empty string is taken as one user message.
        require_user: at least one message must have the role ``user``.

    Returns:
        ``[{"role": str, "content": str}]`` (other keys dropped).

    Raises:
        ValueError: ``<where>: field '<field>[j].role' is ... (expected one of ...)`` and the like; with
            ``require_user``, ``<where>: field '<field>' has no message with role 'user' ...``.
    """
    expected = "a non-empty list of {'role', 'content'} messages" + (", or a string" if allow_string else "")
    if allow_string and isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field '{field}' is an empty string (expected {expected})")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: field '{field}' is {type(value).__name__} {short_repr(value)} (expected {expected})"
        )
    out = []
    for j, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise ValueError(
                f"{where}: field '{field}[{j}]' is {type(msg).__name__} {short_repr(msg)} "
                f"(expected a {{'role', 'content'}} dict)"
            )
        role, content = msg.get("role"), msg.get("content")
        if role not in VALID_ROLES:
            raise ValueError(
                f"{where}: field '{field}[{j}].role' is {short_repr(role)} (expected one of {VALID_ROLES})"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: field '{field}[{j}].content' is {type(content).__name__} "
                f"{short_repr(content)} (expected a string)"
            )
        out.append({"role": role, "content": content})
    if require_user and not any(m["role"] == "user" for m in out):
        raise ValueError(
            f"{where}: field '{field}' has no message with role 'user' (expected a chat list with a user message)"
        )
    return out


def last_user_message(where: str, field: str, messages: Sequence[Any]) -> str:
    """Content of the last ``user`` message of a chat list (checked by :func:`check_messages`).

    Raises:
        ValueError: as :func:`check_messages` with ``require_user``; the message names ``where``
            (``<file>: row N``) and the field.
    """
    checked = check_messages(where, field, list(messages), require_user=True)
    return [m["content"] for m in checked if m["role"] == "user"][-1]


def row_text(row: Any, where: str, field: str | None = None) -> str:
    """The text a row stands for (see the module docstring for the rule).

    Args:
        row: one record (a dict).
        where: ``"<file>: row N"`` for error messages.
        field: a dotted field path to use instead of the default rule.

    Returns:
        The text (may be empty only if the field holds an empty string).

    Raises:
        ValueError: the row is not an object, the field is missing or has the wrong type, or
            (default rule) no chat list and no string ``problem``/``question``/``prompt`` exists.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: is {type(row).__name__} {short_repr(row)} (expected a JSON object)")
    if field is not None:
        value = get_path(row, field, _MISSING)
        if value is _MISSING or value is None:
            raise ValueError(f"{where}: field '{field}' is missing (expected a string or a chat list)")
        if isinstance(value, str):
            return value
        if _is_chat(value):
            return last_user_message(where, field, value)
        raise ValueError(
            f"{where}: field '{field}' is {type(value).__name__} {short_repr(value)} "
            f"(expected a string or a non-empty chat list of {{'role', 'content'}} messages)"
        )
    for name in ("prompt", "messages"):
        value = row.get(name)
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{where}: field '{name}' is an empty list (expected a chat list with a user message)")
            return last_user_message(where, name, value)
    for name in DEFAULT_TEXT_FIELDS:
        value = row.get(name)
        if isinstance(value, str):
            return value
    present = [k for k in ("prompt", "messages", *DEFAULT_TEXT_FIELDS) if k in row]
    if present:
        k = present[0]
        raise ValueError(
            f"{where}: field '{k}' is {type(row[k]).__name__} {short_repr(row[k])} (expected a "
            f"chat list with a user message, or a string)"
        )
    raise ValueError(
        f"{where}: field 'prompt' is missing (expected a chat 'prompt'/'messages' list with a "
        f"user message, or a string 'problem', 'question' or 'prompt'; or pass --text-field)"
    )


_MISSING = object()


def messages_text(row: Any, where: str, field: str | None = None) -> str:
    """Every chat message of a row, role-tagged (``"user: ...\\nassistant: ..."``), for a
    whole-conversation dedup key. Uses the ``prompt`` and ``messages`` chat lists (both, in that
    order) and any string ``response``/``completion``; without any of them, :func:`row_text`.

    Raises:
        ValueError: as :func:`row_text`, or a malformed message.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: is {type(row).__name__} {short_repr(row)} (expected a JSON object)")
    parts: list[str] = []
    for name in ("prompt", "messages"):
        value = row.get(name)
        if isinstance(value, (list, tuple)):
            for j, msg in enumerate(value):
                if not isinstance(msg, Mapping) or not isinstance(msg.get("content"), str):
                    raise ValueError(
                        f"{where}: field '{name}[{j}]' is {short_repr(msg)} (expected a "
                        f"{{'role', 'content'}} dict with string content)"
                    )
                parts.append(f"{msg.get('role')}: {msg['content']}")
    for name in ("response", "completion"):
        if isinstance(row.get(name), str):
            parts.append(f"{name}: {row[name]}")
    if not parts:
        return row_text(row, where, field)
    return "\n".join(parts)


def normalize_for_dedup(text: str) -> str:
    """NFKC + casefold + whitespace runs collapsed to one space, ends stripped (module docstring)."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def dedup_digest(text: str) -> bytes:
    """16-byte BLAKE2b digest of :func:`normalize_for_dedup` (collision odds ~1e-25 at 10^7 rows)."""
    return hashlib.blake2b(normalize_for_dedup(text).encode("utf-8"), digest_size=16).digest()


def _latex_canon(match: re.Match) -> str:
    return "\\" + (match.group(1) or match.group(2) + "q")


def normalize_for_ngrams(text: str) -> str:
    """Steps 1-3 of the n-gram tokenisation (module docstring): a string to run the token
    pattern over. Works on a concatenation of texts too (it never joins across a ``\\x00``)."""
    text = unicodedata.normalize("NFKC", text.translate(_SCRIPT_DIGITS)).casefold()
    if "\\" in text:
        text = _LATEX_DROP.sub(" ", text)
        text = _LATEX_CANON.sub(_latex_canon, text)
    return text


def tokens_of_normalized(text: str) -> list[str]:
    """Step 4 of the n-gram tokenisation on an already normalised text."""
    if text.isascii():
        return text.translate(ASCII_SEPARATORS).split()
    return _TOKEN_RE.findall(text)


def ngram_tokens(text: str) -> list[str]:
    """The decontamination tokens of a text (module docstring). ``$x^2$`` -> ``["x", "2"]``."""
    return tokens_of_normalized(normalize_for_ngrams(text))
