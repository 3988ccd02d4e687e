"""Resume logic without a model (klear.lifecycle, klear.runs.resolve_resume): which checkpoints count, which one
``--resume`` takes, and LifecycleMixin's rules (complete saves, exact step count, finite training) on a stand-in
for ``transformers.Trainer`` with only the attributes the mixin reads. The same rules through real ``klear rl`` /
``klear sft`` runs: tests/test_lifecycle.py."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import klear.lifecycle as lifecycle
import klear.runs as runs
from klear.lifecycle import (
    COMPLETE_MARKER,
    LifecycleMixin,
    _one_line,
    checkpoint_step,
    complete_checkpoints,
    is_complete_checkpoint,
    latest_complete_checkpoint,
    mark_complete,
)
from klear.runs import resolve_resume


def _ckpt(root: Path, name: str, *, marker=None, state=None) -> Path:
    """A checkpoint directory with an optional marker / trainer_state.json (a dict is written as JSON, a str as is)."""
    path = root / name
    path.mkdir(parents=True)
    for file, content in ((COMPLETE_MARKER, marker), ("trainer_state.json", state)):
        if content is not None:
            (path / file).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# ---------------------------------------------------------------- file rules
@pytest.mark.parametrize(
    "name, step",
    [
        ("checkpoint-12", 12),
        ("checkpoint-0", 0),
        ("checkpoint-", None),
        ("checkpoint-1x", None),
        ("xcheckpoint-1", None),
        ("checkpoint--1", None),
        ("best", None),
    ],
)
def test_checkpoint_step(name, step):
    assert checkpoint_step(name) == step
    assert checkpoint_step(Path("/runs/a") / name) == step  # only the last component counts


def test_a_marker_counts_only_for_its_own_step(tmp_path):
    assert is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-3", marker={"step": 3}))
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-4", marker={"step": 3}))
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-5", marker={"step": "5"}))  # not an int
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-6", marker="[6]"))  # not an object
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-7", marker='{"step": 7'))  # torn write
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-8", marker={}))
    # a directory renamed by hand: any step
    assert is_complete_checkpoint(_ckpt(tmp_path, "best", marker={"step": 99}))
    # not a directory
    (tmp_path / "checkpoint-9").write_text(json.dumps({"step": 9}))
    assert not is_complete_checkpoint(tmp_path / "checkpoint-9", legacy=True)
    assert not is_complete_checkpoint(tmp_path / "missing", legacy=True)


def test_legacy_checkpoints_count_by_their_trainer_state(tmp_path):
    ok = _ckpt(tmp_path, "checkpoint-2", state={"global_step": 2})
    assert is_complete_checkpoint(ok, legacy=True)
    assert not is_complete_checkpoint(ok)  # without legacy only a marker counts
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-3", state={"global_step": 2}), legacy=True)
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-4", state="[4]"), legacy=True)
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-5", state='{"global_step": 5'), legacy=True)
    assert not is_complete_checkpoint(_ckpt(tmp_path, "checkpoint-6"), legacy=True)
    assert is_complete_checkpoint(_ckpt(tmp_path, "renamed", state={"global_step": 40}), legacy=True)
    # a marker of another step, but a trainer_state of this one: legacy accepts it
    assert is_complete_checkpoint(
        _ckpt(tmp_path, "checkpoint-7", marker={"step": 1}, state={"global_step": 7}), legacy=True
    )


def test_complete_checkpoints_sort_by_step_and_ignore_other_entries(tmp_path):
    root = tmp_path / "checkpoints"
    c10 = _ckpt(root, "checkpoint-10", marker={"step": 10})
    c9 = _ckpt(root, "checkpoint-9", marker={"step": 9})
    c2 = _ckpt(root, "checkpoint-2", marker={"step": 2})
    c0 = _ckpt(root, "checkpoint-0", marker={"step": 0})
    c1 = _ckpt(root, "checkpoint-1", marker={"step": 1})
    i5 = _ckpt(root, "checkpoint-5", state={"global_step": 5})  # no marker while others have one: incomplete
    i3 = _ckpt(root, "checkpoint-3")
    _ckpt(root, "best", marker={"step": 11})  # not named checkpoint-<step>
    _ckpt(root, "checkpoint-x", marker={"step": 1})
    (root / "checkpoint-20").write_text("a file")
    assert complete_checkpoints(root) == ([c0, c1, c2, c9, c10], [i3, i5])
    assert latest_complete_checkpoint(root) == c10
    assert complete_checkpoints(tmp_path / "missing") == ([], [])
    assert complete_checkpoints(root / "checkpoint-20") == ([], [])  # a file, not a folder
    assert latest_complete_checkpoint(tmp_path / "missing") is None


def test_one_marker_anywhere_ends_legacy_mode(tmp_path):
    root = tmp_path / "checkpoints"
    old = _ckpt(root, "checkpoint-1", state={"global_step": 1})
    assert complete_checkpoints(root) == ([old], [])  # legacy: trainer_state.json decides
    torn = _ckpt(root, "checkpoint-2", marker='{"st')  # a marker file that does not parse still ends legacy mode
    assert complete_checkpoints(root) == ([], [old, torn])
    assert latest_complete_checkpoint(root) is None


def test_mark_complete_writes_the_marker_atomically(tmp_path):
    before = time.time()
    mark_complete(tmp_path, 7)
    after = time.time()
    marker = json.loads((tmp_path / COMPLETE_MARKER).read_text())
    assert set(marker) == {"step", "time"} and marker["step"] == 7
    assert before <= marker["time"] <= after
    assert sorted(p.name for p in tmp_path.iterdir()) == [COMPLETE_MARKER]  # no temporary file left
    mark_complete(tmp_path, torch.tensor(8))  # any int-like step
    assert json.loads((tmp_path / COMPLETE_MARKER).read_text())["step"] == 8


def test_one_line():
    assert _one_line(OSError("disk\n  full\tnow ")) == "disk full now"
    assert _one_line(OSError()) == "OSError"
    assert _one_line(ValueError("x" * 300)) == "x" * 300
    long = _one_line(ValueError("y" * 301))
    assert long == "y" * 297 + "..." and len(long) == 300


# ---------------------------------------------------------------- resolve_resume
class _Stdout(io.StringIO):
    """sys.stdout that counts flushes: resume's messages must leave the buffer before training starts."""

    flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_resume_false_is_no_resume(tmp_path):
    assert resolve_resume(tmp_path, False) is False
    assert resolve_resume(tmp_path, "") is False


