"""metrics.jsonl: one row per optimizer step, also across resumed train() calls (issue 14)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState, TrainingArguments

from klear.callbacks import MetricsJsonlCallback


def _summary(step):  # what transformers' Trainer logs at the end of train()
    return {
        "train_runtime": 12.5,
        "train_samples_per_second": 3.0,
        "train_steps_per_second": 0.2,
        "total_flos": 0.0,
        "train_loss": 0.1,
        "epoch": 1.0,
    }


def test_train_summary_is_not_a_step_row_and_does_not_pile_up_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    cb = MetricsJsonlCallback(path)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), report_to=[])
    control = TrainerControl()
    state = TrainerState()
    cb.on_train_begin(args, state, control)
    for step in (1, 2):
        state.global_step = step
        cb.on_log(args, state, control, logs={"loss": 0.5 / step, "reward": 0.1 * step})
    cb.on_log(args, state, control, logs=_summary(2))
    # resume from the checkpoint at step 2 and train two more steps
    state = TrainerState(global_step=2)
    cb.on_train_begin(args, state, control)
    for step in (3, 4):
        state.global_step = step
        cb.on_log(args, state, control, logs={"loss": 0.5 / step, "reward": 0.1 * step})
    cb.on_log(args, state, control, logs=_summary(4))
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all("train_runtime" not in r for r in rows)
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 4 and summary["train_runtime"] == 12.5


def test_cpu_share_callback_checks_at_each_step_end_and_at_train_end(caplog):
    import logging

    from klear.callbacks import CpuShareCallback

    class Guard:
        answers = [1, None, 2]

        def check(self):
            return self.answers.pop(0)

    callback = CpuShareCallback(Guard())
    with caplog.at_level(logging.INFO, logger="klear.callbacks"):
        for step in (1, 2):
            callback.on_step_end(None, SimpleNamespace(global_step=step), None)
        callback.on_train_end(None, SimpleNamespace(global_step=2), None)
    assert Guard.answers == []  # asked three times
    assert [r.getMessage() for r in caplog.records] == [
        "step 1: other work shares the CPU; computing on 1 thread until it stops",
        "step 2: the CPU is idle again; computing on 2 threads",
    ]
