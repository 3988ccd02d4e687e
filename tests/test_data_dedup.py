"""klear data dedup: exact duplicates after NFKC / casefold / whitespace normalisation (paper Sec. 3.1)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klear.cli import main
from klear.data.dedup import dedup_file


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def rl(text, i):
    return {"prompt": [{"role": "user", "content": text}], "data_source": "math", "extra_info": {"index": i}}


def test_normalised_duplicates_keep_the_first(tmp_path):
    texts = [
        "Find the value of $x$.",  # 0 kept
        "find  the VALUE of $x$.",  # 1 duplicate of 0 (case, spacing)
        "Ｆｉｎｄ the value\nof $x$. ",  # 2 duplicate of 0 (full-width NFKC, line break, trailing space)
        "Find the value of $y$.",  # 3 kept (different)
        "Find the value of x.",  # 4 kept: punctuation/LaTeX is not normalised away by dedup
        "Find the value of $y$.",  # 5 duplicate of 3
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", [rl(t, i) for i, t in enumerate(texts)])
    report = dedup_file(inp, tmp_path / "out.jsonl", progress=False, quiet=True)
    kept = [json.loads(x)["extra_info"]["index"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept == [0, 3, 4]
    removed = [json.loads(x) for x in (tmp_path / "out.jsonl.removed.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"], r["duplicate_of"], r["id"]) for r in removed] == [
        (1, "duplicate", 0, "1"),
        (2, "duplicate", 0, "2"),
        (5, "duplicate", 3, "5"),
    ]
    assert report["rows_in"] == 6 and report["rows_out"] == 3 and report["removed"] == {"duplicate": 3}
    on_disk = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert on_disk["distinct"] == 3 and on_disk["params"]["by"] == "text"


def test_sft_layout_text_vs_conversation_key(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A"}]},
        {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "B"}]},
        {"messages": [{"role": "user", "content": "Q1 "}, {"role": "assistant", "content": "a"}]},
    ]
    inp = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert dedup_file(inp, tmp_path / "a.jsonl", progress=False, quiet=True)["rows_out"] == 1
    r = dedup_file(inp, tmp_path / "b.jsonl", by="conversation", progress=False, quiet=True)
    assert r["rows_out"] == 2  # the third row repeats the first conversation
    kept = [json.loads(x)["messages"][1]["content"] for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert kept == ["A", "B"]


def test_parquet_and_string_fields(tmp_path):
    rows = [
        {"problem": "What is 1+1?", "id": "a"},
        {"problem": "what is 1+1?", "id": "b"},
        {"problem": "What is 2+2?", "id": "c"},
    ]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    dedup_file(inp, tmp_path / "out.parquet", progress=False, quiet=True)
    assert [r["id"] for r in pq.read_table(tmp_path / "out.parquet").to_pylist()] == ["a", "c"]


def test_malformed_row_and_cli(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [rl("a", 0), {"prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"in\.jsonl: row 1: field 'prompt\[0\]\.content' is NoneType"):
        dedup_file(inp, tmp_path / "out.jsonl", progress=False, quiet=True)
    assert not (tmp_path / "out.jsonl").exists()
    inp = write_jsonl(tmp_path / "in.jsonl", [rl("a", 0), rl("A", 1), rl("b", 2)])
    assert main(["data", "dedup", str(inp), str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    assert "3 rows in, 2 rows out, 1 removed (duplicate: 1)" in capsys.readouterr().out
    assert main(["data", "dedup", str(inp), str(inp)]) == 2
    assert "output is the input file" in capsys.readouterr().err