def test_resume_without_checkpoints_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^--resume: no checkpoint found in {tmp_path / 'checkpoints'}$"):
        resolve_resume(tmp_path, True)
    root = tmp_path / "checkpoints"
    _ckpt(root, "checkpoint-1", marker="{")
    _ckpt(root, "checkpoint-2")
    with pytest.raises(
        FileNotFoundError,
        match=rf"^--resume: no checkpoint found in {root} \(only incomplete ones: checkpoint-1, checkpoint-2\)$",
    ):
        resolve_resume(tmp_path, True)


@pytest.mark.parametrize("main_process", [True, False])
def test_resume_takes_the_newest_complete_checkpoint_and_removes_newer_incomplete_ones(
    tmp_path, monkeypatch, main_process
):
    monkeypatch.setattr(runs, "is_main_process", lambda: main_process)
    root = tmp_path / "checkpoints"
    older = _ckpt(root, "checkpoint-1")  # incomplete but older than the one taken: left alone
    taken = _ckpt(root, "checkpoint-2", marker={"step": 2})
    newer = [_ckpt(root, "checkpoint-10"), _ckpt(root, "checkpoint-3", marker={"step": 4})]
    with contextlib.redirect_stdout(_Stdout()) as stdout:
        assert resolve_resume(tmp_path, True) == str(taken)
    assert stdout.getvalue().splitlines() == [
        "--resume: skipping incomplete checkpoint(s) checkpoint-3, checkpoint-10 (a save that did not finish); "
        "removing them",
        f"--resume: continuing from {taken} (step 2)",
    ]
    assert stdout.flushes >= 2
    assert older.is_dir() and taken.is_dir()
    # only the main process removes them (the others would race it)
    assert [p.is_dir() for p in newer] == [not main_process] * 2


