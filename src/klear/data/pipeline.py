"""The streaming driver shared by the row-by-row ``klear data`` commands (dedup, filters, select).

:func:`run_rows` reads the input in batches, asks a ``decide`` function about each batch,
writes the kept rows, lists every removed row with its reason in ``OUT.removed.jsonl`` and
writes ``OUT.report.json`` (see :mod:`klear.data.io`). Nothing is dropped without a reason.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klear.data.io import (
    Record,
    RemovedLog,
    RowWriter,
    check_in_out,
    count_rows,
    iter_batches,
    parquet_schema,
    row_id,
    write_report,
)

__all__ = ["Drop", "run_rows"]


@dataclass
class Drop:
    """A removal decision: the reason (a short snake_case word) and JSON-able details."""

    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


DecideBatch = Callable[[Sequence[Record]], Sequence["Drop | None"]]


def run_rows(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    command: str,
    decide: DecideBatch,
    *,
    params: dict[str, Any],
    modifies: bool = False,
    extra: Callable[[], dict[str, Any]] | None = None,
    id_fields: Sequence[str] | None = None,
    batch_size: int = 4096,
    progress: bool = True,
    quiet: bool = False,
    started: float | None = None,
) -> dict[str, Any]:
    """Stream ``inp`` to ``out`` keeping the rows ``decide`` does not drop.

    Args:
        inp, out: input and output files (see :mod:`klear.data.io` for formats).
        command: the command name for the report (``"dedup"``, ``"filter min-tests"``, ...).
        decide: ``decide(records) -> [Drop | None, ...]`` for one batch (same order). It may
            change ``record.data`` in place when ``modifies`` (the row is then re-serialised).
        params: the parameters to record in the report.
        modifies: rows may be changed (JSONL rows are then written from ``data``; a parquet
            output infers its schema).
        extra: called at the end; its dict is merged into the report.
        id_fields: fields for the ``id`` of removed rows (default :data:`klear.data.io.DEFAULT_ID_FIELDS`).
        batch_size, progress, quiet: streaming batch size, tqdm bar, no summary line.
        started: ``time.perf_counter()`` of the command's start (default: now).

    Returns:
        The report dict.

    Raises:
        FileNotFoundError / ValueError: from the input, the output path or ``decide``.
    """
    from tqdm import tqdm

    started = time.perf_counter() if started is None else started
    inp, out = check_in_out(inp, out)
    removed = RemovedLog(out)
    rows_in = 0
    id_kw = {} if id_fields is None else {"fields": id_fields}
    bar = tqdm(total=count_rows(inp), unit="rows", desc=command, disable=not progress, mininterval=1.0)
    try:
        with RowWriter(out, schema=None if modifies else parquet_schema(inp)) as writer:
            for batch in iter_batches(inp, batch_size):
                decisions = decide(batch)
                if len(decisions) != len(batch):
                    raise RuntimeError(f"{command}: {len(decisions)} decisions for {len(batch)} rows")
                for rec, drop in zip(batch, decisions):
                    if drop is None:
                        if modifies:
                            rec.raw = None
                        writer.write(rec)
                    else:
                        removed.add(rec.row, drop.reason, row_id(rec.data, **id_kw), **drop.detail)
                rows_in += len(batch)
                bar.update(len(batch))
    except BaseException:
        removed.abort()
        raise
    finally:
        bar.close()
    removed_file = removed.close()
    report: dict[str, Any] = {
        "command": command,
        "input": str(inp),
        "output": str(out),
        "rows_in": rows_in,
        "rows_out": writer.count,
        "removed": dict(removed.counts),
        "removed_rows_file": str(removed_file) if removed_file else None,
        "params": params,
    }
    if extra is not None:
        report.update(extra())
    write_report(out, report, started=started, quiet=quiet)
    return report


def where(path: str | os.PathLike | Path, rec: Record) -> str:
    """``"<file>: row N"`` for error messages."""
    return f"{path}: row {rec.row}"
