"""n-gram decontamination against evaluation benchmarks (paper Sec. 3.1 and 4.1: "9-gram filtering to
remove data contaminated with evaluation sets").

Rule
----
Texts are tokenised with :func:`klear.data.text.ngram_tokens` (NFKC, casefold, LaTeX
canonicalised, letters/digits runs as tokens, punctuation and math delimiters as separators,
one token sequence across line breaks). A training prompt is removed when

* ``ngram``: one of its word n-grams (default n = 9) is an n-gram of some benchmark problem; or
* ``exact``: its token sequence equals a benchmark problem's whole token sequence. This is what
  catches texts SHORTER than n tokens (they have no n-gram): a short training prompt is never
  flagged by n-grams and is removed only when it is an exact normalised copy. Before this
  comparison the ``ignore_phrases`` (default: klear's own instruction "Put your final answer
  within \\boxed{}.") are removed from the training text, so "<short problem> + instruction"
  is still an exact copy. A benchmark problem with no token at all is ignored (counted).

The removal report lists, for each removed row, the benchmark file, the problem id (first of
``id``, ``problem_id``, ``unique_id``, ``task_id``, ``question_id``, ``meta.unique_id``,
``extra_info.index``, ``prompt_id``; else ``row N``), the first matching n-gram (as tokens) and
how many of the row's n-gram positions match.

Implementation
--------------
Benchmark side, in memory: every benchmark token (interned strings), one 64-bit hash per
n-gram position (sorted, with the position), and a bitmap over the top hash bits (about 32
bits per n-gram). Training side, streamed: a group of texts (about 256K characters) is joined
with ``\\x00`` separators and normalised in one call; numpy then finds the token boundaries on
the code points (a lookup table on ASCII text, ``str.isalnum`` on the distinct other
characters), hashes each token's UTF-8 bytes 8 at a time (unaligned 64-bit loads through a
1-byte-stride view) and every window of n token hashes (by doubling: about log2(n) +
popcount(n) vectorised passes). Window hashes go through the bitmap, then
``searchsorted`` on the sorted hashes, and each remaining hit is compared token by token with the
benchmark n-gram it claims to be: a hash collision can never remove a row. A window that spans
two texts holds the separator token, which no benchmark n-gram holds.

JSONL-to-JSONL runs ship raw lines to worker processes (fork; the index is shared
copy-on-write) that parse, match and return the kept lines verbatim; other formats are parsed
here and only texts are shipped. At most ``2 x workers`` batches are in flight, so memory is the
benchmark side plus a few batches whatever the input size. ``benchmarks/decontam.py`` measures
it against a plain-Python set-of-tuples baseline.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from klear.data.io import (
    RemovedLog,
    RowWriter,
    check_in_out,
    count_rows,
    file_kind,
    iter_batches,
    iter_jsonl_chunks,
    parquet_schema,
    parse_line,
    read_line_range,
    row_id,
    write_report,
)
from klear.data.prompts import DEFAULT_INSTRUCTION
from klear.data.text import ngram_tokens, normalize_for_ngrams, row_text

logger = logging.getLogger(__name__)

__all__ = [
    "BENCHMARK_ID_FIELDS",
    "DEFAULT_IGNORE_PHRASES",
    "DEFAULT_N",
    "Hit",
    "NgramIndex",
    "decontaminate_file",
]

DEFAULT_N = 9
DEFAULT_IGNORE_PHRASES: tuple[str, ...] = (DEFAULT_INSTRUCTION,)
BENCHMARK_ID_FIELDS = (
    "id",
    "problem_id",
    "unique_id",
    "task_id",
    "question_id",
    "meta.unique_id",
    "extra_info.index",
    "prompt_id",
)

_SEP = "\x00"
_JOIN = " \x00 "
_BLOCK_BYTES = 1 << 22  # bytes of a JSONL file per worker job
_CHUNK_CHARS = 1 << 18  # texts are matched in groups of about this many characters (cache-sized arrays)
_M64 = 1 << 64
_MASK64 = _M64 - 1
_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the n-gram (window) hash
_C_INT = 0xD6E8FEB86659FD93  # odd multiplier of the token (byte) hash
_C = np.uint64(_C_INT)
_LONG_TOKEN = 64  # bytes of a token hashed with numpy; the rest of longer tokens in Python
_WORD_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
_TOKEN_CHAR = np.array([chr(i).isalnum() for i in range(128)], dtype=bool)  # ASCII letters and digits
_TOKEN_CHAR_BATCH = _TOKEN_CHAR.copy()
_TOKEN_CHAR_BATCH[0] = True  # the text separator is a token of its own in a batch
_CJK_RANGES = ((0x3040, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xAC00, 0xD7AF))


@dataclass(frozen=True)
class Hit:
    """Why a training text is contaminated.

    Attributes:
        reason: ``"ngram"`` or ``"exact"``.
        benchmark: the benchmark file (as given).
        problem_id: the benchmark problem's id.
        match: the first shared n-gram (tokens joined by spaces) or, for ``exact``, the text's
            normalised tokens.
        matches: number of n-gram positions of the training text that match (1 for exact).
    """

    reason: str
    benchmark: str
    problem_id: str
    match: str
    matches: int


def _token_hashes(buf: bytes, raw: bytes, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """64-bit hash of each token's UTF-8 bytes ``raw[start:start + length]``.

    ``h = length * C``; then for each 8-byte little-endian word w of the token (the last one
    zero-filled): ``h = (h ^ w) * C mod 2^64``. ``buf`` is ``raw`` followed by 8 zero bytes. Words are gathered
    for all tokens at once; tokens longer than 64 bytes finish in Python (same arithmetic).
    """
    h = lengths.astype(np.uint64) * _C
    if not len(starts):
        return h
    # the 8 bytes starting at every byte offset, as little-endian uint64 (a 1-byte-stride view)
    words_at = np.ndarray(shape=(len(raw),), dtype="<u8", buffer=buf, strides=(1,))
    left = lengths
    words = words_at.take(starts)
    words &= _WORD_MASKS.take(np.minimum(left, 8))
    h ^= words
    h *= _C
    act = np.flatnonzero(lengths > 8)
    offset = 8
    while len(act) and offset < _LONG_TOKEN:
        left = lengths[act] - offset
        words = words_at.take(starts[act] + offset)
        words &= _WORD_MASKS.take(np.minimum(left, 8))
        h[act] = (h[act] ^ words) * _C
        act = act[left > 8]
        offset += 8
    if len(act):  # rare very long tokens
        out = h.tolist()
        for i in act.tolist():
            v, s, e = out[i], int(starts[i]), int(starts[i] + lengths[i])
            for j in range(s + offset, e, 8):
                v = ((v ^ int.from_bytes(raw[j : min(j + 8, e)], "little")) * _C_INT) & _MASK64
            out[i] = v
        h = np.array(out, dtype=np.uint64)
    return h


def _scan(norm: str, *, batch: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokenise a normalised text with numpy (same tokens as
    :func:`klear.data.text.tokens_of_normalized`, plus ``\\x00`` as a token when ``batch``).

    Returns:
        ``(starts, ends, hashes, codes)``: character offsets of the tokens, a 64-bit hash of each
        token's UTF-8 bytes (equal tokens always hash equal, whatever the rest of the text), and
        the text's code points.
    """
    if norm.isascii():
        raw = norm.encode()  # ASCII: one byte per character
        codes = np.frombuffer(raw, np.uint8)
        is_tok = (_TOKEN_CHAR_BATCH if batch else _TOKEN_CHAR).take(codes)  # take: ~2x faster than [codes]
        cjk = None
    else:
        raw = norm.encode(errors="surrogatepass")  # UTF-8, keeping a lone surrogate (a JSON \ud800 escape)
        codes = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), np.uint32)
        low = codes < 128
        is_tok = np.empty(len(codes), bool)
        is_tok[low] = (_TOKEN_CHAR_BATCH if batch else _TOKEN_CHAR)[codes[low]]
        high = np.flatnonzero(~low)
        uniq, inverse = np.unique(codes[high], return_inverse=True)
        chars = [chr(c) for c in uniq.tolist()]
        is_tok[high] = np.array([ch.isalnum() for ch in chars])[inverse]  # bool (chars is not empty)
        ucjk = np.array([any(lo <= ord(ch) <= hi for lo, hi in _CJK_RANGES) for ch in chars])
        if ucjk.any():
            cjk = np.zeros(len(codes), bool)
            cjk[high] = ucjk[inverse]
        else:
            cjk = None
    if cjk is None:
        rise = np.flatnonzero(is_tok[1:] > is_tok[:-1]) + 1
        fall = np.flatnonzero(is_tok[:-1] > is_tok[1:]) + 1
        starts = np.concatenate(([0], rise)) if len(is_tok) and is_tok[0] else rise
        ends = np.concatenate((fall, [len(is_tok)])) if len(is_tok) and is_tok[-1] else fall
    else:  # each CJK character is a token of its own
        start = is_tok.copy()
        start[1:] &= ~is_tok[:-1]
        end = is_tok.copy()
        end[:-1] &= ~is_tok[1:]
        start |= is_tok & cjk
        start[1:] |= is_tok[1:] & cjk[:-1]
        end |= is_tok & cjk
        end[:-1] |= is_tok[:-1] & cjk[1:]
        starts = np.flatnonzero(start)
        ends = np.flatnonzero(end) + 1
    buf = raw + bytes(8)
    if codes.dtype == np.uint8:  # ASCII: byte offsets are character offsets
        bstarts, blens = starts, ends - starts
    else:  # byte offset of every character: UTF-8 lengths 1-4 (surrogates: 3, as surrogatepass writes)
        width = 1 + (codes >= 0x80).astype(np.int64) + (codes >= 0x800) + (codes >= 0x10000)
        offsets = np.concatenate(([0], np.cumsum(width)))
        bstarts = offsets[starts]
        blens = offsets[ends] - bstarts
    return starts, ends, _token_hashes(buf, raw, bstarts, blens), codes