def test_resume_removes_only_newer_steps_and_goes_on_when_a_removal_fails(tmp_path, monkeypatch):
    """An incomplete checkpoint of the taken step is not newer (the resumed run does not write that step again); a
    skipped checkpoint that cannot be removed (here a symbolic link, which rmtree refuses) does not stop the resume."""
    monkeypatch.setattr(runs, "is_main_process", lambda: True)
    root = tmp_path / "checkpoints"
    same_step = _ckpt(root, "checkpoint-03")
    taken = _ckpt(root, "checkpoint-3", marker={"step": 3})
    target = _ckpt(tmp_path / "elsewhere", "checkpoint-4")
    (root / "checkpoint-4").symlink_to(target, target_is_directory=True)
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert resolve_resume(tmp_path, True) == str(taken)
    assert "skipping incomplete checkpoint(s) checkpoint-4 (a save" in stdout.getvalue()
    assert same_step.is_dir() and (root / "checkpoint-4").is_symlink() and target.is_dir()


def test_resume_with_nothing_to_skip_prints_only_what_it_takes(tmp_path):
    root = tmp_path / "checkpoints"
    _ckpt(root, "checkpoint-1")
    taken = _ckpt(root, "checkpoint-7", marker={"step": 7})
    with contextlib.redirect_stdout(_Stdout()) as stdout:
        assert resolve_resume(tmp_path, True) == str(taken)
    assert stdout.getvalue() == f"--resume: continuing from {taken} (step 7)\n"
    assert stdout.flushes >= 1
    assert (root / "checkpoint-1").is_dir()


def test_resume_from_a_given_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    newest = _ckpt(root, "checkpoint-4", marker={"step": 4})
    given = _ckpt(tmp_path / "elsewhere", "checkpoint-2", marker={"step": 2})
    assert resolve_resume(tmp_path, str(given)) == str(given)
    # a checkpoint given by hand is judged by its own files: an old-style one (no marker) counts
    legacy = _ckpt(root, "checkpoint-3", state={"global_step": 3})
    assert resolve_resume(tmp_path, str(legacy)) == str(legacy)
    with pytest.raises(FileNotFoundError, match=f"^--resume-from: checkpoint {root / 'checkpoint-9'} does not exist$"):
        resolve_resume(tmp_path, str(root / "checkpoint-9"))
    partial = _ckpt(root, "checkpoint-5")
    with pytest.raises(
        ValueError,
        match=rf"^--resume-from {partial}: an incomplete checkpoint \(its save did not finish\); "
        rf"the newest complete one is {newest}$",
    ):
        resolve_resume(tmp_path, str(partial))
    other = tmp_path / "other"
    lone = _ckpt(other / "checkpoints", "checkpoint-1")
    with pytest.raises(ValueError, match=r"\(its save did not finish\); no complete checkpoint there$"):
        resolve_resume(other, str(lone))


# ---------------------------------------------------------------- LifecycleMixin on a stand-in trainer
class _BaseTrainer:
    """The parts of transformers.Trainer the mixin calls through super(), recording the calls."""

    def __init__(self, run_dir: Path, *, save_total_limit=None, should_save=True, num_processes=1):
        self.args = SimpleNamespace(save_total_limit=save_total_limit, should_save=should_save, output_dir=str(run_dir))
        self.state = SimpleNamespace(global_step=0, max_steps=-1, best_model_checkpoint=None)
        self.control = SimpleNamespace(should_training_stop=False)
        self.model = torch.nn.Linear(2, 1)
        self.calls: list = []
        self.save_error: BaseException | None = None
        self.save_writes = True
        self.losses: list[torch.Tensor] = []
        self.other_process_bad = torch.zeros(2, dtype=torch.int64)
        self.accelerator = SimpleNamespace(
            num_processes=num_processes,
            device=torch.device("cpu"),
            wait_for_everyone=lambda: self.calls.append(("wait", self._marker_written())),
            reduce=self._reduce,
        )
        self.run_dir = run_dir

    def _reduce(self, tensor, reduction):
        if tensor.device.type == "meta":  # the stand-in for an accelerator's device: no values to read
            self.calls.append(("reduce", "meta", tensor.dtype, reduction))
            return self.other_process_bad.clone()
        self.calls.append(("reduce", tensor.tolist(), tensor.dtype, reduction))
        return tensor + self.other_process_bad

    def _marker_written(self) -> bool:
        return (self.run_dir / f"checkpoint-{self.state.global_step}" / COMPLETE_MARKER).exists()

    def _get_output_dir(self, trial):
        self.calls.append(("output_dir", trial))
        return str(self.run_dir)

    def _save_checkpoint(self, model, trial):
        self.calls.append(("save", model, trial, self.args.save_total_limit))
        if self.save_writes:
            folder = self.run_dir / f"checkpoint-{self.state.global_step}"
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_text("weights")
        if self.save_error is not None:
            raise self.save_error

    def _run_epoch(self, *args, **kwargs):
        self.calls.append(("epoch", args, kwargs))
        return "epoch result"

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.calls.append(("step", model, inputs, num_items_in_batch))
        return self.losses.pop(0)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        self.calls.append(("log", args, kwargs))
        return "logged"


