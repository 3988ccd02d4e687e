"""Reading a whole row file for a training stage, and the row checks the stages share.

Every stage reads files through :func:`klear.data.io.iter_records` (JSONL, JSON, their ``.gz``
forms, parquet). ``klear data`` streams them; ``klear rl`` and ``klear sft`` load them whole with
:func:`read_rows`. Rows are numbered from 0 over the rows (blank JSONL lines not counted), and
every error names ``<file>: row N: field 'X' is ... (expected ...)``; an error in the text of a
JSONL line (invalid JSON, not UTF-8) also gives its 1-based line: ``<file>: line L (row N): ...``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from klear.data.io import iter_records
from klear.data.text import short_repr

__all__ = ["VALID_ROLES", "check_messages", "read_rows"]

#: Chat roles a message may have.
VALID_ROLES = ("system", "user", "assistant", "tool")


def read_rows(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """All rows of a row file as ``[(where, row)]``, ``where`` = ``"<path>: row N"`` (N from 0).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a directory, an empty file, invalid JSON, text that is not UTF-8, or a row
            that is not a JSON object (each names the file, and the row/line where there is one).
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p}: is a directory (expected a .jsonl, .json or .parquet file, optionally .gz)")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    rows = [(f"{p}: row {rec.row}", rec.data) for rec in iter_records(p)]
    if not rows:
        raise ValueError(f"{p}: no rows (empty file)")
    return rows


def check_messages(where: str, field: str, value: Any, *, allow_string: bool = False) -> list[dict]:
    """A row's chat messages, checked: a non-empty list of ``{"role", "content"}`` dicts.

    Args:
        where: ``"<file>: row N"``, the start of every error.
        field: the field's name in the row (``prompt``, ``messages``, ...).
        value: the field's value.
        allow_string: a non-empty string is taken as one user message.

    Returns:
        ``[{"role": str, "content": str}]`` (other keys dropped).

    Raises:
        ValueError: ``<where>: field '<field>[j].role' is ... (expected one of ...)`` and the like.
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
    return out
