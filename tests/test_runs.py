"""klear.runs.start_run: run-directory problems are one-line errors naming output_dir (issue 14)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from klear.precision import Precision
from klear.runs import start_run

CONFIG = {"model": "m", "output_dir": "x", "trainer": {"learning_rate": 1e-6}}


def _start(out):
    start_run(out, CONFIG, {"learning_rate": 1e-6}, Precision("cpu", "float32"), stage="rl")


def test_output_dir_that_is_a_file(tmp_path):
    f = tmp_path / "run"
    f.write_text("not a directory")
    with pytest.raises(ValueError, match=r"output_dir .*run: is an existing file \(expected a directory"):
        _start(f)
    with pytest.raises(ValueError, match=r"output_dir .*run/sub: cannot write the run directory \(Not a directory\)"):
        _start(f / "sub")


@pytest.mark.parametrize("method, err, text", [
    ("mkdir", PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),  # read-only parent
    ("write_text", OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),  # full disk
])
def test_unwritable_output_dir_is_one_line(tmp_path, monkeypatch, method, err, text):
    def fail(self, *a, **k):
        raise err

    monkeypatch.setattr(Path, method, fail)
    with pytest.raises(ValueError) as info:
        _start(tmp_path / "run")
    msg = str(info.value)
    assert msg == f"output_dir {tmp_path / 'run'}: cannot write the run directory ({text})" and "\n" not in msg


def test_writes_config_and_run_json(tmp_path):
    _start(tmp_path / "run")
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "run.json").is_file()