class _Trainer(LifecycleMixin, _BaseTrainer):
    pass


def _aged(path: Path, seconds_ago: float) -> Path:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))
    return path


def test_save_marks_the_checkpoint_complete_after_every_process_wrote_then_rotates(tmp_path):
    run = tmp_path / "checkpoints"
    c1 = _ckpt(run, "checkpoint-1", marker={"step": 1})
    c2 = _ckpt(run, "checkpoint-2", marker={"step": 2})
    # rotation goes by modification time (transformers' use_mtime): checkpoint-1 was rewritten after checkpoint-2
    _aged(c1, 100)
    _aged(c2, 200)
    trainer = _Trainer(run, save_total_limit=2)
    trainer.state.global_step = 3
    trainer._save_checkpoint("model", "trial")
    assert trainer.calls == [
        ("output_dir", "trial"),
        ("save", "model", "trial", None),  # no rotation inside the save: the new checkpoint is not complete yet
        ("wait", False),  # the marker comes after every process finished writing
    ]
    assert json.loads((run / "checkpoint-3" / COMPLETE_MARKER).read_text())["step"] == 3
    assert trainer.args.save_total_limit == 2
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-3"]  # the oldest by mtime went


def test_save_rotation_keeps_the_best_checkpoint(tmp_path):
    run = tmp_path / "checkpoints"
    best = _aged(_ckpt(run, "checkpoint-1", marker={"step": 1}), 300)
    _aged(_ckpt(run, "checkpoint-2", marker={"step": 2}), 200)
    trainer = _Trainer(run, save_total_limit=1)
    trainer.state.global_step = 3
    trainer.state.best_model_checkpoint = str(best)
    trainer._save_checkpoint("model", None)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-3"]


@pytest.mark.parametrize("limit", [None, 1])
def test_save_on_a_process_that_does_not_write_marks_and_rotates_nothing(tmp_path, limit):
    run = tmp_path / "checkpoints"
    _aged(_ckpt(run, "checkpoint-1", marker={"step": 1}), 100)
    trainer = _Trainer(run, save_total_limit=limit, should_save=False)
    trainer.state.global_step = 2
    trainer._save_checkpoint("model", None)
    assert ("wait", False) in trainer.calls
    assert not (run / "checkpoint-2" / COMPLETE_MARKER).exists()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert trainer.args.save_total_limit == limit


def _usage(free_mib: float):
    return namedtuple("usage", "total used free")(10**12, 0, int(free_mib * 2**20))


