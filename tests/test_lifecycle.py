"""A run's lifecycle through `klear rl` / `klear sft` (issue 20): resume takes the newest complete checkpoint and
trains exactly the missing steps, a failed checkpoint save or a non-finite step is one line, and every numeric
trainer setting is range-checked before any model loads (klear.lifecycle, klear.runs.trainer_arguments)."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import transformers
import yaml

from conftest import math_rows, write_jsonl
from klear.cli import main
from klear.lifecycle import (
    COMPLETE_MARKER,
    complete_checkpoints,
    is_complete_checkpoint,
    latest_complete_checkpoint,
    mark_complete,
)


def _recipe(tmp_path, ckpt, stage, **trainer):
    """A 2-step run that saves every step: ``(recipe path, run directory)``."""
    out = tmp_path / stage
    if stage == "rl":
        train = write_jsonl(tmp_path / "train.jsonl", math_rows(8))
        recipe = {
            "model": str(ckpt),
            "output_dir": str(out),
            "seed": 0,
            "data": {"train": str(train), "heldout": "none"},
            "trainer": {
                "num_generations": 2,
                "per_device_train_batch_size": 2,
                "steps_per_generation": 1,
                "max_completion_length": 4,
                "learning_rate": 1e-4,
                **trainer,
            },
        }
    else:
        rows = [
            {"prompt": f"What is {i} + 1?", "response": f"<think>{i} + 1</think> \\boxed{{{i + 1}}}"} for i in range(8)
        ]
        train = write_jsonl(tmp_path / "sft.jsonl", rows)
        recipe = {
            "model": str(ckpt),
            "output_dir": str(out),
            "seed": 0,
            "data": {"train": str(train), "heldout": "none"},
            "trainer": {"per_device_train_batch_size": 2, "max_length": 64, "learning_rate": 1e-4, **trainer},
        }
    recipe["trainer"] = {"max_steps": 2, "save_steps": 1, "report_to": [], **recipe["trainer"]}
    path = tmp_path / f"{stage}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, out


def _fail_at_step_2(monkeypatch, method: str, error: BaseException) -> None:
    """``transformers.Trainer.<method>`` (a part of a checkpoint save) raises ``error`` when saving step 2."""
    real = getattr(transformers.Trainer, method)

    def failing_at_step_2(self, output_dir):
        if self.state.global_step == 2:
            raise error
        return real(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, method, failing_at_step_2)


def _steps(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r or "klear/policy_loss" in r]


def _error_line(capsys, stage):
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"klear {stage}: error:")]
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------- which checkpoints count (no model)
def test_complete_checkpoints_by_marker_and_legacy(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        (ckpts / f"checkpoint-{step}").mkdir(parents=True)
        (ckpts / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    # an older run (no marker anywhere): a parsable trainer_state.json of the right step counts
    assert latest_complete_checkpoint(ckpts) == ckpts / "checkpoint-3"
    (ckpts / "checkpoint-3" / "trainer_state.json").write_text('{"global_st')  # torn write
    assert latest_complete_checkpoint(ckpts) == ckpts / "checkpoint-2"
    # once a marker exists, only marked checkpoints count
    mark_complete(ckpts / "checkpoint-1", 1)
    assert complete_checkpoints(ckpts) == ([ckpts / "checkpoint-1"], [ckpts / "checkpoint-2", ckpts / "checkpoint-3"])
    (ckpts / "checkpoint-2" / COMPLETE_MARKER).write_text(json.dumps({"step": 7}))  # another step's marker
    assert not is_complete_checkpoint(ckpts / "checkpoint-2")
    (ckpts / "checkpoint-10").mkdir()
    mark_complete(ckpts / "checkpoint-10", 10)
    assert latest_complete_checkpoint(ckpts) == ckpts / "checkpoint-10"  # by step, not by name
    assert latest_complete_checkpoint(tmp_path / "missing") is None


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_resume_skips_a_checkpoint_killed_mid_save(tmp_path, tiny_ckpt, monkeypatch, capsys, stage):
    recipe, out = _recipe(tmp_path, tiny_ckpt, stage)
    # the process dies after the weights and optimizer, before trainer_state.json
    _fail_at_step_2(monkeypatch, "_save_rng_state", KeyboardInterrupt("simulated kill mid-save"))
    with pytest.raises(KeyboardInterrupt, match="simulated kill mid-save"):
        main([stage, "--config", str(recipe)])
    partial = out / "checkpoints" / "checkpoint-2"
    assert partial.is_dir() and not (partial / COMPLETE_MARKER).exists()
    monkeypatch.undo()

    capsys.readouterr()
    assert main([stage, "--config", str(recipe), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"continuing from {out / 'checkpoints' / 'checkpoint-1'} (step 1)" in printed
    assert "skipping incomplete checkpoint(s) checkpoint-2" in printed
    assert _steps(out) == [1, 2]
    assert (out / "checkpoints" / "checkpoint-2" / COMPLETE_MARKER).is_file()


@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_resuming_a_finished_run_trains_no_extra_step(tmp_path, tiny_ckpt, stage):
    recipe, out = _recipe(tmp_path, tiny_ckpt, stage, save_total_limit=1)
    assert main([stage, "--config", str(recipe)]) == 0
    assert complete_checkpoints(out / "checkpoints") == ([out / "checkpoints" / "checkpoint-2"], [])  # rotated
    weights = {
        k: v.clone() for k, v in transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict().items()
    }
    assert main([stage, "--config", str(recipe), "--resume"]) == 0  # e.g. killed after its last checkpoint
    assert _steps(out) == [1, 2]
    assert json.loads((out / "eval.json").read_text())["steps"] == 2
    assert not (out / "checkpoints" / "checkpoint-3").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_resume_from_an_incomplete_checkpoint_is_refused(tmp_path, tiny_ckpt, capsys):
    recipe, out = _recipe(tmp_path, tiny_ckpt, "rl", max_steps=1)
    assert main(["rl", "--config", str(recipe)]) == 0
    partial = out / "checkpoints" / "checkpoint-5"
    partial.mkdir()
    assert main(["rl", "--config", str(recipe), "--resume-from", str(partial)]) == 2
    err = _error_line(capsys, "rl")
    assert "incomplete checkpoint" in err and "checkpoint-1" in err


# ---------------------------------------------------------------- a save that fails
@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_disk_full_during_a_checkpoint_save_is_one_line(tmp_path, tiny_ckpt, monkeypatch, capsys, stage):
    recipe, out = _recipe(tmp_path, tiny_ckpt, stage)
    _fail_at_step_2(monkeypatch, "_save_optimizer_and_scheduler", OSError(errno.ENOSPC, "No space left on device"))
    assert main([stage, "--config", str(recipe)]) == 2
    err = _error_line(capsys, stage)
    assert f"checkpoint {out / 'checkpoints' / 'checkpoint-2'}: saving step 2 failed" in err, err
    assert (
        "No space left on device" in err
        and f"last complete checkpoint is {out / 'checkpoints' / 'checkpoint-1'}" in err
    )
    assert not (out / "checkpoints" / "checkpoint-2").exists()  # the partial save is removed
    monkeypatch.undo()
    assert main([stage, "--config", str(recipe), "--resume"]) == 0
    assert _steps(out) == [1, 2]


# ---------------------------------------------------------------- non-finite training
def test_non_finite_parameters_stop_the_run_naming_the_step(tmp_path, tiny_ckpt, monkeypatch, capsys):
    recipe, out = _recipe(tmp_path, tiny_ckpt, "sft", max_steps=3)
    real, calls = torch.optim.AdamW.step, []

    def step(self, *a, **k):
        result = real(self, *a, **k)
        calls.append(1)
        if len(calls) == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert main(["sft", "--config", str(recipe)]) == 2
    err = _error_line(capsys, "sft")
    assert "step 2: the parameters became non-finite" in err, err
    assert f"the last good checkpoint is {out / 'checkpoints' / 'checkpoint-1'}" in err
    assert not (out / "checkpoints" / "checkpoint-2").exists()  # the bad step is never saved


def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path, tiny_ckpt, monkeypatch, capsys):
    from trl import GRPOTrainer

    recipe, out = _recipe(tmp_path, tiny_ckpt, "rl", save_steps=5)
    real = GRPOTrainer.training_step

    def nan_loss_at_step_2(self, *a, **k):
        loss = real(self, *a, **k)
        return loss * float("nan") if self.state.global_step == 1 else loss

    monkeypatch.setattr(GRPOTrainer, "training_step", nan_loss_at_step_2)
    assert main(["rl", "--config", str(recipe)]) == 2
    err = _error_line(capsys, "rl")
    assert "step 2: the loss became non-finite" in err and "no checkpoint was written" in err, err


# ---------------------------------------------------------------- settings refused before any model loads
@pytest.mark.parametrize(
    "stage, override, expected",
    [
        ("rl", "trainer.learning_rate=.inf", "trainer.learning_rate=inf must be a finite number"),
        ("rl", "trainer.learning_rate=.nan", "trainer.learning_rate=nan must be a finite number"),
        ("rl", "trainer.learning_rate=-1.0", "trainer.learning_rate=-1.0 must be >= 0"),
        ("rl", "trainer.temperature=0", "trainer.temperature=0 must be > 0"),
        ("rl", "trainer.max_steps=0", "trainer.max_steps=0 must be >= 1, or -1"),
        ("rl", "trainer.max_steps=-3", "trainer.max_steps=-3 must be >= 1, or -1"),
        ("rl", "trainer.adam_beta2=1.0", "trainer.adam_beta2=1.0 must be in [0, 1)"),
        ("sft", "trainer.learning_rate=.inf", "trainer.learning_rate=inf must be a finite number"),
        ("sft", "trainer.max_steps=0", "trainer.max_steps=0 must be >= 1, or -1"),
        ("sft", "trainer.weight_decay=-0.1", "trainer.weight_decay=-0.1 must be >= 0"),
    ],
)
def test_out_of_range_settings_are_refused_before_the_model_loads(tmp_path, stage, override, expected, capsys):
    recipe, out = _recipe(tmp_path, tmp_path / "no-such-model", stage)  # a model load would fail differently
    assert main([stage, "--config", str(recipe), override]) == 2
    err = _error_line(capsys, stage)
    assert expected in err, err
    assert not out.exists()
