"""klear data decontaminate: word n-gram decontamination (paper Sec. 3.1, 4.1) and its tokenisation."""

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import shared_file
from klear.cli import main
from klear.data import decontam
from klear.data.decontam import NgramIndex, decontaminate_file
from klear.data.text import ngram_tokens, normalize_for_dedup, row_text

# A benchmark problem of 24 words (tokens), written with LaTeX, and a short one (4 tokens).
AIME = (
    "Among the $900$ residents of Aimeville, there are $195$ who own a diamond ring, "
    "$367$ who own a set of golf clubs, and $562$ who own a garden spade."
)
SHORT = "Compute $\\dbinom{8}{4}$."
GSM = "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins."


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rl_row(text, index):
    return {
        "prompt": [{"role": "user", "content": text}],
        "data_source": "math_x",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"index": index},
    }


@pytest.fixture()
def bench(tmp_path):
    aime = write_jsonl(
        tmp_path / "aime.jsonl", [{"messages": [{"role": "user", "content": AIME}], "meta": {"unique_id": "2024-II-1"}}]
    )
    math = write_jsonl(tmp_path / "math.jsonl", [{"problem": SHORT, "unique_id": "test/counting/1"}])
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": GSM, "answer": "18"}])
    return [aime, math, gsm]


def run(tmp_path, bench, texts, **kw):
    inp = write_jsonl(tmp_path / "train.jsonl", [rl_row(t, i) for i, t in enumerate(texts)])
    out = tmp_path / "kept.jsonl"
    report = decontaminate_file(inp, out, bench, progress=False, quiet=True, workers=1, **kw)
    kept = [json.loads(line)["extra_info"]["index"] for line in out.read_text().splitlines()]
    removed_file = tmp_path / "kept.jsonl.removed.jsonl"
    removed = [json.loads(line) for line in removed_file.read_text().splitlines()] if removed_file.exists() else []
    return kept, removed, report


# ------------------------------------------------------------------ tokenisation


def test_tokens_latex_punctuation_and_lines():
    same = ["$x^2$", "x^2", "\\(x^{2}\\)", "\\[ x^2 \\]", "$$x^{2}$$", "x²", "X ^ 2"]
    assert {tuple(ngram_tokens(s)) for s in same} == {("x", "2")}
    assert ngram_tokens("\\dfrac{1}{2} \\left( a \\right) \\le 3 \\text{ apples}") == [
        "frac",
        "1",
        "2",
        "a",
        "leq",
        "3",
        "apples",
    ]
    assert ngram_tokens("one two\nthree\r\n  four") == ["one", "two", "three", "four"]
    assert ngram_tokens("Ｆｉｎｄ ＡＢＣ, a_1") == ["find", "abc", "a", "1"]
    assert ngram_tokens("中文题 x") == ["中", "文", "题", "x"]
    assert normalize_for_dedup("  Ｆind\tTHE\n answer ") == "find the answer"


def test_numpy_scanner_tokenises_like_the_documented_rule():
    # the fast scanner used for matching must cut exactly the tokens of ngram_tokens
    rng = random.Random(7)
    alphabet = "abXY09 _-^$\\{}()[].,\n\té中文かß²₃ﬁＡ１٣—“”"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        norm = decontam.normalize_for_ngrams(text)
        starts, ends, _, _ = decontam._scan(norm, batch=False)
        assert [norm[a:b] for a, b in zip(starts.tolist(), ends.tolist())] == ngram_tokens(text), repr(text)


def test_token_hashes_do_not_depend_on_the_rest_of_the_text():
    # the same token must hash the same in an ASCII batch and in a non-ASCII one (different code
    # paths), long tokens (> 64 bytes, finished in Python) included
    long_ascii = "z" * 150 + "q"
    maps = []
    for text in (
        "abc hello " + long_ascii + " x12345678 abcdefgh",
        "é 中 abc hello " + long_ascii + " x12345678 abcdefgh",
    ):
        norm = decontam.normalize_for_ngrams(text)
        starts, ends, hashes, _ = decontam._scan(norm, batch=False)
        maps.append({norm[a:b]: h for a, b, h in zip(starts.tolist(), ends.tolist(), hashes.tolist())})
    common = maps[0].keys() & maps[1].keys()
    assert len(common) == 5 and all(maps[0][t] == maps[1][t] for t in common)
    assert len(set(maps[1].values())) == len(maps[1]) == 7
    long = "z" * 150 + "é" * 40 + "q"
    index = NgramIndex(3)
    index.add_text("alpha " + long + " omega end", "b.jsonl", "p1")
    hits = index.match_texts(
        [
            "ASCII text then ALPHA " + long.upper() + " OMEGA",
            "€ alpha " + long + " omega",
            "alpha " + long[:-1] + " omega",
        ]
    )
    assert [h and h.problem_id for h in hits] == ["p1", "p1", None]


