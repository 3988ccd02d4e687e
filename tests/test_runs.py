"""klear.runs.start_run: run-directory problems are one-line errors naming output_dir (issue 14)."""

from __future__ import annotations

import errno
import json
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


@pytest.mark.parametrize(
    "method, err, text",
    [
        ("mkdir", PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),  # read-only parent
        ("write_text", OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),  # full disk
    ],
)
def test_unwritable_output_dir_is_one_line(tmp_path, monkeypatch, method, err, text):
    def fail(self, *a, **k):
        raise err

    monkeypatch.setattr(Path, method, fail)
    with pytest.raises(ValueError) as info:
        _start(tmp_path / "run")
    msg = str(info.value)
    assert msg == f"output_dir {tmp_path / 'run'}: cannot write the run directory ({text})" and "\n" not in msg


def test_writes_config_and_run_json(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _start(tmp_path / "run")
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "run.json").is_file()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    threads = torch.get_num_threads()
    assert run["cpu_runtime"] == {
        "torch_threads": threads,
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": "123",
        "OMP_NUM_THREADS": None,
    }
    line = f"cpu runtime: torch_threads={threads}, OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=123\n"
    assert line in capsys.readouterr().out


# ------------------------------------------------ run directories of failed runs; multi-process guard (issue 14)
def test_a_failed_run_removes_only_the_directories_it_created(tmp_path):
    run = start_run(tmp_path / "new" / "run", CONFIG, {"learning_rate": 1e-6}, Precision("cpu", "float32"), stage="rl")
    with pytest.raises(RuntimeError, match="boom before training"):
        with run.removed_on_failure():
            raise RuntimeError("boom before training")
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()  # the run dir and the parent made for it

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    for out, resumed in ((existing, False), (tmp_path / "resumed", True)):
        run = start_run(out, CONFIG, {"learning_rate": 1e-6}, Precision("cpu", "float32"), stage="rl", resumed=resumed)
        with pytest.raises(KeyboardInterrupt, match="Ctrl-C during the run"):
            with run.removed_on_failure():
                raise KeyboardInterrupt("Ctrl-C during the run")
        assert (out / "config.yaml").is_file(), out  # never removed: it existed before / a resumed run
    assert (existing / "notes.txt").read_text() == "mine"


def test_full_disk_at_start_leaves_no_directory(tmp_path, monkeypatch):
    def fail(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", fail)
    with pytest.raises(ValueError, match="No space left on device"):
        _start(tmp_path / "run")
    assert not (tmp_path / "run").exists()


class _OtherRank:
    is_main_process, num_processes, process_index = False, 2, 1


class _MainRank:
    is_main_process, num_processes, process_index = True, 2, 0


def test_only_the_main_process_writes_run_files_and_every_process_evaluates(tmp_path, monkeypatch, capsys):
    """Every process decodes its share of the held-out problems (``evaluate`` with its process index and
    ``gather_object``); only the main process writes the result; a saved result (resume) is read by the main
    process and sent to the others."""
    import accelerate
    import accelerate.utils
    import torch

    import klear.eval.heldout
    from klear.runs import heldout_eval

    main_result = {"accuracy": 0.5, "n": 2, "correct": [True, False]}
    sent, evaluated = [], []

    def broadcast(objs, from_process=0):  # what the main process sends
        sent.append(list(objs))
        objs[0] = saved[0]
        return objs

    def evaluate(*a, **k):
        evaluated.append((k["process_index"], k["num_processes"], k["gather"], k["compute_dtype"]))
        return dict(main_result)

    saved = [None]
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    monkeypatch.setattr(klear.eval.heldout, "evaluate", evaluate)
    model = torch.nn.Linear(2, 2)
    kw = dict(eval_cfg={"max_new_tokens": 4, "batch_size": 2}, reuse=True)
    path = tmp_path / "run" / "eval_before.json"
    expected = {**main_result, "eval_dtype": "float32", "eval_backend": "hf"}

    monkeypatch.setattr(accelerate, "PartialState", _OtherRank)
    run = start_run(tmp_path / "run", CONFIG, {"learning_rate": 1e-6}, Precision("cpu", "float32"), stage="rl")
    assert not (tmp_path / "run").exists() and run.created == () and capsys.readouterr().out == ""
    (tmp_path / "run").mkdir()
    got = heldout_eval(model, None, [{"prompt": "x"}], path=path, **kw)
    assert got == expected and sent == [[None]]  # nothing saved: computed, its share
    assert evaluated == [(1, 2, accelerate.utils.gather_object, None)]
    assert not path.exists()

    monkeypatch.setattr(accelerate, "PartialState", _MainRank)
    sent.clear(), evaluated.clear()
    got = heldout_eval(model, None, [{"prompt": "x"}], path=path, **kw)
    assert evaluated == [(0, 2, accelerate.utils.gather_object, None)] and got == expected
    assert json.loads(path.read_text()) == expected

    sent.clear(), evaluated.clear()
    saved[0] = expected
    got = heldout_eval(model, None, [{"prompt": "x"}], path=path, **kw)  # resume: the main process reads it
    assert evaluated == [] and sent == [[expected]] and got == expected
    monkeypatch.setattr(accelerate, "PartialState", _OtherRank)
    sent.clear()
    got = heldout_eval(model, None, [{"prompt": "x"}], path=path, **kw)  # and the others receive it
    assert evaluated == [] and sent == [[None]] and got == expected


@pytest.mark.parametrize("stage", ["rl", "sft"])
@pytest.mark.parametrize(
    "section, message",
    [
        ({"n_samples": 4, "temperature": 0.0}, "eval.n_samples > 1 needs eval.temperature > 0"),
        ({"temperature": -0.5}, "eval.temperature=-0.5 must be a number >= 0"),
        ({"batch_size": 0}, "eval.batch_size=0 must be an integer >= 1"),
        ({"enabled": "yes"}, "eval.enabled='yes' must be true or false"),
        ({"top_k": 5}, r"unknown key\(s\) 'top_k' in 'eval'"),
    ],
)
def test_both_jobs_check_the_eval_section_with_the_shared_rule(stage, section, message):
    """``klear rl`` and ``klear sft`` read the same ``eval`` section (the skeleton's held-out evaluation)."""
    from klear.config import load_config
    from klear.rl.job import validate_job_config
    from klear.sft.job import validate_sft_config

    config, _ = load_config("rl_demo" if stage == "rl" else "sft_demo")
    validate = validate_job_config if stage == "rl" else validate_sft_config
    validate(config, "recipe.yaml")  # the shipped recipe passes
    config["eval"] = section
    with pytest.raises(ValueError, match=f"recipe.yaml: .*{message}"):
        validate(config, "recipe.yaml")


def test_klear_sft_refuses_the_rl_only_every_steps():
    from klear.config import load_config
    from klear.sft.job import validate_sft_config

    config, _ = load_config("sft_demo")
    config["eval"] = {"every_steps": 4}
    with pytest.raises(ValueError, match="recipe.yaml: eval.every_steps is a klear rl setting"):
        validate_sft_config(config, "recipe.yaml")