def _pow(k: int) -> np.uint64:
    return np.uint64(pow(int(_P), k, _M64))


def _window_hashes(values: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of all length-n windows of ``values`` (uint64 token hashes): the window
    ``values[i:i + n]`` hashes to ``sum_j values[i + j] * P^(n - 1 - j) mod 2^64``. Built by
    doubling (windows of length 1, 2, 4, ... combined along the binary digits of n), so it
    costs about log2(n) + popcount(n) vectorised passes."""
    w = max(len(values) - n + 1, 0)  # no window in fewer than n values (then every array below is empty)
    cur = values
    blocks: list[tuple[int, np.ndarray]] = []
    k, m = 1, n
    while m:
        if m & 1:
            blocks.append((k, cur))
        m >>= 1
        if m:
            cur = cur[:-k] * _pow(k) + cur[k:]
            k *= 2
    res, covered = None, 0
    for k, arr in reversed(blocks):
        if res is None:
            res = arr[:w].copy()
        else:
            res *= _pow(k)
            res += arr[covered : covered + w]
        covered += k
    assert res is not None  # n >= 1 (checked by NgramIndex), so blocks is not empty
    return res


class NgramIndex:
    """The benchmark side: every n-gram and every short problem of the evaluation files.

    Args:
        n: n-gram length in tokens (>= 1; the paper's 9, Sec. 4.1).
        ignore_phrases: phrases removed from TRAINING texts before the exact comparison.

    Raises:
        ValueError: ``n`` < 1.
    """

    def __init__(self, n: int = DEFAULT_N, ignore_phrases: Sequence[str] = DEFAULT_IGNORE_PHRASES):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        self.n = n
        self.words: dict[str, str] = {}  # interned benchmark tokens
        self.docs: list[tuple[str, str]] = []  # (benchmark file, problem id)
        self.tokens: list[str | None] = []  # all benchmark tokens, None between problems
        self._token_hashes: list[np.ndarray] = []
        self._doc_starts: list[int] = []
        self.exact: dict[tuple[str, ...], int] = {}
        self.files: dict[str, dict[str, int]] = {}
        self.phrases = [" ".join(ngram_tokens(p)) for p in ignore_phrases if ngram_tokens(p)]
        self._phrase_len = sum(len(p.split()) for p in self.phrases)
        self._ready = False

    # ------------------------------------------------------------------ building
    def add_text(self, text: str, benchmark: str, problem_id: str) -> int:
        """Add one benchmark problem; returns its number of tokens (0: ignored)."""
        norm = normalize_for_ngrams(text)
        starts, ends, hashes, _ = _scan(norm)
        if not len(starts):
            return 0
        words = self.words
        toks = [words.setdefault(t, t) for t in (norm[a:b] for a, b in zip(starts.tolist(), ends.tolist()))]
        doc = len(self.docs)
        self.docs.append((benchmark, problem_id))
        self._doc_starts.append(len(self.tokens))
        self.tokens.extend(toks)
        self.tokens.append(None)
        self._token_hashes.append(hashes)
        self._token_hashes.append(np.zeros(1, np.uint64))
        if len(toks) < self.n:
            self.exact.setdefault(tuple(toks), doc)
        self._ready = False
        return len(toks)

    def add_file(self, path: str | os.PathLike, text_field: str | None = None) -> dict[str, int]:
        """Add every problem of a benchmark file (JSONL/JSON/parquet; text by the default rule of
        :func:`klear.data.text.row_text` or ``text_field``).

        Returns:
            ``{"problems", "short", "empty"}`` counts for the file.

        Raises:
            FileNotFoundError, ValueError: unreadable file or a row without text (file/row/field named).
        """
        name = str(path)
        stats = {"problems": 0, "short": 0, "empty": 0}
        for batch in iter_batches(path):
            for rec in batch:
                text = row_text(rec.data, f"{name}: row {rec.row}", text_field)
                pid = row_id(rec.data, BENCHMARK_ID_FIELDS) or f"row {rec.row}"
                k = self.add_text(text, name, pid)
                stats["problems"] += 1
                if k == 0:
                    stats["empty"] += 1
                elif k < self.n:
                    stats["short"] += 1
        if stats["problems"] == 0:
            raise ValueError(f"{name}: no rows (empty benchmark file)")
        if stats["empty"]:
            logger.warning("%s: %d problems have no token and are ignored", name, stats["empty"])
        self.files[name] = stats
        return stats

    def finalize(self) -> None:
        """Build the hash arrays (called automatically before the first match)."""
        n = self.n
        self.doc_starts = np.array(self._doc_starts)
        values = np.concatenate([np.empty(0, np.uint64), *self._token_hashes])
        h = _window_hashes(values, n)
        # separators (None) before each token position; a window holding none is a benchmark n-gram
        bad = np.concatenate(([0], np.cumsum([t is None for t in self.tokens])))
        pos = np.flatnonzero((bad[n:] - bad[: len(h)]) == 0)  # len(bad) - n == len(h) (or both empty)
        h = h[pos]
        order = np.argsort(h, kind="stable")
        self.hashes = h[order]
        self.positions = pos[order]
        count = len(self.hashes)
        self.bits = int(min(26, max(16, np.ceil(np.log2(max(count, 1) * 32)))))
        self.table = np.zeros(1 << self.bits, dtype=bool)
        if count:
            self.table[self.hashes >> np.uint64(64 - self.bits)] = True
        self._ready = True

    @property
    def num_ngrams(self) -> int:
        if not self._ready:
            self.finalize()
        return len(self.hashes)

    # ------------------------------------------------------------------ matching
    def _strip_phrases(self, toks: list[str]) -> tuple[str, ...]:
        if not self.phrases:
            return tuple(toks)
        s = " " + " ".join(toks) + " "
        for p in self.phrases:
            s = s.replace(" " + p + " ", " ")
        return tuple(s.split())

    def match_texts(self, texts: Sequence[str]) -> list[Hit | None]:
        """For each text: the :class:`Hit` that contaminates it, or None (keep)."""
        if not self._ready:
            self.finalize()
        out: list[Hit | None] = []
        texts = list(texts)
        ends = list(accumulate(len(t) + 3 for t in texts))
        a = 0
        while a < len(texts):
            # the largest group starting at a whose characters fit the chunk (at least one text)
            b = max(a + 1, bisect_right(ends, (ends[a - 1] if a else 0) + _CHUNK_CHARS))
            out.extend(self._match_group(texts[a:b]))
            a = b
        return out

    def _match_group(self, texts: list[str]) -> list[Hit | None]:
        n = self.n
        joined = _JOIN.join(texts)
        if joined.count(_SEP) != len(texts) - 1:  # a text holds NUL itself: make it a plain separator
            joined = _JOIN.join(t.replace(_SEP, " ") for t in texts)
        norm = normalize_for_ngrams(joined)
        starts, ends, th, codes = _scan(norm, batch=True)
        seps = np.flatnonzero(codes[starts] == 0)
        if len(seps) != len(texts) - 1:
            raise RuntimeError(f"internal error: {len(seps)} separators for {len(texts)} texts")
        row_first = np.concatenate(([0], seps + 1))
        row_end = np.concatenate((seps, [len(starts)]))
        out: list[Hit | None] = [None] * len(texts)

        def tok(i: int) -> str:
            return norm[starts[i] : ends[i]]

        # n-gram hits: bitmap on the top hash bits, then the exact 64-bit hash, then the tokens
        # themselves (a window across a text boundary holds the separator token, which no
        # benchmark n-gram holds, so it never passes the token check).
        h = _window_hashes(th, n)
        if len(self.hashes):  # else the benchmarks hold only short problems: no n-gram to look up
            cand = np.flatnonzero(self.table.take(h >> np.uint64(64 - self.bits)))
            hv = h[cand]
            lo = np.searchsorted(self.hashes, hv)  # the first equal hash (side "left", the default)
            found = lo < len(self.hashes)
            found[found] = self.hashes[lo[found]] == hv[found]
            cand, hv, lo = cand[found], hv[found], lo[found]
            counts: Counter[int] = Counter()
            first: dict[int, int] = {}
            rows = np.searchsorted(row_first, cand, side="right") - 1
            for i, hval, j, r in zip(cand.tolist(), hv.tolist(), lo.tolist(), rows.tolist()):
                window = [norm[a:b] for a, b in zip(starts[i : i + n].tolist(), ends[i : i + n].tolist())]
                while j < len(self.hashes) and int(self.hashes[j]) == hval:
                    p = int(self.positions[j])
                    if self.tokens[p : p + n] == window:
                        counts[r] += 1
                        first.setdefault(r, p)
                        break
                    j += 1
            for r, p in first.items():
                doc = int(np.searchsorted(self.doc_starts, p, side="right") - 1)
                bench, pid = self.docs[doc]
                phrase = " ".join(map(str, self.tokens[p : p + n]))  # a matched window holds no None separator
                out[r] = Hit("ngram", bench, pid, phrase, counts[r])

        # exact copies (the only rule for texts shorter than n)
        if self.exact:
            limit = n + self._phrase_len
            for r in np.flatnonzero((row_end - row_first) < limit).tolist():
                if out[r] is not None:
                    continue
                key = self._strip_phrases([tok(i) for i in range(row_first[r], row_end[r])])
                exact_doc = self.exact.get(key)
                if exact_doc is not None:
                    bench, pid = self.docs[exact_doc]
                    out[r] = Hit("exact", bench, pid, " ".join(key), 1)
        return out

    def contaminated(self, text: str) -> Hit | None:
        """:meth:`match_texts` for one text."""
        return self.match_texts([text])[0]


# ---------------------------------------------------------------------- worker processes

_WORKER_INDEX: NgramIndex | None = None


# set in JSONDecoder.__init__ (json.scanner.make_scanner), not declared in typeshed
_SCAN_JSON: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_ROW_MARK = re.compile("\x00([RL])(\\d+)\x00")


def _run_job(index: NgramIndex, job: tuple) -> tuple:
    """Match one unit of work.

    * ``("range", path, text_field, start, end, part)``: the JSONL lines starting in that byte range of
      the file (read here); ``("lines", path, text_field, lines)``: raw JSONL lines. Both are
      parsed, matched and answered with ``("lines", kept, removed, rows, lines)``: the kept lines
      as UTF-8 bytes ready to write, ``(local_row, id, Hit)`` of the removed rows, and how many
      rows and lines the job held. Row and line numbers are local to the job; an error comes
      back as ``("error", message)`` whose numbers are marked ``\\x00R<local>\\x00`` /
      ``\\x00L<local>\\x00`` for the caller, who knows the offsets, to fill in;
    * ``("texts", texts)``: answered with ``("texts", hits)``.
    """
    if job[0] == "texts":
        return "texts", index.match_texts(job[1])
    part = None
    if job[0] == "range":
        _, path, text_field, start, end, part = job
        blob = read_line_range(path, start, end)
        try:
            text = blob.decode()  # UTF-8, strict
        except UnicodeDecodeError as exc:
            lineno = blob[: exc.start].count(b"\n")
            return "error", f"{path}: line \x00L{lineno}\x00: not valid UTF-8 ({exc.reason})"
        lines: list[str] = text.split("\n")[:-1]  # the blob ends in a newline (or is empty)
    else:
        _, path, text_field, raw = job
        lines = [line.rstrip("\r\n") for line in raw]
    scan = _SCAN_JSON  # the C scanner behind json.loads, without its per-call Python overhead
    kept, datas, texts = [], [], []
    row = 0
    try:
        for lineno, line in enumerate(lines):
            if not line or line.isspace():
                continue
            try:
                data, end = scan(line, 0)
                if end != len(line) and not line[end:].isspace():
                    data = None
            except (StopIteration, ValueError):
                data = None
            mark_row = f"\x00R{row}\x00"
            if type(data) is not dict:  # json.loads: leading blanks are fine; else the error naming file/line/row
                data = parse_line(path, mark_row, f"\x00L{lineno}\x00", line)
            texts.append(row_text(data, f"{path}: row {mark_row}", text_field))
            datas.append(data)
            kept.append(line)
            row += 1
    except ValueError as exc:
        return "error", str(exc)
    hits = index.match_texts(texts)
    removed = [(k, row_id(datas[k]), hit) for k, hit in enumerate(hits) if hit is not None]
    out = [line[:-1] if line[-1:] == "\r" else line for line, hit in zip(kept, hits) if hit is None]
    # the lines were decoded strictly from UTF-8, so they hold no lone surrogate
    kept_bytes = ("\n".join(out) + "\n").encode() if out else b""
    if part is not None:  # a worker hands big outputs over in a file, not through the result pipe
        with open(part, "wb") as fh:
            fh.write(kept_bytes)
        return "lines", part, removed, len(texts), len(lines)
    return "lines", kept_bytes, removed, len(texts), len(lines)


def _worker_job(job: tuple) -> tuple:
    assert _WORKER_INDEX is not None
    return _run_job(_WORKER_INDEX, job)


def default_workers() -> int:
    """Usable CPU cores (affinity-aware), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def build_index(
    against: Iterable[str | os.PathLike],
    *,
    n: int = DEFAULT_N,
    text_field: str | None = None,
    ignore_phrases: Sequence[str] = DEFAULT_IGNORE_PHRASES,
) -> NgramIndex:
    """An :class:`NgramIndex` over benchmark files (see :meth:`NgramIndex.add_file`).

    Raises:
        ValueError: no benchmark file, ``n`` < 1, or a bad benchmark file/row.
        FileNotFoundError: a benchmark file is missing.
    """
    against = list(against)
    if not against:
        raise ValueError("no benchmark file given (--against FILE ...)")
    index = NgramIndex(n, ignore_phrases)
    for path in against:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file (benchmark)")
        index.add_file(path, text_field)
    index.finalize()
    return index


def decontaminate_file(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    against: Sequence[str | os.PathLike],
    *,
    n: int = DEFAULT_N,
    text_field: str | None = None,
    against_text_field: str | None = None,
    ignore_phrases: Sequence[str] = DEFAULT_IGNORE_PHRASES,
    workers: int | None = None,
    batch_size: int = 4096,
    progress: bool = True,  # pragma: no mutate (the progress bar only)
    quiet: bool = False,
) -> dict[str, Any]:
    """``klear data decontaminate``: copy ``inp`` to ``out`` without the contaminated rows
    (paper Sec. 3.1, 4.1; rule in the module docstring). Streams the input.

    Args:
        inp: training rows (.jsonl/.json/.parquet); text by the default rule or ``text_field``.
        out: kept rows (.jsonl/.parquet), plus ``out.report.json`` and ``out.removed.jsonl``.
        against: benchmark files (text by the default rule or ``against_text_field``).
        n: n-gram length (the paper's 9, Sec. 4.1).
        ignore_phrases: phrases removed from training texts before the exact comparison.
        workers: processes that match batches (default: usable cores, at most 8; 1 = in-process).
        batch_size: rows per batch.
        progress: show a tqdm progress bar.
        quiet: do not print the summary line.

    Returns:
        The report dict (also written to ``out.report.json``).

    Raises:
        FileNotFoundError: missing input or benchmark file.
        ValueError: bad arguments or a malformed row (file, row and field named).
    """
    from tqdm import tqdm

    started = time.perf_counter()
    inp, out = check_in_out(inp, out)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    index = build_index(against, n=n, text_field=against_text_field, ignore_phrases=ignore_phrases)
    index_seconds = time.perf_counter() - started
    by_benchmark: Counter[str] = Counter()
    removed = RemovedLog(out)
    rows_in = 0
    pool = None
    if workers > 1:
        try:
            ctx = multiprocessing.get_context("fork")
        except ValueError:  # no fork on this platform
            workers = 1
        else:
            global _WORKER_INDEX
            _WORKER_INDEX = index  # forked workers (also any the pool re-forks) share the index
            pool = ctx.Pool(workers)
    parts: Path | None = None  # folder of the workers' output pieces (JSONL to JSONL)
    # pragma: no mutate start (the progress bar only)
    bar = tqdm(total=count_rows(inp), unit="rows", desc="decontaminate", disable=not progress, mininterval=1.0)
    # pragma: no mutate end
    fast = file_kind(inp) == "jsonl" and file_kind(out) == "jsonl"
    try:
        with RowWriter(out, schema=parquet_schema(inp)) as writer:
            pending: deque = deque()

            def log(row: int, rid: Any, hit: Hit) -> None:
                by_benchmark[hit.benchmark] += 1
                removed.add(
                    row,
                    hit.reason,
                    rid,
                    benchmark=hit.benchmark,
                    problem_id=hit.problem_id,
                    ngram=hit.match,
                    matches=hit.matches,
                )

            row_base, line_base = 0, 0  # rows and lines of the jobs drained so far (JSONL jobs)

            def drain_one() -> None:
                nonlocal rows_in, row_base, line_base
                batch, result = pending.popleft()
                answer = result.get() if pool is not None else result
                if answer[0] == "error":
                    bases = {"R": row_base, "L": line_base + 1}
                    raise ValueError(_ROW_MARK.sub(lambda m: str(bases[m.group(1)] + int(m.group(2))), answer[1]))
                if answer[0] == "lines":
                    _, kept, dropped, count, nlines = answer
                    if isinstance(kept, str):  # a part file written by a worker
                        with open(kept, "rb") as fh:
                            writer.write_file(fh, count - len(dropped))
                        os.unlink(kept)
                    else:
                        writer.write_lines(kept, count - len(dropped))
                    for k, rid, hit in dropped:
                        log(row_base + k, rid, hit)
                    row_base += count
                    line_base += nlines
                else:
                    count = len(batch)
                    for rec, hit in zip(batch, answer[1]):
                        if hit is None:
                            writer.write(rec)
                        else:
                            log(rec.row, row_id(rec.data), hit)  # rows of these formats are parsed when read
                rows_in += count
                bar.update(count)  # pragma: no mutate (the progress bar only)

            def submit(batch: Any, job: tuple) -> None:
                if pool is not None:
                    pending.append((batch, pool.apply_async(_worker_job, (job,))))
                    if len(pending) >= 2 * workers:
                        drain_one()
                else:
                    pending.append((batch, _run_job(index, job)))
                    drain_one()

            if fast and not inp.name.lower().endswith(".gz"):
                # JSONL to JSONL: each worker reads the lines of its byte range, parses, matches and
                # returns the kept lines as bytes; this process reads nothing and only writes
                size = inp.stat().st_size
                if pool is not None:
                    parts = Path(tempfile.mkdtemp(prefix=f".{out.name}.parts-", dir=out.parent))
                for i, start in enumerate(range(0, size, _BLOCK_BYTES)):
                    part = str(parts / f"{i}.jsonl") if parts is not None else None
                    submit(None, ("range", str(inp), text_field, start, min(start + _BLOCK_BYTES, size), part))
            elif fast:
                for lines in iter_jsonl_chunks(inp, batch_size):
                    submit(None, ("lines", str(inp), text_field, lines))
            else:
                for batch in iter_batches(inp, batch_size):
                    submit(batch, ("texts", [row_text(r.data, f"{inp}: row {r.row}", text_field) for r in batch]))
            while pending:
                drain_one()
    except BaseException:
        removed.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
            _WORKER_INDEX = None
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)
    removed_file = removed.close()
    seconds = time.perf_counter() - started
    report = {
        "command": "decontaminate",
        "input": str(inp),
        "output": str(out),
        "rows_in": rows_in,
        "rows_out": writer.count,
        "removed": dict(removed.counts),
        "removed_by_benchmark": dict(by_benchmark),
        "removed_rows_file": str(removed_file) if removed_file else None,
        "params": {
            "n": index.n,
            "text_field": text_field,
            "against_text_field": against_text_field,
            "ignore_phrases": list(ignore_phrases),
            "workers": workers,
            "batch_size": batch_size,
        },
        "benchmarks": index.files,
        "benchmark_ngrams": index.num_ngrams,
        "benchmark_vocabulary": len(index.words),
        "index_seconds": round(index_seconds, 3),
        "rows_per_second": round(rows_in / seconds, 1) if seconds > 0 else None,
    }
    write_report(out, report, started=started, quiet=quiet)
    return report
