"""Streaming row files for ``klear data``: JSONL / JSON / parquet in, JSONL / parquet out.

Formats (chosen by the file name):

* ``.jsonl`` (also ``.jsonl.gz``): one UTF-8 JSON object per line, read line by line; blank
  lines are skipped; kept rows are written back as their ORIGINAL line (byte-for-byte, less a
  trailing carriage return) when the output is JSONL and the command did not change the row;
* ``.json`` (also ``.json.gz``): a JSON array of objects (read whole) or JSON lines;
* ``.parquet``: read in record batches with pyarrow; written with a ``ParquetWriter`` in batches
  (the input schema is reused when rows pass through unchanged).

Any layout works (the verl RL layout ``prompt``/``data_source``/``reward_model``/``extra_info``
and the chat SFT layout ``messages``); each command validates the fields it reads. Row numbers
are 0-based over the rows (blank lines not counted) in every stage (``klear rl``, ``sft``,
``eval`` and ``data`` all read files through :func:`iter_records`); errors read
``<file>: row N: field 'X' is ... (expected ...)``, and errors in the text of a JSONL line (invalid
JSON, not UTF-8) also give its 1-based line: ``<file>: line L (row N): ...``.

Every command writes, next to its output ``OUT``: ``OUT.report.json`` (counts in/out, removed
rows by reason, parameters, timings) and, when rows were removed, ``OUT.removed.jsonl`` (one
line per removed row: ``row``, ``id``, ``reason`` and the reason's details). Output files are
written to a temporary name and renamed at the end, so a failed run leaves no partial output.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from klear.data.text import get_path, short_repr

__all__ = [
    "DEFAULT_ID_FIELDS",
    "Record",
    "RemovedLog",
    "RowWriter",
    "check_in_out",
    "count_rows",
    "file_kind",
    "iter_batches",
    "iter_jsonl_chunks",
    "iter_records",
    "parse_line",
    "read_line_range",
    "removed_path",
    "report_path",
    "row_id",
    "write_report",
]

DEFAULT_BATCH = 4096
DEFAULT_ID_FIELDS = ("prompt_id", "problem_id", "id", "extra_info.index")
"""Fields tried, in order, for a row's problem id (``--id-field`` overrides)."""

_KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "json", ".json.gz": "json", ".parquet": "parquet"}


class Record:
    """One input row: ``row`` (0-based number), ``data`` (the parsed dict; None while a JSONL
    line read with ``parse=False`` is not parsed yet), ``raw`` (the original JSON line, or None
    for parquet / JSON-array input or after a change) and ``lineno`` (1-based line, JSONL)."""

    __slots__ = ("row", "data", "raw", "lineno")

    def __init__(self, row: int, data: Any, raw: str | None = None, lineno: int | None = None):
        self.row, self.data, self.raw, self.lineno = row, data, raw, lineno

    def load(self, path: str | os.PathLike) -> dict:
        """The parsed row (parses a deferred JSONL line once; errors name the file and row)."""
        if self.data is None:
            assert self.raw is not None  # a deferred row always has its line
            self.data = parse_line(path, self.row, self.lineno, self.raw)
        return self.data


def parse_line(path: str | os.PathLike, row: int | str, lineno: int | str | None, line: str) -> dict:
    """Parse one JSONL line into a dict.

    Raises:
        ValueError: ``<file>: line L (row N): invalid JSON ...`` or ``<file>: row N: is list ...
            (expected a JSON object)``.
    """
    return _load_json(line, dict, lambda exc: f"{path}: line {lineno} (row {row})", f"{path}: row {row}")