# ------------------------------------------------------------------ the rule


def test_planted_ninegrams_removed_with_spacing_case_latex_and_line_breaks(tmp_path, bench):
    # each plants 9+ consecutive benchmark words inside a longer, otherwise different prompt
    texts = [
        "Consider a town. AMONG THE 900 RESIDENTS OF AIMEVILLE,\n there are 195 who own things. What now?",
        "Paraphrase: of Aimeville there are \\(195\\) who own a diamond ring; find the rest of the answer.",
        "Here janet’s ducks lay 16 eggs\nper\nday. She eats some. Count them please, friend.",  # curly quote
        "We know that $367$ who own a set of golf clubs and $562$ who own a garden spade. Go on.",
        "Completely unrelated: a triangle has sides 3, 4 and 5; find its area in square units please.",
    ]
    kept, removed, report = run(tmp_path, bench, texts)
    assert kept == [4]
    by_row = {r["row"]: r for r in removed}
    assert set(by_row) == {0, 1, 2, 3}
    assert by_row[0]["reason"] == "ngram"
    assert by_row[0]["benchmark"].endswith("aime.jsonl") and by_row[0]["problem_id"] == "2024-II-1"
    assert by_row[0]["ngram"] == "among the 900 residents of aimeville there are 195"
    assert by_row[2]["benchmark"].endswith("gsm.jsonl") and by_row[2]["problem_id"] == "row 0"
    assert report["removed"] == {"ngram": 4} and report["rows_in"] == 5 and report["rows_out"] == 1
    assert report["params"]["n"] == 9


def test_benchmark_rewrapped_across_lines_is_caught(tmp_path, bench):
    # the benchmark problem re-wrapped at other places, as a file copy would look
    wrapped = AIME.replace(" ", "\n", 3).replace(", ", ",\n")
    kept, removed, _ = run(tmp_path, bench, [wrapped, "x " + wrapped.replace("\n", "  ") + " y"])
    assert kept == [] and len(removed) == 2


def test_only_eight_shared_words_are_kept_and_n_is_read(tmp_path, bench):
    eight = "Intro words here: among the 900 residents of Aimeville there are. Then something else entirely."
    assert "among the 900 residents of aimeville there are 195" not in " ".join(ngram_tokens(eight))
    kept, removed, report = run(tmp_path, bench, [eight])
    assert kept == [0] and removed == []
    kept8, removed8, report8 = run(tmp_path, bench, [eight], n=8)
    assert kept8 == [] and removed8[0]["ngram"] == "among the 900 residents of aimeville there are"
    assert report8["params"]["n"] == 8


def test_short_texts_only_removed_as_exact_copies(tmp_path, bench):
    texts = [
        "Among the 900 residents",  # 4 words of a benchmark problem, not a copy: kept
        "compute \\binom{8}{4}",  # exact normalised copy of the short MATH problem
        "Compute $\\dbinom{8}{4}$.\n\nPut your final answer within \\boxed{}.",  # copy + our instruction
        "Compute $\\dbinom{8}{5}$.",  # a different short problem: kept
        "",  # empty text: kept (no token, nothing to match)
    ]
    kept, removed, report = run(tmp_path, bench, texts)
    assert kept == [0, 3, 4]
    assert [(r["row"], r["reason"], r["problem_id"]) for r in removed] == [
        (1, "exact", "test/counting/1"),
        (2, "exact", "test/counting/1"),
    ]
    assert report["benchmarks"][str(bench[1])] == {"problems": 1, "short": 1, "empty": 0}
    # without the ignore phrase the instruction makes row 2 a different text
    kept, _, _ = run(tmp_path, bench, texts, ignore_phrases=())
    assert kept == [0, 2, 3, 4]


def test_exact_copy_of_a_long_problem_is_removed(tmp_path, bench):
    kept, removed, _ = run(tmp_path, bench, [AIME, GSM.upper()])
    assert kept == [] and {r["reason"] for r in removed} == {"ngram"}


