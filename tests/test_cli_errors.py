"""Command-line errors are one line and name what was expected (issue 14, "left alone earlier")."""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from conftest import pass_at_k_argv, shared_file
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


def test_a_key_given_twice_in_a_recipe_is_refused_with_its_line(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys silently: a recipe's first `learning_rate` would vanish."""
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("trainer:\n  learning_rate: 1.0e-6\n  max_steps: 3\n  learning_rate: 3.0e-5\n")
    assert main(["rl", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"klear rl: error: {recipe}: not valid YAML: line 4, column 3: ")
    assert "'learning_rate' is given twice" in err[0]
    merged = tmp_path / "merge.yaml"  # a key brought in by a << merge may be overridden, as YAML intends
    merged.write_text("base: &b {lr: 1, steps: 2}\ntrainer:\n  <<: *b\n  lr: 3\n")
    assert load_config(str(merged))[0]["trainer"] == {"lr": 3, "steps": 2}


def test_a_config_path_in_another_folder_is_not_taken_for_the_shipped_file_of_that_name(tmp_path, capsys, monkeypatch):
    """`--config /no/such/dir/rl_demo.yaml` (a typo in a path) silently ran the shipped rl_demo."""
    from klear.config import CONFIG_DIR, find_config

    missing = tmp_path / "nowhere" / "rl_demo.yaml"
    with pytest.raises(FileNotFoundError, match=f"^config '{re.escape(str(missing))}' not found \\(no such file\\)$"):
        find_config(missing)
    assert main(["rl", "--config", str(missing), "--dry-run"]) == 2
    assert "not found (no such file)" in capsys.readouterr().err
    # the shipped file by its name, or as the repository shows it, from any folder
    monkeypatch.chdir(tmp_path)
    for name in ("rl_demo", "rl_demo.yaml", "configs/rl_demo.yaml", "./configs/rl_demo"):
        assert find_config(name) == CONFIG_DIR / "rl_demo.yaml"


def test_a_key_given_twice_on_the_command_line_keeps_the_last():
    """Overrides apply in order (scripts append to a shared list): the last value of a repeated key wins."""
    config = {"trainer": {"max_steps": 5}}
    assert apply_overrides(config, ["trainer.max_steps=1", "trainer.max_steps=2"])["trainer"] == {"max_steps": 2}


def test_a_mapping_override_merges_into_its_section():
    """`trainer={alpha: 0.2}` changes alpha and keeps the section's other keys (it used to replace the section)."""
    config = {"trainer": {"learning_rate": 3e-5, "alpha": 0.1, "sub": {"a": 1, "b": 2}}, "model": "m"}
    out = apply_overrides(config, ["trainer={alpha: 0.2, sub: {b: 5}}", "eval={every_steps: 4}"])
    assert out == {
        "trainer": {"learning_rate": 3e-5, "alpha": 0.2, "sub": {"a": 1, "b": 5}},
        "model": "m",
        "eval": {"every_steps": 4},
    }
    assert config["trainer"]["alpha"] == 0.1  # the input is not changed
    # a scalar or list for a section was taken, then failed later on an unrelated key (an experiment's trainer.seed)
    for text, shown in (("trainer.sub=3", "3"), ("trainer=[1]", "[1]")):
        name = text.split("=")[0]
        message = f"override '{text}': {name} is a section: give it a mapping or set one of its keys ({name}.KEY), not "
        with pytest.raises(ValueError, match=f"^{re.escape(message + shown)}$"):
            apply_overrides(config, [text])
        assert apply_overrides(config, [f"{name}=null"]) is not None  # None may still clear a section
    assert apply_overrides(config, ["trainer.sub=null"])["trainer"]["sub"] is None
    with pytest.raises(ValueError, match=r"^override 'model.x=1': model is not a section$"):
        apply_overrides(config, ["model.x=1"])


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
    assert main(pass_at_k_argv(inp, out, samples, "--k", "16")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--k 16 is larger than the samples of every problem (at most 4" in err[0], err
    assert not out.exists()
    assert main(pass_at_k_argv(inp, out, samples, "--k", "4")) == 0  # k = n: pass@4 = 1.0 for every problem
    assert len(out.read_text().splitlines()) == 3


def test_select_k_larger_than_the_rows_is_refused(tmp_path, capsys):
    inp = _jsonl(tmp_path / "rl.jsonl", _aime_rows(5))
    out = tmp_path / "o.jsonl"
    assert main(["data", "select", str(inp), str(out), "--k", "6", "--embedding", "hashing", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--k 6 is larger than the number of rows (5)" in err and not out.exists()
    assert main(["data", "select", str(inp), str(out), "--k", "5", "--embedding", "hashing", "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 5


# ------------------------------------------------------- output that cannot be written
@pytest.fixture()
def read_only_dir(tmp_path, monkeypatch):
    """A folder files cannot be created in: mode 0o555, or, as root (who writes there anyway), a folder whose
    file creation fails with EACCES (``tempfile.mkstemp``, what the early check uses)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)  # let pytest remove it
        return
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).absolute() == folder.absolute():
            raise PermissionError(errno.EACCES, "Permission denied", str(folder))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    yield folder


def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"klear {command}: error: "), captured.err
    return err[0]


@pytest.fixture()
def no_model_load(monkeypatch):
    """Loading a model (or its tokenizer) in ``klear eval`` fails the test: the check must come first."""

    def refuse(*a, **k):
        raise AssertionError("klear eval loaded the model before checking --output")

    monkeypatch.setattr("klear.models.embedded.resolve_model_path", refuse)
    monkeypatch.setattr("klear.eval.backends.load_tokenizer", refuse)


def test_eval_output_that_cannot_be_written_is_refused_before_the_model_loads(
    tmp_path, read_only_dir, no_model_load, capsys
):
    bench = _jsonl(tmp_path / "bench.jsonl", [{"id": 0, "problem": "What is 1 + 1?", "answer": "2"}])
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    cases = [
        (a_file, f"--output {a_file}: is an existing file; expected a folder"),
        (a_file / "run", f"--output {a_file / 'run'}: is an existing file ({a_file} is a file)"),
        (read_only_dir, f"--output {read_only_dir}: cannot write to folder {read_only_dir} (Permission denied)"),
        (read_only_dir / "new" / "run", f"cannot write to folder {read_only_dir} (Permission denied)"),
    ]
    for output, message in cases:
        code = main(["eval", "--model", "some/ckpt", "--benchmark", str(bench), "--output", str(output), "--n", "1"])
        line = _one_error_line(capsys, "eval")
        assert code == 2 and message in line, (output, line)
    judge = main(["eval", "--judge-only", str(bench), "--output", str(a_file)])  # no model either: still refused
    assert judge == 2 and f"--output {a_file}: is an existing file" in _one_error_line(capsys, "eval")
    assert a_file.read_text() == "not a folder" and list(read_only_dir.iterdir()) == []


def test_eval_model_without_a_readable_config_is_one_line(tmp_path, capsys):
    # a folder with no config.json (an offline hub id fails the same way): named, before any weights load
    bench = _jsonl(tmp_path / "bench.jsonl", [{"id": 0, "problem": "What is 1 + 1?", "answer": "2"}])
    empty = tmp_path / "ckpt"
    empty.mkdir()
    code = main(["eval", "--model", str(empty), "--benchmark", str(bench), "--output", str(tmp_path / "o"), "--n", "1"])
    line = _one_error_line(capsys, "eval")
    assert code == 2 and f"model {str(empty)!r}: cannot read its config.json" in line


def _dedup_input(tmp_path):
    from conftest import math_rows, write_jsonl

    rows = math_rows(3)
    return write_jsonl(tmp_path / "in.jsonl", [*rows, rows[0]])  # one duplicate: OUT.removed.jsonl is written


def test_data_output_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, read_only_dir, capsys):
    inp = _dedup_input(tmp_path)
    out = read_only_dir / "kept.jsonl"
    assert main(["data", "dedup", str(inp), str(out), "--no-progress"]) == 2
    line = _one_error_line(capsys, "data")
    assert line == f"klear data: error: {out}: cannot write to folder {read_only_dir} (Permission denied)"
    assert list(read_only_dir.iterdir()) == []
    folder = tmp_path / "a_folder.jsonl"
    folder.mkdir()
    assert main(["data", "dedup", str(inp), str(folder), "--no-progress"]) == 2
    assert f"{folder}: is a folder (expected the output file's name" in _one_error_line(capsys, "data")


def _full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _report_half_written(self, *a, **k):  # Path.write_text: some bytes land, then the disk is full
    with open(self, "w") as f:
        f.write("{")
    _full_disk()


_real_replace = os.replace


def _removed_list_not_renamed(src, dst):  # os.replace: only the removed-rows list fails
    if str(dst).endswith(".removed.jsonl"):
        _full_disk()
    _real_replace(src, dst)


@pytest.mark.parametrize(
    ("target", "fake", "left"),
    [
        ("klear.data.io.RowWriter.write", _full_disk, []),
        ("klear.data.io.RowWriter.close", _full_disk, []),  # the last rows, or the rename
        ("klear.data.io.RemovedLog.add", _full_disk, []),
        ("os.replace", _removed_list_not_renamed, ["kept.jsonl"]),
        ("pathlib.Path.write_text", _report_half_written, ["kept.jsonl", "kept.jsonl.removed.jsonl"]),
    ],
    ids=["rows", "close", "removed-list", "removed-list-rename", "report"],  # report: OUT.report.json
)
def test_data_full_disk_is_one_line_naming_the_output(tmp_path, monkeypatch, capsys, target, fake, left):
    # never a real /dev/full: the writers rename their temp file over OUT (it would replace the device node)
    inp = _dedup_input(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "kept.jsonl"
    monkeypatch.setattr(target, fake)
    assert main(["data", "dedup", str(inp), str(out), "--no-progress"]) == 2
    line = _one_error_line(capsys, "data")
    assert line == f"klear data: error: {out}: cannot write the output (No space left on device)"
    # no temp file is left; only files completed before the failure remain
    assert sorted(p.name for p in out_dir.iterdir()) == left


def test_data_unreadable_input_is_one_line_naming_the_input(tmp_path, monkeypatch, capsys):
    inp = _dedup_input(tmp_path)

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("klear.data.io._open_binary", unreadable)
    assert main(["data", "dedup", str(inp), str(tmp_path / "kept.jsonl"), "--no-progress"]) == 2
    assert _one_error_line(capsys, "data") == f"klear data: error: {inp}: Permission denied"