def _load_json(text: str, expected: type, where: Callable[[json.JSONDecodeError], str], value_where: str) -> Any:
    """``json.loads(text)``, which must give an ``expected`` (dict or list).

    Raises:
        ValueError: ``<where(error)>: invalid JSON: <reason> at column C`` or ``<value_where>: is <type>
            <value> (expected a JSON object|array)``.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where(exc)}: invalid JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(data, expected):
        name = "object" if expected is dict else "array"
        raise ValueError(f"{value_where}: is {type(data).__name__} {short_repr(data)} (expected a JSON {name})")
    return data


def file_kind(path: str | os.PathLike) -> str:
    """``"jsonl"``, ``"json"`` or ``"parquet"`` from the file name.

    Raises:
        ValueError: any other extension.
    """
    name = Path(path).name.lower()
    for ext in sorted(_KINDS, key=len, reverse=True):
        if name.endswith(ext):
            return _KINDS[ext]
    raise ValueError(f"{path}: unsupported file type (expected .jsonl, .json, .parquet, .jsonl.gz or .json.gz)")


def _open_binary(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_line(path: Path, fh) -> bytes:
    try:
        return fh.readline()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from None


def _read_rest(path: Path, fh) -> bytes:
    try:
        return fh.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from None


def _decode_line(path: Path, raw: bytes, lineno: int, row: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: line {lineno} (row {row}): not valid UTF-8 ({exc.reason} at byte {exc.start} of the line)"
        ) from None


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def check_in_out(inp: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Path]:
    """Validate an input/output pair before any work.

    Raises:
        FileNotFoundError: the input does not exist.
        ValueError: unsupported extension, output equal to the input, an output that is an existing folder, a
            missing output folder, or one that cannot be written (read-only, permissions; the OS reason given).
    """
    from klear.utils.files import check_writable_folder

    inp, out = Path(inp), Path(out)
    if not inp.is_file():
        raise FileNotFoundError(f"{inp}: no such file")
    file_kind(inp)
    if file_kind(out) == "json" or out.name.lower().endswith(".gz"):
        raise ValueError(f"{out}: output must be .jsonl or .parquet")
    if out.resolve() == inp.resolve():
        raise ValueError(f"{out}: output is the input file (write to a new file)")
    if out.is_dir():
        raise ValueError(f"{out}: is a folder (expected the output file's name, e.g. {out / 'kept.jsonl'})")
    if not out.parent.resolve().is_dir():
        raise ValueError(f"{out}: folder {out.parent} does not exist")
    check_writable_folder(out.parent, str(out))
    return inp, out


def iter_batches(
    path: str | os.PathLike, batch_size: int = DEFAULT_BATCH, *, parse: bool = True
) -> Iterator[list[Record]]:
    """Stream the rows of a file in batches of :class:`Record` (memory: one batch).

    Every row must be a JSON object (dict). With ``parse=False`` JSONL lines are not parsed
    (``data`` is None; call :meth:`Record.load` or :func:`parse_line`, e.g. in a worker process).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported type, invalid JSON (with the 1-based line and the row), a row that
            is not an object, or an unreadable parquet file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    kind = file_kind(path)
    if kind == "parquet":
        yield from _parquet_batches(path, batch_size)
        return
    with _open_binary(path) as fh:
        first, first_lineno = b"", 0
        while True:  # peek past leading blank lines for a JSON array
            line = _read_line(path, fh)
            first_lineno += 1
            if not line:
                return
            if line.strip():
                first = line
                break
        if kind == "json" and first.lstrip().startswith(b"["):
            raw = first + _read_rest(path, fh)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                lineno = first_lineno + raw[: exc.start].count(b"\n")
                col = exc.start - raw.rfind(b"\n", 0, exc.start) - 1
                raise ValueError(
                    f"{path}: line {lineno}: not valid UTF-8 ({exc.reason} at byte {col} of the line)"
                ) from None
            data = _load_json(text, list, lambda exc: f"{path}: line {first_lineno - 1 + exc.lineno}", str(path))
            for start in range(0, len(data), batch_size):
                batch = [Record(start + i, rec) for i, rec in enumerate(data[start : start + batch_size])]
                _check_objects(path, batch)
                yield batch
            return
        yield from _jsonl_batches(path, fh, first, first_lineno, batch_size, parse)


def iter_jsonl_chunks(path: str | os.PathLike, lines_per_chunk: int = DEFAULT_BATCH) -> Iterator[list[str]]:
    """Raw lines of a JSONL file (also ``.jsonl.gz``) in chunks, unparsed, line ends and blank
    lines included (for workers that parse with :func:`parse_line`)."""
    path = Path(path)
    if file_kind(path) != "jsonl":
        raise ValueError(f"{path}: not a .jsonl file")
    with _open_text(path) as fh:
        while True:
            lines = list(islice(fh, lines_per_chunk))
            if not lines:
                return
            yield lines


def read_line_range(path: str | os.PathLike, start: int, end: int) -> bytes:
    """The whole lines of an (uncompressed) file that START at a byte offset in ``[start, end)``,
    as bytes ending in a newline (or empty). Splitting a file at arbitrary offsets and reading
    each piece with this function yields every line exactly once, in order."""
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the rest of the line that began before start
        pos = fh.tell()
        if pos >= end:
            return b""
        data = fh.read(end - pos)
        if not data.endswith(b"\n"):
            data += fh.readline()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    return data


