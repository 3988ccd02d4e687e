"""One row reader for every stage (klear rl, sft, eval, data): same formats, same error text.

Rows are numbered from 0 over the rows (blank lines not counted) everywhere; errors in the text of
a JSONL line (invalid JSON, not UTF-8) also give its 1-based line number."""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import shared_file
from klear.cli import main
from klear.data.rl_data import load_rl_file
from klear.eval.benchmarks import load_benchmark
from klear.sft.data import load_sft_file


def _aime_rows(n: int) -> list[dict]:
    """The first *n* rows of the real verl-format AIME file (JSON lines)."""
    lines = shared_file("math", "aime960_math_verify.json").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def _latin1_file(path, rows, bad_row: int, *, blank_first: bool = True):
    """Rows as JSONL with one row's text encoded as Latin-1 (a non-UTF-8 byte); a blank line
    first, so the bad row's 1-based line is bad_row + 2, its row number bad_row."""
    parts = [b"\n"] if blank_first else []
    for i, r in enumerate(rows):
        line = json.dumps(r, ensure_ascii=False)
        parts.append(
            (line.replace("Find", "Caf\u00e9: find", 1).encode("latin-1", "replace") if i == bad_row else line.encode())
            + b"\n"
        )
    data = b"".join(parts)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("name", ["train.jsonl", "train.json", "train.jsonl.gz"])
def test_non_utf8_row_is_named_the_same_way_in_every_stage(tmp_path, name, capsys):
    rows = _aime_rows(4)
    bad = next(i for i, r in enumerate(rows) if "Find" in r["prompt"][0]["content"])
    path = _latin1_file(tmp_path / name, rows, bad)
    expected = f"{path}: line {bad + 2} (row {bad}): not valid UTF-8"

    for load in (load_rl_file, load_benchmark):
        with pytest.raises(ValueError) as info:
            load(str(path))
        assert str(info.value).startswith(expected), (load.__name__, str(info.value))

    sft_rows = [
        {"prompt": r["prompt"][0]["content"], "response": "\\boxed{" + r["reward_model"]["ground_truth"] + "}"}
        for r in rows
    ]
    sft_path = _latin1_file(tmp_path / ("sft_" + name), sft_rows, bad)
    with pytest.raises(ValueError) as info:
        load_sft_file(sft_path)
    assert str(info.value).startswith(f"{sft_path}: line {bad + 2} (row {bad}): not valid UTF-8"), str(info.value)

    out = tmp_path / "out.jsonl"
    assert main(["data", "dedup", str(path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"klear data: error: {err[0].split('error: ', 1)[1]}"] and expected in err[0], err


def test_good_rows_read_alike_in_every_format(tmp_path):
    rows = _aime_rows(3)
    for name in ("a.jsonl", "a.json", "a.jsonl.gz", "a.json.gz"):
        path = tmp_path / name
        if "jsonl" in name:
            text = ("\n".join(json.dumps(r) for r in rows) + "\n").encode()
        else:
            text = json.dumps(rows).encode()
        path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
        ds = load_rl_file(path)
        assert [x["reward_model"]["ground_truth"] for x in ds] == [r["reward_model"]["ground_truth"] for r in rows]
        assert [p.ground_truth for p in load_benchmark(str(path)).problems] == [
            r["reward_model"]["ground_truth"] for r in rows
        ]


def test_invalid_json_array_names_the_line_of_the_file(tmp_path):
    """A .json array with an error on its 4th line (after two blank lines) is named by that line and column."""
    from klear.data.io import iter_records

    path = tmp_path / "rows.json"
    path.write_text('\n\n[{"a": 1},\n {"a": }]\n')
    with pytest.raises(ValueError, match=r"rows\.json: line 4: invalid JSON: Expecting value at column 8$"):
        list(iter_records(path))