def test_disjoint_data_loses_nothing_and_is_copied_byte_for_byte(tmp_path, bench):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)] + ["the", "of", "who", "own", "a"]
    rows = [rl_row(" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))), i) for i in range(500)]
    inp = tmp_path / "train.jsonl"
    inp.write_text("".join(json.dumps(r, indent=None, separators=(", ", ":")) + "\n" for r in rows) + "\n\n")
    out = tmp_path / "kept.jsonl"
    report = decontaminate_file(inp, out, bench, progress=False, quiet=True, workers=1, batch_size=64)
    assert out.read_text() == inp.read_text().rstrip("\n") + "\n"
    assert report["rows_in"] == report["rows_out"] == 500 and report["removed"] == {}
    assert not (tmp_path / "kept.jsonl.removed.jsonl").exists()


def test_hash_collisions_never_remove_a_row(tmp_path, bench, monkeypatch):
    # with a degenerate window hash every window collides with every benchmark n-gram that ends in
    # the same token; only the token-by-token check stands between them and a false removal
    monkeypatch.setattr(decontam, "_P", np.uint64(0))
    texts = [
        "one two three four five six seven eight spade.",  # shares only the last word
        "x " + AIME.split("$367$")[1],
    ]  # shares a real 9-gram
    kept, removed, _ = run(tmp_path, bench, texts)
    assert kept == [0] and [r["row"] for r in removed] == [1]


def test_parquet_in_out_and_worker_processes_agree(tmp_path, bench):
    texts = [
        f"filler {i} " + ("of Aimeville there are 195 who own a diamond ring" if i % 7 == 0 else "words")
        for i in range(300)
    ]
    rows = [rl_row(t, i) for i, t in enumerate(texts)]
    inp = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    out1, out2 = tmp_path / "k1.parquet", tmp_path / "k2.jsonl"
    r1 = decontaminate_file(inp, out1, bench, progress=False, quiet=True, workers=1, batch_size=50)
    r2 = decontaminate_file(inp, out2, bench, progress=False, quiet=True, workers=2, batch_size=50)
    expected = [i for i in range(300) if i % 7 != 0]
    kept1 = [r["extra_info"]["index"] for r in pq.read_table(out1).to_pylist()]
    kept2 = [json.loads(line)["extra_info"]["index"] for line in out2.read_text().splitlines()]
    assert kept1 == kept2 == expected
    assert r1["removed"] == r2["removed"] == {"ngram": 43}
    assert pq.read_table(out1).schema == pq.read_table(inp).schema


def test_jsonl_blocks_through_worker_processes(tmp_path, bench, monkeypatch):
    # small blocks: many jobs in flight, blank and whitespace-only lines, CRLF ends, no final newline
    monkeypatch.setattr(decontam, "_BLOCK_BYTES", 700)
    lines = []
    for i in range(200):
        lines.append(json.dumps(rl_row("x " + GSM if i % 5 == 0 else f"row {i} talks about apples", i)))
        if i % 17 == 0:
            lines.append("" if i % 2 else "  \t")
    inp = tmp_path / "train.jsonl"
    inp.write_bytes("\r\n".join(lines).encode())
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"kept{workers}.jsonl"
        report = decontaminate_file(inp, out, bench, progress=False, quiet=True, workers=workers)
        assert report["rows_in"] == 200 and report["removed"] == {"ngram": 40}
        kept = [json.loads(x)["extra_info"]["index"] for x in out.read_text().splitlines()]
        assert kept == [i for i in range(200) if i % 5]
        removed = [json.loads(x) for x in (tmp_path / f"kept{workers}.jsonl.removed.jsonl").read_text().splitlines()]
        # rows (blank lines not counted) equal the indices
        assert [r["row"] for r in removed] == [int(r["id"]) for r in removed] == list(range(0, 200, 5))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and b"\r" not in outs[0]
    # an error in a late block names the right line and row
    inp.write_bytes(("\n".join(lines[:150]) + "\n\n{broken\n").encode())
    n_rows = sum(1 for x in lines[:150] if x.strip())
    with pytest.raises(ValueError, match=rf"train\.jsonl: line 152 \(row {n_rows}\): invalid JSON"):
        decontaminate_file(inp, tmp_path / "e.jsonl", bench, progress=False, quiet=True, workers=2)
    assert not (tmp_path / "e.jsonl").exists()
    # no temporary part files, no partial output left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["aime.jsonl", "gsm.jsonl", "math.jsonl", "train.jsonl"]
        + [f"kept{w}.jsonl{x}" for w in (1, 2) for x in ("", ".removed.jsonl", ".report.json")]
    )


def test_byte_ranges_cover_every_line_once(tmp_path):
    from klear.data.io import read_line_range

    rng = random.Random(3)
    for _ in range(30):
        lines = ["x" * rng.randint(0, 12) for _ in range(rng.randint(0, 15))]
        text = "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")
        path = tmp_path / "f.jsonl"
        path.write_bytes(text.encode())
        size = len(text)
        cuts = sorted({0, size, *(rng.randint(0, size) for _ in range(rng.randint(0, 6)))})
        pieces = b"".join(read_line_range(path, a, b) for a, b in zip(cuts, cuts[1:]))
        expected = text.encode() + (b"\n" if text and not text.endswith("\n") else b"")
        assert pieces == expected, (text, cuts)


# ------------------------------------------------------------------ errors and the command line


