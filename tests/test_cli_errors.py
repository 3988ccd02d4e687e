"""Command-line errors are one line and name what was expected (issue 14, "left alone earlier")."""

from __future__ import annotations

import json

import pytest

from conftest import shared_file
from klear.cli import main
from klear.config import apply_overrides, load_config, parse_override


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _aime_rows(n):
    lines = shared_file("math", "aime960_math_verify.json").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


# ------------------------------------------------------------------------ YAML values
@pytest.mark.parametrize(
    "raw, value",
    [
        ("no", "no"),
        ("yes", "yes"),
        ("on", "on"),
        ("off", "off"),
        ("y", "y"),
        ("n", "n"),
        ("No", "No"),
        ("true", True),
        ("false", False),
        ("True", True),
        ("FALSE", False),
        ("1e-6", 1e-6),
        ("null", None),
    ],
)
def test_overrides_use_yaml_1_2_booleans(raw, value):
    assert parse_override(f"trainer.save_strategy={raw}") == (["trainer", "save_strategy"], value)


def test_recipe_files_use_yaml_1_2_booleans(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  save_strategy: no\n  logging_strategy: steps\n  bf16: false\n")
    cfg, _ = load_config(str(recipe), ["trainer.eval_strategy=no"])
    assert cfg["trainer"] == {"save_strategy": "no", "logging_strategy": "steps", "bf16": False, "eval_strategy": "no"}
    assert apply_overrides({}, ["a.b=off"]) == {"a": {"b": "off"}}


def test_yaml_syntax_error_is_one_line_with_its_position(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("trainer:\n  learning_rate: [1e-6\n  max_steps: 3\n")
    assert main(["rl", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"klear rl: error: {recipe}: not valid YAML: line 3, column ") and "expected" in err[0]
    assert main(["rl", "--config", str(recipe), "trainer.x=[1"]) == 2  # the recipe is read first
    with pytest.raises(ValueError) as info:
        parse_override("trainer.x=[1, 2")
    assert "\n" not in str(info.value) and "line 1, column" in str(info.value)


# ------------------------------------------------------------------- argparse errors
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["eval", "--n", "abc"], "klear eval: error: argument --n: invalid int value: 'abc' (see klear eval --help)"),
        (["data", "filter", "pass-at-k"], "klear data filter pass-at-k: error: the following arguments are required"),
        (["bogus"], "klear: error: argument command: invalid choice: 'bogus'"),
    ],
)
def test_usage_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(needle), err


# ------------------------------------------------------------- klear data arguments
def test_decontaminate_with_the_option_first_keeps_in_and_out(tmp_path, capsys):
    aime = shared_file("math", "aime24.qs.jsonl")
    first = json.loads(aime.read_text().splitlines()[0])["messages"][0]["content"]
    rows = [
        {"prompt": [{"role": "user", "content": first}], "data_source": "math", "extra_info": {"index": 0}},
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "data_source": "math", "extra_info": {"index": 1}},
    ]
    inp = _jsonl(tmp_path / "in.jsonl", rows)
    a, b, c = (str(tmp_path / f"{x}.jsonl") for x in "abc")
    for argv, out in (
        (["--against", str(aime), str(inp), a], a),
        ([str(inp), "--against", str(aime), b], b),
        ([str(inp), c, "--against", str(aime)], c),
    ):
        assert main(["data", "decontaminate", *argv, "--no-progress", "--workers", "1"]) == 0, argv
        kept = [json.loads(x)["extra_info"]["index"] for x in open(out)]
        assert kept == [1], argv  # the AIME problem is removed, the other row kept
    capsys.readouterr()
    assert main(["data", "decontaminate", "--against", str(aime), str(inp), "--no-progress"]) == 2
    assert "IN and OUT are required" in capsys.readouterr().err


def test_pass_at_k_larger_than_every_sample_count_is_refused(tmp_path, capsys):
    rows = _aime_rows(3)
    for i, r in enumerate(rows):
        r["extra_info"] = {"index": i}
    inp = _jsonl(tmp_path / "rl.jsonl", rows)
    samples = _jsonl(tmp_path / "s.jsonl", [{"problem_id": i, "score": 1.0} for i in range(3) for _ in range(4)])
    out = tmp_path / "o.jsonl"
    base = [
        "data",
        "filter",
        "pass-at-k",
        str(inp),
        str(out),
        "--samples",
        str(samples),
        "--id-field",
        "extra_info.index",
        "--no-progress",
    ]
    assert main([*base, "--k", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--k 16 is larger than the samples of every problem (at most 4" in err[0], err
    assert not out.exists()
    assert main([*base, "--k", "4"]) == 0  # k = n: pass@4 = 1.0 for every problem
    assert len(out.read_text().splitlines()) == 3


def test_select_k_larger_than_the_rows_is_refused(tmp_path, capsys):
    inp = _jsonl(tmp_path / "rl.jsonl", _aime_rows(5))
    out = tmp_path / "o.jsonl"
    assert main(["data", "select", str(inp), str(out), "--k", "6", "--embedding", "hashing", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--k 6 is larger than the number of rows (5)" in err and not out.exists()
    assert main(["data", "select", str(inp), str(out), "--k", "5", "--embedding", "hashing", "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 5