def _check_objects(path: Path, batch: list[Record]) -> None:
    for rec in batch:
        if not isinstance(rec.data, dict):
            raise ValueError(
                f"{path}: row {rec.row}: is {type(rec.data).__name__} {short_repr(rec.data)} (expected a JSON object)"
            )


def _jsonl_batches(
    path: Path, fh, first: bytes, first_lineno: int, batch_size: int, parse: bool
) -> Iterator[list[Record]]:
    batch: list[Record] = []
    row = 0
    lineno = first_lineno - 1
    line = first
    while line:
        lineno += 1
        raw = line.rstrip(b"\r\n")
        line = _read_line(path, fh)
        if not raw or raw.isspace():
            continue
        s = _decode_line(path, raw, lineno, row)
        batch.append(Record(row, parse_line(path, row, lineno, s) if parse else None, s, lineno))
        row += 1
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _parquet_batches(path: Path, batch_size: int) -> Iterator[list[Record]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        it = pf.iter_batches(batch_size=batch_size)
    except Exception as exc:  # pyarrow raises several types
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from exc
    row = 0
    while True:
        try:
            rb = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise ValueError(f"{path}: not a readable parquet file (after row {row}): {exc}") from exc
        rows = rb.to_pylist()
        yield [Record(row + i, d) for i, d in enumerate(rows)]
        row += len(rows)


def parquet_schema(path: str | os.PathLike):
    """The arrow schema of a parquet file (None for other kinds)."""
    if file_kind(path) != "parquet":
        return None
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).schema_arrow


def iter_records(path: str | os.PathLike, batch_size: int = DEFAULT_BATCH) -> Iterator[Record]:
    """:func:`iter_batches` flattened to single records."""
    for batch in iter_batches(path, batch_size):
        yield from batch


