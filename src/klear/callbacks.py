"""Trainer callbacks: per-step metrics as JSONL (resumable); CPU threads while other work shares the machine."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class MetricsJsonlCallback(TrainerCallback):
    """Append every training log (one dict per logging step) to a JSONL file.

    Each line is ``{"step": global_step, "epoch": ..., <metric>: <float>, ...}``; non-finite values are
    written as ``null`` so the file stays valid JSON. On resume, rows from steps after the checkpoint
    (which are about to be recomputed) are removed first, so the file never holds a step twice.

    The summary that ``Trainer.train()`` logs when it ends (``train_runtime``, ``train_loss``, ...,
    carrying the last step's number) is not a step: it goes to ``train_summary.json`` next to the
    file (overwritten by each ``train()`` call), never into the per-step rows.

    Args:
        path: the JSONL file (parent folders are created).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash mid-write
                if row.get("step", 0) <= state.global_step and not _is_summary(row):
                    kept.append(json.dumps(row))
            self.path.write_text("".join(k + "\n" for k in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step}
        for key, value in logs.items():
            if isinstance(value, (int, float)):
                row[key] = value if math.isfinite(value) else None
        if _is_summary(row):
            (self.path.parent / "train_summary.json").write_text(json.dumps(row, indent=2) + "\n")
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _is_summary(row: dict) -> bool:
    """The end-of-train() summary log of transformers' Trainer (not an optimizer step)."""
    return "train_runtime" in row


class CpuShareCallback(TrainerCallback):
    """Runs a :class:`klear.precision.CpuShareGuard` at the end of each optimizer step (on the trainer's thread) and
    logs each change of torch's threads."""

    def __init__(self, guard):
        self.guard = guard

    def on_step_end(self, args, state, control, **kwargs):
        self._check(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._check(state)  # the evaluation after training gets the threads the machine allows now

    def _check(self, state):
        changed = self.guard.check()
        if changed == 1:
            logger.info("step %d: other work shares the CPU; computing on 1 thread until it stops", state.global_step)
        elif changed is not None:
            logger.info("step %d: the CPU is idle again; computing on %d threads", state.global_step, changed)


def cpu_share_callbacks() -> list[TrainerCallback]:
    """``[CpuShareCallback]`` where a :class:`klear.precision.CpuShareGuard` can act in this process, else ``[]``."""
    from klear.precision import CpuShareGuard

    guard = CpuShareGuard.for_this_process()
    return [] if guard is None else [CpuShareCallback(guard)]
