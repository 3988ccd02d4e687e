"""A training run's lifecycle, shared by every klear trainer (``GPPOTrainer``, the TRL peer, ``KlearSFTTrainer``):
checkpoints that are complete or ignored, a resume that neither loses nor adds a step, and a run that stops
when its loss or parameters stop being finite.

* **Complete checkpoints.** A checkpoint counts once :data:`COMPLETE_MARKER` is written into it, after
  every file of the save (weights, optimizer, scheduler, RNG states, ``trainer_state.json``). A save killed
  half-way or stopped by a full disk leaves no marker: :func:`latest_complete_checkpoint` skips it, so
  ``--resume`` takes the newest complete checkpoint and says which. A save that raises removes its partial
  directory and stops the run with a one-line ``ValueError`` naming the checkpoint, the reason and the last
  complete checkpoint. Checkpoints written before the marker existed (no marker anywhere in the folder)
  count when their ``trainer_state.json`` parses.
* **Exact step count.** Resuming a run whose checkpoint is already at ``max_steps`` trains nothing
  (transformers' loop would run one more step before it checks ``max_steps``).
* **Finite training.** After each optimizer step (before that step's logging and checkpoint) the run stops
  with a one-line ``ValueError`` naming the step if any micro-batch loss or any parameter is NaN/inf; the
  last checkpoint written is still the last good one.

Module layout: the file rules here need no torch (``klear.runs`` and ``klear.experiment`` use them);
:class:`LifecycleMixin` imports torch/transformers when a trainer uses it.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = [
    "COMPLETE_MARKER",
    "LifecycleMixin",
    "checkpoint_step",
    "complete_checkpoints",
    "is_complete_checkpoint",
    "latest_complete_checkpoint",
    "mark_complete",
]

#: Written into ``checkpoint-<step>/`` when its save finished: ``{"step": <int>, "time": <unix seconds>}``.
COMPLETE_MARKER = "klear_complete.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a ``checkpoint-<step>`` directory name, or ``None`` for any other name."""
    m = _CHECKPOINT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_complete_checkpoint(path: str | Path, *, legacy: bool = False) -> bool:
    """Whether the checkpoint directory ``path`` finished saving.

    Complete: its :data:`COMPLETE_MARKER` parses and names the directory's step (any step for a directory
    not named ``checkpoint-<step>``). With ``legacy`` (a folder
    where no checkpoint has a marker: written by an older klear or plain transformers), a parsable
    ``trainer_state.json`` whose ``global_step`` is the directory's step is enough.
    """
    path = Path(path)
    if not path.is_dir():
        return False
    step = checkpoint_step(path)  # None for a directory renamed by hand: any step
    marker = _read_json(path / COMPLETE_MARKER)
    if isinstance(marker, dict) and step in (None, marker.get("step")):
        return True
    if legacy:
        state = _read_json(path / "trainer_state.json")
        return isinstance(state, dict) and step in (None, state.get("global_step"))
    return False


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    found = [(step, p) for p in ckpt_dir.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found)]


def complete_checkpoints(ckpt_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """``(complete, incomplete)`` checkpoint directories of ``ckpt_dir``, each sorted by step (oldest first).

    A missing ``ckpt_dir`` gives two empty lists.
    """
    found = _checkpoints(Path(ckpt_dir))
    legacy = not any((p / COMPLETE_MARKER).exists() for p in found)
    complete = [p for p in found if is_complete_checkpoint(p, legacy=legacy)]
    return complete, [p for p in found if p not in complete]


def latest_complete_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete checkpoint (:func:`is_complete_checkpoint`) of ``ckpt_dir`` with the highest step, or
    ``None``. Incomplete ones (a save killed or stopped by a full disk) are skipped."""
    complete, _ = complete_checkpoints(ckpt_dir)
    return complete[-1] if complete else None


def mark_complete(path: str | Path, step: int) -> None:
    """Write :data:`COMPLETE_MARKER` into the checkpoint directory ``path`` (after every other file of the save)."""
    tmp = Path(path) / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": int(step), "time": time.time()}))
    tmp.replace(Path(path) / COMPLETE_MARKER)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class LifecycleMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it in the bases) for the rules of the module
    docstring. Holds no training math; every trainer of klear uses it."""

    # provided by transformers.Trainer (annotations only, for type checkers)
    args: Any
    state: Any
    control: Any
    model: Any
    accelerator: Any

    # ------------------------------------------------------------------ complete checkpoints
    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        args = self.args
        step = self.state.global_step
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        last_good = latest_complete_checkpoint(run_dir)
        limit = args.save_total_limit
        args.save_total_limit = None  # rotate below, once this checkpoint is complete
        try:
            super()._save_checkpoint(model, trial)
        except Exception as e:  # disk full: OSError, safetensors' SafetensorError, torch's RuntimeError
            free = ""
            try:
                mib = shutil.disk_usage(run_dir).free / 2**20
                free = f"; {mib:.0f} MiB free there" + (" (the disk is full)" if mib < 64 else "")
            except OSError:
                pass
            if args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            last = f"the last complete checkpoint is {last_good}" if last_good else "no complete checkpoint yet"
            raise ValueError(
                f"checkpoint {folder}: saving step {step} failed ({_one_line(e)}){free}; removed the partial "
                f"checkpoint, {last}: free space and continue with --resume"
            ) from e
        finally:
            args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if args.should_save:
            mark_complete(folder, step)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    # ------------------------------------------------------------------ exact step count
    def _run_epoch(self, *args, **kwargs):
        state = self.state
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            # resumed at (or past) max_steps: transformers would train one step before checking
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    # ------------------------------------------------------------------ finite training
    def training_step(self, model, inputs, num_items_in_batch=None):
        import torch

        loss = super().training_step(model, inputs, num_items_in_batch)
        bad = ~torch.isfinite(loss.detach()).all()
        flag = getattr(self, "_klear_nonfinite_loss", None)
        self._klear_nonfinite_loss = bad if flag is None else (flag | bad)  # no host sync here
        return loss

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        self._check_finite()
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def _check_finite(self) -> None:
        """Raise ``ValueError`` if a loss since the last check or any parameter is non-finite (on any process)."""
        import torch

        flag = getattr(self, "_klear_nonfinite_loss", None)
        self._klear_nonfinite_loss = None
        if flag is None:  # the epoch-end call right after a step's: nothing new
            return
        params = [p.detach() for p in self.model.parameters()]
        bad_params = not torch.stack([torch.isfinite(p).all() for p in params]).all() if params else False
        bad = torch.stack([flag.reshape(()).cpu(), torch.tensor(bool(bad_params))]).to(torch.int64)
        acc = self.accelerator
        if acc.num_processes > 1:
            bad = acc.reduce(bad.to(acc.device), reduction="sum").cpu()
        if not bad.any():
            return
        step = self.state.global_step
        what = " and ".join(n for n, b in zip(("the loss", "the parameters"), bad.tolist()) if b)
        last = latest_complete_checkpoint(Path(self.args.output_dir))
        keep = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
        raise ValueError(
            f"step {step}: {what} became non-finite (NaN/inf); stopped before saving it, {keep}: lower "
            "trainer.learning_rate or check the data and rewards"
        )