def test_malformed_rows_name_file_row_and_field(tmp_path, bench):
    inp = write_jsonl(
        tmp_path / "bad.jsonl", [rl_row("fine text here", 0), {"prompt": [{"role": "user", "content": 5}]}]
    )
    msg = r"bad\.jsonl: row 1: field 'prompt\[0\]\.content' is int 5 \(expected a string\)"
    with pytest.raises(ValueError, match=msg):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=1)
    assert not (tmp_path / "o.jsonl").exists()  # no partial output
    inp.write_text(json.dumps(rl_row("ok", 0)) + "\n" + json.dumps({"data_source": "math"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: field 'prompt' is missing"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=2)
    inp.write_text(json.dumps(rl_row("ok", 0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 \(row 1\): invalid JSON"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=1)
    inp.write_text("  " + json.dumps(rl_row("ok", 0)) + "  \n" + json.dumps(rl_row("ok", 1)) + " x\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 \(row 1\): invalid JSON: Extra data"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=1)
    inp.write_text("  " + json.dumps(rl_row("ok", 0)) + "  \n" + json.dumps([1]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: is list \[1\] \(expected a JSON object\)"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=1)
    inp.write_text("  " + json.dumps(rl_row("ok", 0)) + "  \n")  # blanks around a row are fine (json.loads)
    assert decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True)["rows_out"] == 1
    inp.write_bytes(json.dumps(rl_row("ok", 0)).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: not valid UTF-8"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, progress=False, quiet=True, workers=1)
    bad_bench = write_jsonl(tmp_path / "bench.jsonl", [{"problem": "a b c"}, {"title": "no text"}])
    inp.write_text(json.dumps(rl_row("ok", 0)) + "\n")
    with pytest.raises(ValueError, match=r"bench\.jsonl: row 1: field 'prompt' is missing"):
        decontaminate_file(inp, tmp_path / "o.jsonl", [bad_bench], progress=False, quiet=True)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        NgramIndex(0)


def test_text_field_option(tmp_path, bench):
    rows = [
        {"extra_info": {"question": "x among the 900 residents of Aimeville there are 195 who"}, "id": 1},
        {"extra_info": {"question": "nothing to see"}, "id": 2},
    ]
    inp = write_jsonl(tmp_path / "t.jsonl", rows)
    report = decontaminate_file(
        inp, tmp_path / "o.jsonl", bench, text_field="extra_info.question", progress=False, quiet=True, workers=1
    )
    assert report["rows_out"] == 1
    with pytest.raises(ValueError, match=r"t\.jsonl: row 0: field 'question' is missing"):
        decontaminate_file(inp, tmp_path / "o.jsonl", bench, text_field="question", progress=False, quiet=True)


def test_cli_decontaminate(tmp_path, bench, capsys):
    inp = write_jsonl(tmp_path / "train.jsonl", [rl_row("x " + GSM, 0), rl_row("keep me please", 1)])
    out = tmp_path / "kept.parquet"
    code = main(
        [
            "data",
            "decontaminate",
            str(inp),
            str(out),
            "--against",
            *map(str, bench),
            "--n",
            "9",
            "--no-progress",
            "--workers",
            "1",
        ]
    )
    assert code == 0
    assert "2 rows in, 1 rows out, 1 removed (ngram: 1)" in capsys.readouterr().out
    report = json.loads((tmp_path / "kept.parquet.report.json").read_text())
    assert report["removed_by_benchmark"] == {str(bench[2]): 1}
    assert [r["extra_info"]["index"] for r in pq.read_table(out).to_pylist()] == [1]
    code = main(["data", "decontaminate", str(inp), str(out), "--against", str(tmp_path / "nope.jsonl")])
    assert code == 2 and "nope.jsonl: no such file" in capsys.readouterr().err


def test_real_aime_benchmark_file(tmp_path):
    aime = shared_file("math", "aime24.qs.jsonl")
    first = json.loads(aime.read_text().splitlines()[0])
    problem = row_text(first, "aime")
    # the problem without its dollar signs, wrapped differently, inside a longer prompt
    planted = "Solve this:\n" + problem.replace("$", "").replace(", ", ",\n") + "\nShow your work."
    kept, removed, _ = run(tmp_path, [aime], [planted, "What is the sum of the first 10 positive integers?"])
    assert kept == [1] and removed[0]["problem_id"] == first["meta"]["unique_id"]


def test_benchmark_script_agrees_with_its_baseline(tmp_path):
    # benchmarks/decontam.py on a small input: our implementation and the plain-Python baseline
    # must keep exactly the same rows and remove every planted contamination (exit code 0)
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decontam.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rows", "3000", "--workers", "1", "--keep-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical kept rows: True" in proc.stdout
    import re

    planted = re.search(r"planted contaminations left: 0 of (\d+)", proc.stdout)
    assert planted and int(planted.group(1)) > 5
