"""klear.data.decontam on hand-built texts (issue 21, mutation testing): what each Hit reports, how many n-gram
positions match, the exact rule, hash collisions and bitmap false positives, NUL characters inside texts, the
grouping of texts, the benchmark file counts, and the worker plumbing.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from klear.data import decontam
from klear.data.decontam import Hit, NgramIndex, build_index, default_workers

ALPHA = "alpha beta gamma delta epsilon zeta eta theta"  # 8 tokens


def index_of(problems, n=4, ignore_phrases=("Put your final answer within \\boxed{}.",)):
    """An index over ``{problem_id: text}`` of one benchmark named "bench.jsonl"."""
    index = NgramIndex(n, ignore_phrases)
    for pid, text in problems.items():
        index.add_text(text, "bench.jsonl", pid)
    index.finalize()
    return index


# ------------------------------------------------------------------ what a hit reports


def test_ngram_hit_names_the_problem_the_first_shared_ngram_and_the_number_of_matching_positions():
    index = index_of({"p1": "one two three four five six", "p2": ALPHA})
    # windows of 4: "x alpha beta gamma", "alpha beta gamma delta" (p2), "beta gamma delta epsilon" (p2),
    # "gamma delta epsilon y", ...: two positions match
    hit = index.contaminated("x Alpha, beta; GAMMA delta epsilon y z")
    assert hit == Hit("ngram", "bench.jsonl", "p2", "alpha beta gamma delta", 2)
    # all five windows of ALPHA match
    assert index.contaminated(ALPHA) == Hit("ngram", "bench.jsonl", "p2", "alpha beta gamma delta", 5)
    # two disjoint shared n-grams of two problems: the first one in the text names the problem
    both = index.contaminated("three four five six and then epsilon zeta eta theta")
    assert both == Hit("ngram", "bench.jsonl", "p1", "three four five six", 2)
    assert index.contaminated("one two three x four five six") is None  # no 4 consecutive shared tokens


def test_exact_hit_of_a_short_problem_reports_its_tokens():
    index = index_of({"long": ALPHA, "short": "$\\dbinom{8}{4}$."})  # 3 tokens: shorter than n = 4
    expected = Hit("exact", "bench.jsonl", "short", "binom 8 4", 1)
    assert index.contaminated("\\binom{8}{4}") == expected
    assert index.contaminated("$\\dbinom{8}{4}$.\nPut your final answer within \\boxed{}.") == expected
    assert index.contaminated("binom 8") is None and index.contaminated("compute binom 8 4") is None


def test_every_row_of_a_group_is_checked_for_exact_copies_after_an_ngram_hit():
    index = index_of({"long": ALPHA, "short": "binom 8 4"})
    hits = index.match_texts(["alpha beta gamma delta", "binom 8 4", "nothing here", "binom 8 4"])
    assert [h and (h.reason, h.problem_id) for h in hits] == [
        ("ngram", "long"),
        ("exact", "short"),
        None,
        ("exact", "short"),
    ]


def test_the_first_text_of_a_group_is_matched_from_its_first_token():
    # the first text's tokens start at position 0 of the group: a hit there belongs to row 0, no other row
    index = index_of({"long": ALPHA, "short": "binom 8 4"})
    for texts, expected in (
        (["alpha beta gamma delta x", "clean text one two", "clean again"], ["long", None, None]),
        (["binom 8 4", "clean", "other words"], ["short", None, None]),
        (["clean", "words", "alpha beta gamma delta"], [None, None, "long"]),
    ):
        assert [h and h.problem_id for h in index.match_texts(texts)] == expected


# ------------------------------------------------------------------ hashing is only a filter


def test_colliding_hashes_are_resolved_token_by_token(monkeypatch):
    # with a zero window multiplier a window hashes as its last token: the n-grams of p0, p1 and p2 below all
    # end in "end" and share one hash; the index holds them in position order, so each text must walk the run
    monkeypatch.setattr(decontam, "_P", np.uint64(0))
    problems = {"p0": "a b c end", "p1": "d e f end", "p2": "g h i end"}
    problems.update({f"z{i}": f"u v w tail{i}" for i in range(40)})  # other hashes around the run
    index = index_of(problems)
    run = np.flatnonzero(index.hashes == index.hashes[np.flatnonzero(index.positions == 0)[0]])
    assert len(run) == 3 and run[-1] < len(index.hashes) - 1 and run[0] > 0
    assert [h and h.problem_id for h in index.match_texts(["d e f end", "g h i end", "a b c end", "x y z end"])] == [
        "p1",
        "p2",
        "p0",
        None,
    ]


def test_a_bitmap_that_lets_every_hash_through_changes_no_result():
    problems = {f"p{i}": f"word{i} common words here and {i * 7} more {i}" for i in range(30)}
    index = index_of(problems)
    texts = [f"word{i} common words here and {i * 7}" for i in range(0, 30, 3)]
    texts += [f"zzz{i} yyy xxx www vvv" for i in range(50)] + ["common words here and more words"]
    before = index.match_texts(texts)
    index.table[:] = True  # a bitmap false positive for every window
    assert index.match_texts(texts) == before
    assert sum(h is not None for h in before) == 11  # the last text shares "common words here and"


# ------------------------------------------------------------------ texts holding NUL


def test_a_nul_inside_a_text_is_a_plain_separator():
    index = index_of({"p": ALPHA, "s": "binom 8 4"})
    texts = ["alpha beta\x00gamma delta", "x\x00\x00y", "binom\x00 8 4", "alpha beta x gamma delta"]
    assert [h and (h.problem_id, h.match) for h in index.match_texts(texts)] == [
        ("p", "alpha beta gamma delta"),
        None,
        ("s", "binom 8 4"),
        None,
    ]
    assert index.match_texts(["a\x00\x00b", "alpha beta gamma delta"])[1].problem_id == "p"
    # two texts, two NULs: as many as the separators of three texts
    assert [h and h.problem_id for h in index.match_texts(["alpha\x00beta gamma\x00delta", "x"])] == ["p", None]
    assert [h and h.problem_id for h in index.match_texts(["x \x00 \x00 y", "beta gamma delta epsilon"])] == [None, "p"]


def test_a_lost_text_separator_is_an_internal_error(monkeypatch):
    # if normalisation ever ate the separator, rows would be misattributed: refuse instead
    index = index_of({"p": ALPHA})
    monkeypatch.setattr(decontam, "normalize_for_ngrams", lambda s: s.replace("\x00", " "))
    with pytest.raises(RuntimeError, match=r"^internal error: 0 separators for 3 texts$"):
        index.match_texts(["a", "b", "c"])


# ------------------------------------------------------------------ groups of texts


def _groups(monkeypatch, index, texts, chunk):
    seen = []
    real = NgramIndex._match_group

    def spy(self, group):
        seen.append(len(group))
        return real(self, group)

    monkeypatch.setattr(decontam, "_CHUNK_CHARS", chunk)
    monkeypatch.setattr(NgramIndex, "_match_group", spy)
    hits = index.match_texts(texts)
    return seen, hits


@pytest.mark.parametrize(
    "lengths,chunk,groups",
    [
        # each text counts len + 3 characters (its " \x00 " joiner); a group holds as many as fit in the chunk
        ([30] * 7, 99, [3, 3, 1]),  # 3 x 33 = 99 fit exactly
        ([30] * 7, 98, [2, 2, 2, 1]),
        ([30] * 9, 120, [3, 3, 3]),  # 4 x 33 = 132 do not
        ([200, 10, 10, 200, 10], 60, [1, 2, 1, 1]),  # a text longer than the chunk is a group of its own
        ([10, 10, 200], 60, [2, 1]),
    ],
)
def test_texts_are_matched_in_groups_that_fit_the_chunk(monkeypatch, lengths, chunk, groups):
    index = index_of({"p": ALPHA})
    texts = [("alpha beta gamma delta " if i % 2 else "") + "q" * length for i, length in enumerate(lengths)]
    texts = [t[:length] for t, length in zip(texts, lengths)]
    seen, hits = _groups(monkeypatch, index, texts, chunk)
    assert seen == groups
    assert [h is not None for h in hits] == [i % 2 == 1 and lengths[i] >= 22 for i in range(len(lengths))]


# ------------------------------------------------------------------ the benchmark side


def test_benchmark_file_counts_and_text_field(tmp_path, caplog):
    path = tmp_path / "bench.jsonl"
    rows = [
        {"q": "one two three four five", "problem": "ignored"},  # 5 tokens: an n-gram problem (n = 5)
        {"q": "one two three four", "problem": "x"},  # 4 = n - 1: short
        {"q": "a b", "problem": "x"},  # short
        {"q": "$$ . , $$", "problem": "x"},  # no token: ignored
        {"q": "", "problem": "x"},  # no token
        {"q": "a b c d e f g", "problem": "x"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = NgramIndex(5)
    with caplog.at_level(logging.WARNING, logger="klear.data.decontam"):
        stats = index.add_file(path, text_field="q")
    assert stats == {"problems": 6, "short": 2, "empty": 2}
    assert index.files == {str(path): stats}
    assert [r.getMessage() for r in caplog.records] == [f"{path}: 2 problems have no token and are ignored"]
    assert index.contaminated("one two three four") == Hit("exact", str(path), "row 1", "one two three four", 1)
    assert index.contaminated("ignored") is None  # the "problem" field was not read
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="klear.data.decontam"):
        NgramIndex(5).add_file(path)  # default rule: the "problem" field
    assert "have no token" not in caplog.text


def test_build_index_reads_every_file_and_refuses_a_missing_one(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"problem": ALPHA, "id": "A1"}) + "\n")
    b.write_text(json.dumps({"problem": "binom 8 4", "id": "B1"}) + "\n")
    index = build_index([a, b], n=4)
    assert index.num_ngrams == 5 and index.contaminated("binom 8 4").benchmark == str(b)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: no such file \(benchmark\)$"):
        build_index([a, tmp_path / "nope.jsonl"])
    with pytest.raises(ValueError, match=r"^no benchmark file given \(--against FILE \.\.\.\)$"):
        build_index([])


# ------------------------------------------------------------------ workers


def test_worker_job_matches_with_the_shared_index(monkeypatch):
    index = index_of({"p": ALPHA})
    monkeypatch.setattr(decontam, "_WORKER_INDEX", index)
    kind, hits = decontam._worker_job(("texts", ["alpha beta gamma delta", "no"]))
    assert kind == "texts" and [h and h.problem_id for h in hits] == ["p", None]


def test_default_workers_is_the_usable_cores_between_one_and_eight(monkeypatch):
    for cores, expected in (({0}, 1), ({0, 1, 2}, 3), (set(range(8)), 8), (set(range(16)), 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores, raising=False)
        assert default_workers() == expected
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # not Linux: the CPU count
    for count, expected in ((None, 1), (1, 1), (5, 5), (12, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda count=count: count)
        assert default_workers() == expected


# ------------------------------------------------------------------ decontaminate_file: formats, errors, workers


def _row(text, i, **extra):
    return {"prompt": [{"role": "user", "content": text}], "extra_info": {"index": i}, **extra}


@pytest.fixture()
def benches(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"problem": ALPHA, "id": "A1", "q": "one two three four five"}) + "\n")
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"problem": "binom 8 4", "id": "B1", "q": "six seven"}) + "\n")
    return [a, b]


def _decon(inp, out, against, **kw):
    kw = {"n": 4, "progress": False, "quiet": True, "workers": 1, **kw}
    return decontam.decontaminate_file(inp, out, against, **kw)


def _removed(out):
    path = out.with_name(out.name + ".removed.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


TEXTS = ["x alpha beta gamma delta epsilon", "clean row", "binom 8 4", "gamma delta epsilon zeta", "kept too"]


def test_gzip_jsonl_input_goes_through_line_jobs(tmp_path, benches):
    import gzip

    inp = tmp_path / "train.jsonl.gz"
    lines = [json.dumps(_row(t, i)) for i, t in enumerate(TEXTS)]
    with gzip.open(inp, "wt") as fh:
        fh.write(lines[0] + "\r\n\n" + lines[1] + "  \r\n" + "\r\n".join(lines[2:]) + "\n")
    out = tmp_path / "kept.jsonl"
    report = _decon(inp, out, benches, batch_size=2)
    assert out.read_text() == lines[1] + "  \n" + lines[4] + "\n"  # kept lines verbatim, blanks after the row too
    assert (report["rows_in"], report["rows_out"], report["removed"]) == (5, 2, {"ngram": 2, "exact": 1})
    assert [(r["row"], r["id"], r["reason"]) for r in _removed(out)] == [
        (0, "0", "ngram"),
        (2, "2", "exact"),
        (3, "3", "ngram"),
    ]
    # a malformed row names its 1-based line and 0-based row, counted across line jobs
    with gzip.open(inp, "wt") as fh:
        fh.write("\n".join(lines[:4]) + '\n1{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl\.gz: line 5 \(row 4\): invalid JSON: Extra data"):
        _decon(inp, tmp_path / "e.jsonl", benches, batch_size=3)
    with gzip.open(inp, "wt") as fh:
        fh.write(lines[0] + "\n" + lines[1] + "X\n")
    with pytest.raises(ValueError, match=r"train\.jsonl\.gz: line 2 \(row 1\): invalid JSON: Extra data"):
        _decon(inp, tmp_path / "e.jsonl", benches)


def test_plain_jsonl_errors_name_the_line_and_row(tmp_path, benches):
    inp = tmp_path / "train.jsonl"
    good = [json.dumps(_row(t, i)) for i, t in enumerate(TEXTS)]
    inp.write_text("\n".join(good[:3]) + '\n1{"prompt": "garbage before the object"}\n' + good[3] + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: line 4 \(row 3\): invalid JSON: Extra data"):
        _decon(inp, tmp_path / "e.jsonl", benches)
    inp.write_bytes(b"\n" + "\n".join(good[:2]).encode() + b'\n{"prompt": "caf\xe9"}\n' + good[3].encode() + b"\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: line 4: not valid UTF-8 \(invalid continuation byte\)"):
        _decon(inp, tmp_path / "e.jsonl", benches)
    assert not (tmp_path / "e.jsonl").exists()


def test_arguments_are_checked_before_any_work(tmp_path, benches):
    inp = tmp_path / "train.jsonl"
    inp.write_text("".join(json.dumps(_row(t, i)) + "\n" for i, t in enumerate(TEXTS)))
    for bad in (0, -3, True, 2.0, "8"):
        with pytest.raises(ValueError, match=rf"^batch_size must be a positive integer, got {bad!r}$"):
            _decon(inp, tmp_path / "o.jsonl", benches, batch_size=bad)
        with pytest.raises(ValueError, match=rf"^workers must be a positive integer, got {bad!r}$"):
            _decon(inp, tmp_path / "o.jsonl", benches, workers=bad)
    report = _decon(inp, tmp_path / "o.jsonl", benches, batch_size=1)
    assert report["rows_out"] == 2 and report["params"]["batch_size"] == 1 and report["params"]["workers"] == 1


def test_benchmark_text_field_and_counts_by_benchmark(tmp_path, benches):
    inp = tmp_path / "train.jsonl"
    texts = ["one two three four", "a one two three four five", "six seven", "alpha beta gamma delta"]
    inp.write_text("".join(json.dumps(_row(t, i)) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "o.jsonl"
    report = _decon(inp, out, benches, against_text_field="q")
    # against the "q" texts: rows 0 and 1 share a 4-gram of a.jsonl, row 2 is b.jsonl's short "q" text
    assert report["removed_by_benchmark"] == {str(benches[0]): 2, str(benches[1]): 1}
    assert [(r["row"], r["problem_id"], r["ngram"], r["matches"]) for r in _removed(out)] == [
        (0, "A1", "one two three four", 1),
        (1, "A1", "one two three four", 2),
        (2, "B1", "six seven", 1),
    ]
    assert report["params"]["against_text_field"] == "q" and report["benchmarks"][str(benches[1])]["short"] == 1


def test_parquet_rows_keep_their_schema_and_are_named_by_row_and_id(tmp_path, benches):
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("extra_info", pa.struct([("index", pa.int32())])),
            ("score", pa.float32()),
        ]
    )
    rows = [{**_row(t, 10 + i), "score": 0.5} for i, t in enumerate(TEXTS)]
    inp = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), inp)
    for out in (tmp_path / "kept.parquet", tmp_path / "kept.jsonl"):
        report = _decon(inp, out, benches, batch_size=2)
        assert (report["rows_in"], report["rows_out"]) == (5, 2)
        assert [(r["row"], r["id"]) for r in _removed(out)] == [(0, "10"), (2, "12"), (3, "13")]
    assert pq.read_schema(tmp_path / "kept.parquet") == schema
    assert [r["extra_info"]["index"] for r in pq.read_table(tmp_path / "kept.parquet").to_pylist()] == [11, 14]


class _FakeResult:
    def __init__(self, pool, fn, args):
        self.pool, self.fn, self.args = pool, fn, args

    def get(self):
        self.pool.in_flight -= 1
        assert decontam._WORKER_INDEX is not None  # the index the forked workers share
        return self.fn(*self.args)


class _FakePool:
    """Runs each job in this process when its result is fetched; records what a real pool would see."""

    def __init__(self, processes):
        self.processes, self.jobs, self.in_flight, self.max_in_flight = processes, [], 0, 0
        self.closed = []

    def apply_async(self, fn, args):
        self.jobs.append(args[0])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return _FakeResult(self, fn, args)

    def terminate(self):
        self.closed.append("terminate")

    def join(self):
        self.closed.append("join")


def test_worker_pool_forks_holds_at_most_two_jobs_per_worker_and_cleans_up(tmp_path, benches, monkeypatch):
    import multiprocessing

    pools, contexts = [], []

    class Ctx:
        def Pool(self, processes):
            pools.append(_FakePool(processes))
            return pools[-1]

    def get_context(method):
        contexts.append(method)
        return Ctx()

    monkeypatch.setattr(multiprocessing, "get_context", get_context)
    monkeypatch.setattr(decontam, "_BLOCK_BYTES", 300)
    inp = tmp_path / "train.jsonl"
    rows = [_row(TEXTS[i % 5], i) for i in range(60)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "kept.jsonl"
    report = _decon(inp, out, benches, workers=3)
    assert contexts == ["fork"] and len(pools) == 1 and pools[0].processes == 3
    pool = pools[0]
    assert len(pool.jobs) > 10 and pool.max_in_flight == 6 and pool.in_flight == 0
    assert pool.closed == ["terminate", "join"] and decontam._WORKER_INDEX is None
    # each job reads a byte range and hands its kept lines over in a file of a hidden folder beside the output
    parts = {os.path.dirname(job[5]) for job in pool.jobs}
    assert len(parts) == 1 and os.path.dirname(parts.pop()) == str(tmp_path)
    assert all(
        job[0] == "range" and os.path.basename(os.path.dirname(job[5])).startswith(".kept.jsonl.parts-")
        for job in pool.jobs
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a.jsonl", "b.jsonl", "train.jsonl", "kept.jsonl", "kept.jsonl.removed.jsonl", "kept.jsonl.report.json"]
    )
    assert (report["rows_in"], report["rows_out"], report["params"]["workers"]) == (60, 24, 3)
    assert [json.loads(x)["extra_info"]["index"] for x in out.read_text().splitlines()] == [
        i for i in range(60) if i % 5 in (1, 4)
    ]


def test_one_worker_runs_in_process_and_no_fork_falls_back_to_it(tmp_path, benches, monkeypatch):
    import multiprocessing

    inp = tmp_path / "train.jsonl"
    inp.write_text("".join(json.dumps(_row(t, i)) + "\n" for i, t in enumerate(TEXTS)))

    def no_pool(method):
        raise AssertionError("no pool for one worker")

    monkeypatch.setattr(multiprocessing, "get_context", no_pool)
    assert _decon(inp, tmp_path / "o.jsonl", benches, workers=1)["rows_out"] == 2
    monkeypatch.setattr(decontam, "default_workers", lambda: 1)
    assert _decon(inp, tmp_path / "o.jsonl", benches, workers=None)["params"]["workers"] == 1

    def no_fork(method):
        raise ValueError(f"cannot find context for {method!r}")

    monkeypatch.setattr(multiprocessing, "get_context", no_fork)
    report = _decon(inp, tmp_path / "o.jsonl", benches, workers=4)
    assert report["params"]["workers"] == 1 and report["rows_out"] == 2


# ------------------------------------------------------------------ tokens and hashes against their documented rules

_M64 = 1 << 64


def token_hash(data: bytes) -> int:
    """The token hash of the _token_hashes docstring, with Python ints: h = len * C, then per 8-byte
    little-endian word w (the last zero-filled) h = (h ^ w) * C mod 2^64."""
    c = decontam._C_INT
    h = len(data) * c % _M64
    for i in range(0, len(data), 8):
        h = (h ^ int.from_bytes(data[i : i + 8], "little")) * c % _M64
    return h


def window_hash(values: list[int], n: int) -> int:
    """sum_j values[j] * P^(n - 1 - j) mod 2^64 (the _window_hashes docstring)."""
    p = int(decontam._P)
    return sum(v * pow(p, n - 1 - j, _M64) for j, v in enumerate(values)) % _M64


# code points at the edges of the UTF-8 widths (1/2/3/4 bytes) and of each CJK range, letters among them
EDGE_CHARS = "\x7f\x80\u07ff\u0800\uffff\U00010000\U0001d400\u3041\u30ff\u3400\u4dbf\u4e00\u9fff\uac00\ud7a3\ud800"


@pytest.mark.parametrize("batch", [False, True])
def test_token_hashes_follow_the_documented_formula(batch):
    import random

    rng = random.Random(11)
    alphabet = "ab0Z ,.-" + EDGE_CHARS + "é中"
    texts = ["", "x", "a" * 8, "b" * 9, "c" * 64, "d" * 65, "e" * 200 + " f", "é" * 40 + "g" * 3 + "é"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 90))) for _ in range(300)]
    for text in texts:
        norm = decontam.normalize_for_ngrams(text)
        starts, ends, hashes, _ = decontam._scan(norm, batch=batch)
        tokens = [norm[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        assert hashes.dtype == np.uint64
        assert hashes.tolist() == [token_hash(t.encode("utf-8", "surrogatepass")) for t in tokens], repr(text)


def test_scanner_cuts_the_tokens_of_the_documented_rule_at_range_edges():
    from klear.data.text import ngram_tokens

    for ch in EDGE_CHARS:
        for text in (ch + ch, "a" + ch + "b", ch + "1 x", "x\x80" + ch + ch + "é"):
            norm = decontam.normalize_for_ngrams(text)
            starts, ends, _, _ = decontam._scan(norm, batch=False)
            assert [norm[a:b] for a, b in zip(starts.tolist(), ends.tolist())] == ngram_tokens(text), repr(text)
    # every CJK character is a token of its own, at both ends of each range
    assert ngram_tokens("\u3400\u3400\u4dbf\u4dbf\u9fff\u9fff") == ["\u3400"] * 2 + ["\u4dbf"] * 2 + ["\u9fff"] * 2


def test_a_nul_in_a_benchmark_text_separates_tokens():
    # the separator token of a group exists only on the training side
    for text in ("alpha\x00beta gamma\x00delta", "é alpha\x00beta gamma\x00delta"):
        index = index_of({"p": text})
        assert index.contaminated("alpha beta gamma delta") is not None, repr(text)
        assert index.tokens[-5:] == ["alpha", "beta", "gamma", "delta", None]


def test_a_lone_surrogate_from_json_is_tokenised_not_an_error():
    text = json.loads('"alpha beta \\ud800 gamma delta"')
    index = index_of({"p": "beta gamma delta epsilon", "q": text})
    assert [h and h.problem_id for h in index.match_texts([text, "x \ud800 y"])] == ["q", None]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16])
def test_window_hashes_are_the_documented_polynomial(n):
    rng = np.random.default_rng(n)
    for length in (0, 1, n - 1, n, n + 1, 3 * n + 2):
        values = rng.integers(0, 2**63, size=max(length, 0), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        h = decontam._window_hashes(values, n)
        expected = [window_hash(values[i : i + n].tolist(), n) for i in range(length - n + 1)]
        assert h.dtype == np.uint64 and h.tolist() == expected, (n, length)


def test_unigram_index_and_bad_n():
    index = NgramIndex(1)
    index.add_text("Alpha", "b.jsonl", "p")
    assert index.contaminated("x alpha y alpha") == Hit("ngram", "b.jsonl", "p", "alpha", 2)
    for bad in (0, -1, True, 2.0, "9"):
        with pytest.raises(ValueError, match=rf"^n must be a positive integer, got {bad!r}$"):
            NgramIndex(bad)


# ------------------------------------------------------------------ the benchmark index


def test_the_first_problem_holding_a_shared_ngram_is_reported():
    # the same 4-gram in 300 problems: the hit names the first of them in file order
    problems = {f"p{i:03d}": f"unique{i} shared words of all problems{i % 7}" for i in range(300)}
    index = index_of(problems)
    hit = index.contaminated("these shared words of all")
    assert hit == Hit("ngram", "bench.jsonl", "p000", "shared words of all", 1)


def test_index_is_finalized_once_and_again_after_a_new_problem(monkeypatch):
    index = NgramIndex(4)
    index.add_text(ALPHA, "b.jsonl", "p")
    calls = []
    real = NgramIndex.finalize
    monkeypatch.setattr(NgramIndex, "finalize", lambda self: calls.append(1) or real(self))
    assert index.contaminated("alpha beta gamma delta") is not None and len(calls) == 1
    assert index.num_ngrams == 5 and index.contaminated("zeta eta theta x") is None and len(calls) == 1
    index.add_text("one two three four", "b.jsonl", "q")
    assert index.contaminated("one two three four") is not None and len(calls) == 2 and index.num_ngrams == 6


def test_an_index_without_tokens_matches_nothing():
    index = NgramIndex(4)
    assert index.add_text(" $ . $ ", "b.jsonl", "empty") == 0
    assert index.num_ngrams == 0 and index.match_texts(["alpha beta gamma delta", "", "x"]) == [None, None, None]
    short = index_of({"s": "binom 8 4"})  # short problems only: no n-gram, exact copies still found
    assert short.num_ngrams == 0 and short.contaminated("binom 8 4").reason == "exact"


@pytest.mark.parametrize("count,bits", [(1, 16), (5, 16), (2048, 16), (2049, 17), (4096, 17), (4097, 18)])
def test_the_bitmap_has_about_32_entries_per_ngram_between_2_16_and_2_26(count, bits):
    # one problem of count + n - 1 distinct tokens has count n-grams; entries: 2^ceil(log2(32 * count))
    index = NgramIndex(2)
    index.add_text(" ".join(f"w{i}" for i in range(count + 1)), "b.jsonl", "p")
    index.finalize()
    assert index.num_ngrams == count and index.bits == bits
    assert index.table.dtype == bool and index.table.size == 1 << bits
    assert index.table.sum() <= count and index.table[index.hashes >> np.uint64(64 - bits)].all()


# ------------------------------------------------------------------ decontaminate_file: the report, other formats


def test_report_file_names_input_output_and_every_setting(tmp_path, benches, capsys):
    inp = tmp_path / "train.jsonl"
    inp.write_text("".join(json.dumps(_row(t, i)) + "\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "kept.jsonl"
    report = _decon(inp, out, benches, ignore_phrases=["Answer:"], batch_size=7)
    assert capsys.readouterr().out == ""  # quiet
    assert json.loads((tmp_path / "kept.jsonl.report.json").read_text()) == report
    timing = {k: report.pop(k) for k in ("index_seconds", "rows_per_second", "seconds")}
    assert report == {
        "command": "decontaminate",
        "input": str(inp),
        "output": str(out),
        "rows_in": 5,
        "rows_out": 2,
        "removed": {"ngram": 2, "exact": 1},
        "removed_by_benchmark": {str(benches[0]): 2, str(benches[1]): 1},
        "removed_rows_file": str(tmp_path / "kept.jsonl.removed.jsonl"),
        "params": {
            "n": 4,
            "text_field": None,
            "against_text_field": None,
            "ignore_phrases": ["Answer:"],
            "workers": 1,
            "batch_size": 7,
        },
        "benchmarks": {
            str(benches[0]): {"problems": 1, "short": 0, "empty": 0},
            str(benches[1]): {"problems": 1, "short": 1, "empty": 0},
        },
        "benchmark_ngrams": 5,  # ALPHA's five 4-grams
        "benchmark_vocabulary": 11,  # ALPHA's 8 words, binom, 8, 4
    }
    # times in seconds (3 decimals); rows per second over the whole call, which the total time bounds
    assert (
        0 <= timing["index_seconds"] <= timing["seconds"]
        and round(timing["index_seconds"], 3) == timing["index_seconds"]
    )
    assert all(type(v) is float for v in timing.values())
    assert timing["rows_per_second"] > 0 and round(timing["rows_per_second"], 1) == timing["rows_per_second"]
    assert timing["rows_per_second"] >= 5 / (timing["seconds"] + 0.0005) - 0.05  # "seconds" is rounded too
    report = _decon(inp, tmp_path / "k2.jsonl", [benches[1]], quiet=False, text_field="prompt")
    assert report["removed_rows_file"] == str(tmp_path / "k2.jsonl.removed.jsonl")
    assert report["params"]["text_field"] == "prompt"
    assert "klear data decontaminate: 5 rows in, 4 rows out, 1 removed (exact: 1)" in capsys.readouterr().out
    clean = _decon(inp, tmp_path / "k3.jsonl", [tmp_path / "a.jsonl"], n=9)
    assert clean["removed"] == {} and clean["removed_rows_file"] is None and clean["benchmark_ngrams"] == 0


def test_json_and_parquet_rows_errors_and_text_field(tmp_path, benches):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "train.json"
    inp.write_text(json.dumps([_row("fine", 0), _row("alpha beta gamma delta", 1), {"prompt": 7}]))
    with pytest.raises(ValueError, match=r"train\.json: row 2: field 'prompt' is int 7"):
        _decon(inp, tmp_path / "o.jsonl", benches)
    rows = [{"q": {"text": t}, "id": f"r{i}", "prompt": "not read"} for i, t in enumerate(TEXTS)]
    inp = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    out = tmp_path / "o.jsonl"
    report = _decon(inp, out, benches, text_field="q.text")
    assert report["rows_out"] == 2 and [(r["row"], r["id"]) for r in _removed(out)] == [(0, "r0"), (2, "r2"), (3, "r3")]


def test_jobs_hold_batch_size_rows_of_every_format(tmp_path, benches, monkeypatch):
    import gzip
    import multiprocessing

    import pyarrow as pa
    import pyarrow.parquet as pq

    pools = []

    class Ctx:
        def Pool(self, processes):
            pools.append(_FakePool(processes))
            return pools[-1]

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: Ctx())
    rows = [_row(TEXTS[i % 5], i) for i in range(23)]
    gz = tmp_path / "train.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for inp, kind in ((gz, "lines"), (parquet, "texts")):
        out = tmp_path / f"kept-{kind}.jsonl"
        report = _decon(inp, out, benches, workers=2, batch_size=5)
        jobs = pools[-1].jobs
        assert [job[0] for job in jobs] == [kind] * 5 and [len(job[-1]) for job in jobs] == [5, 5, 5, 5, 3]
        assert (report["rows_in"], report["rows_out"]) == (23, 9)
        assert [json.loads(x)["extra_info"]["index"] for x in out.read_text().splitlines()] == [
            i for i in range(23) if i % 5 in (1, 4)
        ]


def test_an_empty_benchmark_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"^{path}: no rows \(empty benchmark file\)$"):
        NgramIndex(4).add_file(path)


def test_the_bitmap_is_capped_at_2_26_entries():
    # 2^21 + 1 n-gram positions would ask for 2^27 entries (32 per n-gram): 2^26 (64 MB) is the most
    index = NgramIndex(1)
    index.add_text("a " * (2**21 + 1), "b.jsonl", "p")
    index.finalize()
    assert index.num_ngrams == 2**21 + 1 and index.bits == 26 and index.table.size == 2**26
