"""Reading a whole row file for a training stage, and the row checks the stages share.

Every stage reads files through :func:`klear.data.io.iter_records` (JSONL, JSON, their ``.gz``
forms, parquet). ``klear data`` streams them; ``klear rl`` and ``klear sft`` load them whole with
:func:`read_rows`. Rows are numbered from 0 over the rows (blank JSONL lines not counted), and
every error names ``<file>: row N: field 'X' is ... (expected ...)``; an error in the text of a
JSONL line (invalid JSON, not UTF-8) also gives its 1-based line: ``<file>: line L (row N): ...``.
"""

from __future__ import annotations

import os
from pathlib import Path

from klear.data.io import iter_records

__all__ = ["read_rows"]


#: Chat roles a message may have.
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