@pytest.mark.parametrize(
    "free_mib, free_text",
    [(63, "; 63 MiB free there (the disk is full)"), (64, "; 64 MiB free there"), (5000, "; 5000 MiB free there")],
)
def test_a_failed_save_removes_the_partial_checkpoint_and_is_one_line(tmp_path, monkeypatch, free_mib, free_text):
    run = tmp_path / "checkpoints"
    last = _ckpt(run, "checkpoint-1", marker={"step": 1})
    seen = []
    monkeypatch.setattr(lifecycle.shutil, "disk_usage", lambda p: seen.append(Path(p)) or _usage(free_mib))
    trainer = _Trainer(run, save_total_limit=3)
    trainer.state.global_step = 2
    error = OSError(errno.ENOSPC, "No space left\non device")
    trainer.save_error = error
    with pytest.raises(ValueError) as info:
        trainer._save_checkpoint("model", None)
    assert str(info.value) == (
        f"checkpoint {run / 'checkpoint-2'}: saving step 2 failed ([Errno 28] No space left on device){free_text}; "
        f"removed the partial checkpoint, the last complete checkpoint is {last}: free space and continue with "
        "--resume"
    )
    assert info.value.__cause__ is error
    assert seen == [run]
    assert not (run / "checkpoint-2").exists() and last.is_dir()
    assert trainer.args.save_total_limit == 3  # restored on failure too
    assert not any(call[0] == "wait" for call in trainer.calls)


def test_a_failed_save_without_a_complete_checkpoint_or_disk_figures(tmp_path, monkeypatch):
    def no_usage(path):
        raise OSError("stat failed")

    monkeypatch.setattr(lifecycle.shutil, "disk_usage", no_usage)
    run = tmp_path / "checkpoints"
    trainer = _Trainer(run, should_save=False)
    trainer.state.global_step = 1
    trainer.save_error = RuntimeError()
    with pytest.raises(
        ValueError,
        match=rf"^checkpoint {run / 'checkpoint-1'}: saving step 1 failed \(RuntimeError\); removed the partial "
        "checkpoint, no complete checkpoint yet: free space and continue with --resume$",
    ):
        trainer._save_checkpoint("model", None)
    assert (run / "checkpoint-1").is_dir()  # another process's files: only the process that saves removes them


def test_a_save_that_fails_before_writing_anything_is_still_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle.shutil, "disk_usage", lambda p: _usage(1000))
    trainer = _Trainer(tmp_path)
    trainer.state.global_step = 4
    trainer.save_error = OSError(errno.ENOSPC, "No space left on device")
    trainer.save_writes = False  # no partial folder to remove: that must not raise
    with pytest.raises(ValueError, match=r"saving step 4 failed \(\[Errno 28\] No space left on device\)"):
        trainer._save_checkpoint("model", None)


@pytest.mark.parametrize(
    "max_steps, global_step, stops",
    [(2, 2, True), (2, 3, True), (1, 1, True), (2, 1, False), (1, 0, False), (0, 5, False), (-1, 5, False)],
)
def test_run_epoch_trains_nothing_once_max_steps_is_reached(tmp_path, max_steps, global_step, stops):
    trainer = _Trainer(tmp_path)
    trainer.state.max_steps, trainer.state.global_step = max_steps, global_step
    result = trainer._run_epoch(1, 2, flag=True)
    assert trainer.control.should_training_stop is stops
    if stops:
        assert result is None and trainer.calls == []
    else:
        assert result == "epoch result" and trainer.calls == [("epoch", (1, 2), {"flag": True})]


def test_training_step_accumulates_a_non_finite_flag_without_syncing(tmp_path):
    trainer = _Trainer(tmp_path)
    losses = [torch.tensor(1.0), torch.tensor([2.0, float("inf")]), torch.tensor(3.0)]
    trainer.losses = list(losses)
    assert getattr(trainer, "_klear_nonfinite_loss", None) is None
    flags = []
    for i, loss in enumerate(losses):
        assert trainer.training_step("model", {"i": i}, 5) is loss
        flag = trainer._klear_nonfinite_loss
        assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool
        flags.append(bool(flag))
    assert flags == [False, True, True]  # once non-finite, the flag stays set until the check
    assert trainer.calls[0] == ("step", "model", {"i": 0}, 5)


def test_training_step_flags_nan_in_any_element(tmp_path):
    trainer = _Trainer(tmp_path)
    trainer.losses = [torch.tensor([float("nan"), 1.0])]
    trainer.training_step("model", {})
    assert bool(trainer._klear_nonfinite_loss)


def test_check_finite_after_a_finite_step_passes_and_resets(tmp_path):
    trainer = _Trainer(tmp_path)
    trainer._klear_nonfinite_loss = torch.tensor(False)
    assert trainer._maybe_log_save_evaluate(1, key=2) == "logged"
    assert trainer.calls == [("log", (1,), {"key": 2})]
    assert trainer._klear_nonfinite_loss is None


