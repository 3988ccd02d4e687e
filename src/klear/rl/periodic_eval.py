"""Held-out evaluation every K optimizer steps during ``klear rl`` (recipe key ``eval.every_steps``).

Each evaluation appends one row to ``<run>/heldout_curve.jsonl``::

    {"step": 8, "train_s": 412.3, "time": 1718000000.0, "accuracy": 0.31, "n": 96, "correct": [...]}

``step`` is the optimizer step, ``train_s`` the seconds spent training up to that step (held-out
evaluation time excluded, continued across ``--resume`` from the last row kept), ``time`` the Unix
time of the row, ``accuracy``/``n``/``correct`` those of :func:`klear.eval.heldout.evaluate` (per
problem, dataset order: avg@n fractions for sampled evaluation, booleans for greedy). Step 0 is the
job's "before" evaluation and the last step its "after" evaluation (:meth:`HeldoutCurveCallback.record`),
so the callback itself skips the final step instead of evaluating it twice. Every row uses the same
held-out problems and the same sampling seed (:func:`klear.runs.heldout_eval`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

CURVE_FILE = "heldout_curve.jsonl"


class HeldoutCurveCallback(TrainerCallback):
    """Evaluate on the held-out set every ``every_steps`` optimizer steps and append to ``heldout_curve.jsonl``.

    Args:
        run_dir: the run directory (the curve file goes there; evaluations are saved as
            ``heldout/step_<N>.json``).
        evaluate: ``fn(path) -> result``: one held-out evaluation of the current model saved to ``path``
            (``klear.runs.heldout_eval`` bound to the model, tokenizer, held-out rows and settings).
        every_steps: K >= 1, or ``None`` for no evaluation during training (only :meth:`record`).

    On resume (``on_train_begin`` with ``global_step > 0``), rows after the checkpoint's step are dropped:
    those steps are about to be trained again.
    """

    def __init__(self, run_dir: str | Path, evaluate, every_steps: int | None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / CURVE_FILE
        self.evaluate = evaluate
        self.every_steps = every_steps
        self._train_s = 0.0
        self._since = time.time()

    def rows(self) -> list[dict[str, Any]]:
        """The curve's rows (a line cut by a crash is skipped)."""
        if not self.path.is_file():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def record(self, step: int, result: dict[str, Any]) -> None:
        """Append ``result`` (a :func:`klear.eval.heldout.evaluate` result) as the row of ``step``; an existing
        row of that step is replaced (a resumed run re-records its "before"). ``train_s`` is the training clock as
        of the last :meth:`pause` (call it before evaluating). Only the main process writes."""
        from klear.runs import is_main_process

        if not is_main_process():
            return
        row = {
            "step": int(step),
            "train_s": self._train_s,
            "time": time.time(),
            "accuracy": result["accuracy"],
            "n": result["n"],
            "correct": result["correct"],
        }
        kept = [r for r in self.rows() if r.get("step") != row["step"]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in sorted([*kept, row], key=lambda r: r["step"])))
        self._since = time.time()  # the evaluation's own time is not training time

    def pause(self) -> None:
        """Stop the training clock (call before work that is not training, e.g. the "after" evaluation)."""
        self._train_s += time.time() - self._since
        self._since = time.time()

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        kept = [r for r in self.rows() if r.get("step", 0) <= state.global_step]
        if self.path.is_file():
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._train_s = max((r["train_s"] for r in kept), default=0.0)
        self._since = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if not self.every_steps or step % self.every_steps or step >= state.max_steps:
            return
        self.pause()
        if state.is_world_process_zero:
            (self.run_dir / "heldout").mkdir(parents=True, exist_ok=True)
        result = self.evaluate(self.run_dir / "heldout" / f"step_{step}.json")
        self.record(step, result)
        self._since = time.time()
