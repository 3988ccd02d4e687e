"""Exact deduplication of prompts (paper Sec. 3.1: exact-match removal of duplicate queries).

Two rows are duplicates when their keys are equal after :func:`klear.data.text.normalize_for_dedup`
(Unicode NFKC, casefold, whitespace runs collapsed, ends stripped). The first row is kept; every
later copy is removed and listed with the row it duplicates.

Keys (``by``):

* ``"text"`` (default): the prompt text by the rule of :func:`klear.data.text.row_text` (the last
  user message of ``prompt``/``messages``, else ``problem``/``question``/``prompt``; or
  ``text_field``). Use it for RL prompt sets.
* ``"conversation"``: every chat message (role-tagged) of ``prompt`` and ``messages`` plus any
  ``response``/``completion`` string. Use it for SFT sets with several responses per prompt,
  where ``text`` would keep only the first response of each prompt.

Memory: a 16-byte digest and the first row number per distinct key (about 120 bytes a row in
CPython), so 10M distinct rows need ~1.2 GB.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from klear.data.io import Record
from klear.data.pipeline import Drop, run_rows, where
from klear.data.text import dedup_digest, messages_text, row_text

__all__ = ["DEDUP_KEYS", "dedup_file"]

DEDUP_KEYS = ("text", "conversation")


def dedup_file(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    *,
    by: str = "text",
    text_field: str | None = None,
    progress: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data dedup``: copy ``inp`` to ``out`` without exact duplicates (first kept).

    Args:
        inp: rows (.jsonl/.json/.parquet), any layout with a prompt text.
        out: kept rows (.jsonl/.parquet); also ``out.report.json`` and ``out.removed.jsonl``
            (``reason: "duplicate"``, ``duplicate_of``: the kept row's number).
        by: ``"text"`` or ``"conversation"`` (module docstring).
        text_field: dotted field holding the text (``by="text"``; default rule otherwise).

    Returns:
        The report (``rows_in``, ``rows_out``, ``removed``, ``distinct``, ``params``).

    Raises:
        FileNotFoundError: no input.
        ValueError: unknown ``by`` or a row without the text (file, row and field named).
    """
    started = time.perf_counter()
    if by not in DEDUP_KEYS:
        raise ValueError(f"by must be one of {DEDUP_KEYS}, got {by!r}")
    seen: dict[bytes, int] = {}
    key_of = row_text if by == "text" else messages_text

    def decide(batch: Sequence[Record]) -> list[Drop | None]:
        out_: list[Drop | None] = []
        for rec in batch:
            digest = dedup_digest(key_of(rec.data, where(inp, rec), text_field))
            first = seen.setdefault(digest, rec.row)
            out_.append(None if first == rec.row else Drop("duplicate", {"duplicate_of": first}))
        return out_

    return run_rows(
        inp,
        out,
        "dedup",
        decide,
        params={"by": by, "text_field": text_field, "normalisation": "NFKC, casefold, whitespace collapsed"},
        extra=lambda: {"distinct": len(seen)},
        progress=progress,
        quiet=quiet,
        started=started,
    )