def test_check_finite_with_no_new_step_reads_nothing(tmp_path):
    trainer = _Trainer(tmp_path)
    with torch.no_grad():
        trainer.model.weight.fill_(float("nan"))  # would fail the check if it looked
    trainer._check_finite()
    assert trainer._klear_nonfinite_loss is None


@pytest.mark.parametrize(
    "loss_bad, params_bad, what",
    [
        (True, None, "the loss"),
        (False, float("inf"), "the parameters"),
        (False, float("nan"), "the parameters"),
        (True, float("-inf"), "the loss and the parameters"),
    ],
)
def test_check_finite_names_the_step_and_what_went_non_finite(tmp_path, loss_bad, params_bad, what):
    trainer = _Trainer(tmp_path)
    trainer.state.global_step = 4
    trainer._klear_nonfinite_loss = torch.tensor(loss_bad)
    if params_bad is not None:
        with torch.no_grad():
            trainer.model.bias.fill_(params_bad)
    with pytest.raises(ValueError) as info:
        trainer._maybe_log_save_evaluate()
    assert str(info.value) == (
        f"step 4: {what} became non-finite (NaN/inf); stopped before saving it, no checkpoint was written: lower "
        "trainer.learning_rate or check the data and rewards"
    )
    assert trainer.calls == []  # nothing logged or saved for the bad step
    assert trainer._klear_nonfinite_loss is None


def test_check_finite_names_the_last_good_checkpoint(tmp_path):
    good = _ckpt(tmp_path, "checkpoint-3", marker={"step": 3})
    _ckpt(tmp_path, "checkpoint-4")
    trainer = _Trainer(tmp_path)
    trainer.state.global_step = 5
    trainer._klear_nonfinite_loss = torch.tensor(True)
    with pytest.raises(ValueError, match=f"stopped before saving it, the last good checkpoint is {good}: lower"):
        trainer._check_finite()


def test_check_finite_of_a_model_without_parameters(tmp_path):
    trainer = _Trainer(tmp_path)
    trainer.model = torch.nn.ReLU()
    trainer._klear_nonfinite_loss = torch.tensor(False)
    trainer._check_finite()
    trainer._klear_nonfinite_loss = torch.tensor(True)
    with pytest.raises(ValueError, match=r"^step 0: the loss became non-finite"):
        trainer._check_finite()


@pytest.mark.parametrize(
    "other, what",
    [([0, 0], None), ([1, 0], "the loss"), ([0, 1], "the parameters"), ([2, 1], "the loss and the parameters")],
)
def test_check_finite_sums_the_flags_of_every_process(tmp_path, other, what):
    """With several processes each one's (loss, parameters) flags are summed, so every process stops together
    (here the other process's flags are faked in the reduce)."""
    trainer = _Trainer(tmp_path, num_processes=2)
    trainer.other_process_bad = torch.tensor(other)
    trainer._klear_nonfinite_loss = torch.tensor(False)
    if what is None:
        trainer._check_finite()
    else:
        with pytest.raises(ValueError, match=f"^step 0: {what} became non-finite"):
            trainer._check_finite()
    assert trainer.calls == [("reduce", [0, 0], torch.int64, "sum")]  # flags are counted, as integers


def test_check_finite_reduces_on_the_accelerator_s_device(tmp_path):
    trainer = _Trainer(tmp_path, num_processes=2)
    trainer.accelerator.device = torch.device("meta")
    trainer.other_process_bad = torch.tensor([0, 1])  # the reduce's answer
    trainer._klear_nonfinite_loss = torch.tensor(False)
    with pytest.raises(ValueError, match="^step 0: the parameters became non-finite"):
        trainer._check_finite()
    assert trainer.calls == [("reduce", "meta", torch.int64, "sum")]


def test_check_finite_of_one_process_does_not_reduce(tmp_path):
    trainer = _Trainer(tmp_path, num_processes=1)
    trainer.other_process_bad = torch.tensor([1, 1])  # would be added by a reduce
    trainer._klear_nonfinite_loss = torch.tensor(False)
    trainer._check_finite()
    assert trainer.calls == []