def count_rows(path: str | os.PathLike) -> int | None:
    """Number of rows when cheap to know (parquet metadata), else None (for progress bars)."""
    if file_kind(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:
            return None
    return None


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class RowWriter:
    """Write rows to ``.jsonl`` or ``.parquet``, atomically (temp file renamed by :meth:`close`).

    Use as a context manager: an exception inside the block removes the temp file.

    Args:
        path: output file.
        schema: arrow schema to write parquet with (rows unchanged from a parquet input);
            None infers it from the first batch of rows.
        batch_size: rows per parquet row group flush.
    """

    def __init__(self, path: str | os.PathLike, *, schema=None, batch_size: int = 8192):
        self.path = Path(path)
        self.kind = file_kind(self.path)
        self.tmp = _tmp(self.path)
        self.count = 0
        self._schema = schema
        self._writer: Any = None
        self._buffer: list[Any] = []
        self._batch_size = batch_size
        self._first_row_in_buffer = 0
        if self.kind == "jsonl":
            self._fh = open(self.tmp, "wb")
        elif self.kind != "parquet":
            raise ValueError(f"{self.path}: output must be .jsonl or .parquet")

    def write(self, rec: Record | Mapping) -> None:
        """Write one row (a :class:`Record`, whose raw line is reused for JSONL, or a dict)."""
        self.count += 1
        if self.kind == "jsonl":
            if isinstance(rec, Record):
                line = rec.raw if rec.raw is not None else json.dumps(rec.data, ensure_ascii=False)
            else:
                line = json.dumps(rec, ensure_ascii=False)
            self._fh.write((line + "\n").encode("utf-8", "surrogatepass"))
            return
        if isinstance(rec, Record):
            if rec.data is None:
                assert rec.raw is not None  # a row not parsed yet always has its line
                self._buffer.append(json.loads(rec.raw))
            else:
                self._buffer.append(rec.data)
        else:
            self._buffer.append(rec)
        if len(self._buffer) >= self._batch_size:
            self._flush()

    def write_lines(self, data: bytes, count: int) -> None:
        """Write ``count`` rows already formatted as UTF-8 JSONL lines (each ending in a newline)."""
        if self.kind != "jsonl":
            raise ValueError(f"{self.path}: write_lines needs a .jsonl output")
        self._fh.write(data)
        self.count += count

    def write_file(self, fh, count: int) -> None:
        """Copy ``count`` rows already formatted as UTF-8 JSONL lines from a binary file object."""
        if self.kind != "jsonl":
            raise ValueError(f"{self.path}: write_file needs a .jsonl output")
        shutil.copyfileobj(fh, self._fh, 1 << 20)
        self.count += count

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._buffer:
            return
        first, last = self._first_row_in_buffer, self._first_row_in_buffer + len(self._buffer) - 1
        try:
            table = pa.Table.from_pylist(self._buffer, schema=self._schema)
        except Exception as exc:  # arrow type conflicts
            raise ValueError(
                f"{self.path}: output rows {first}-{last} do not fit the parquet schema of the "
                f"earlier rows ({exc}); write .jsonl instead"
            ) from exc
        if self._writer is None:
            self._schema = table.schema
            self._writer = pq.ParquetWriter(self.tmp, self._schema)
        self._writer.write_table(table)
        self._first_row_in_buffer += len(self._buffer)
        self._buffer = []

    def close(self) -> None:
        """Finish the file and move it into place."""
        if self.kind == "jsonl":
            self._fh.close()
        else:
            self._flush()
            if self._writer is None:  # no rows at all: an empty file with the known (or no) columns
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist([], schema=self._schema or pa.schema([])), self.tmp)
            else:
                self._writer.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the temp file (after an error)."""
        try:
            if self.kind == "jsonl":
                self._fh.close()
            elif self._writer is not None:
                self._writer.close()
        except OSError:
            pass  # closing after a failed write can fail the same way (full disk); the temp file goes anyway
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:  # e.g. the last rows hit a full disk: no partial OUT, no temp file left
            self.abort()
            raise


def report_path(out: str | os.PathLike) -> Path:
    """``OUT.report.json``."""
    out = Path(out)
    return out.with_name(out.name + ".report.json")


def removed_path(out: str | os.PathLike) -> Path:
    """``OUT.removed.jsonl``."""
    out = Path(out)
    return out.with_name(out.name + ".removed.jsonl")


class RemovedLog:
    """Counts removed rows by reason and lists each in ``OUT.removed.jsonl`` (written atomically
    on :meth:`close`; the file is only created when something was removed)."""

    def __init__(self, out: str | os.PathLike):
        self.path = removed_path(out)
        self.tmp = _tmp(self.path)
        self.counts: Counter[str] = Counter()
        self._fh: Any = None
        self.path.unlink(missing_ok=True)  # never leave a stale list from an earlier run

    def add(self, row: int, reason: str, row_id: Any = None, **detail: Any) -> None:
        """Record one removed row."""
        self.counts[reason] += 1
        if self._fh is None:
            self._fh = open(self.tmp, "w", encoding="utf-8")
        entry = {"row": row, "id": row_id, "reason": reason, **detail}
        self._fh.write(json.dumps(entry, ensure_ascii=False, default=str))
        self._fh.write("\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def close(self) -> Path | None:
        if self._fh is None:
            return None
        try:
            self._fh.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        return self.path

    def abort(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass  # the error being handled may be this file's own (full disk); it is removed anyway
            self.tmp.unlink(missing_ok=True)


def row_id(row: Mapping, fields: Sequence[str] = DEFAULT_ID_FIELDS) -> str | None:
    """A row's problem id as a string: the first of ``fields`` (dotted paths) that is a non-empty
    string or an int; None if none is."""
    for f in fields:
        v = get_path(row, f) if "." in f else row.get(f)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
            return str(int(v))
        if isinstance(v, str) and v:
            return v
    return None


def write_report(out: str | os.PathLike, report: dict, *, started: float | None = None, quiet: bool = False) -> Path:
    """Write ``OUT.report.json`` and print the one-line summary (counts in/out, removed by reason).

    ``report`` must hold ``command``, ``rows_in``, ``rows_out`` and ``removed`` (reason -> count).
    """
    if started is not None:
        report["seconds"] = round(time.perf_counter() - started, 3)
    path = report_path(out)
    tmp = _tmp(path)
    try:
        tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not quiet:
        removed = report.get("removed") or {}
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(removed.items())) or "none"
        print(
            f"klear data {report['command']}: {report['rows_in']} rows in, {report['rows_out']} rows out, "
            f"{sum(removed.values())} removed ({detail}); report {path}",
            file=sys.stdout,
            flush=True,
        )
    return path
