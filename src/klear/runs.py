"""Run plumbing shared by the training jobs (``klear rl``, ``klear sft``): recipe checks, resume, run files.

Every run directory starts with two files written by :func:`start_run`:

* ``config.yaml``: the recipe as run (after overrides), with the trainer's device/precision settings
  resolved (``bf16``/``fp16``/``use_cpu``, see :mod:`klear.precision`);
* ``run.json``: ``{"stage", "precision": {"device", "dtype", "requested"}, "versions": {...},
  "started": <unix time>}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import time
from pathlib import Path
from typing import Any

import yaml

from klear.precision import Precision

__all__ = ["AUTO_FIELDS", "check_section_keys", "check_trainer_section", "resolve_resume", "start_run"]

# Trainer fields that may be ``auto`` (resolved by klear.precision.resolve_trainer_precision).
AUTO_FIELDS = ("bf16", "gradient_checkpointing")


def check_section_keys(section: Any, allowed: set[str], where: str, source: str) -> None:
    """Raise ``ValueError`` naming ``source`` and ``where`` if ``section`` is not a mapping or has unknown keys."""
    if not isinstance(section, dict):
        raise ValueError(f"{source}: {where} must be a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown} in {where}; allowed: {sorted(allowed)}")


def check_trainer_section(trainer: Any, config_cls: type, source: str) -> None:
    """Check a recipe's ``trainer`` section against the fields of a ``TrainingArguments`` dataclass.

    Unknown keys are named with a "did you mean"; numeric fields must be numbers, boolean fields
    ``true``/``false`` (``bf16`` and ``gradient_checkpointing`` may also be ``auto``).

    Raises:
        ValueError: naming ``source`` and the field.
    """
    if not isinstance(trainer, dict):
        raise ValueError(f"{source}: 'trainer' must be a mapping, got {type(trainer).__name__}")
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(trainer) - set(fields))
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, fields, n=1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"{source}: unknown key(s) {', '.join(hints)} in 'trainer' (not {config_cls.__name__} "
                         "fields)")
    for key, value in trainer.items():
        if key in AUTO_FIELDS:
            if value is not None and value != "auto" and not isinstance(value, bool):
                raise ValueError(f"{source}: trainer.{key}={value!r} must be true, false or auto")
            continue
        default = fields[key].default
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{source}: trainer.{key}={value!r} must be a number (default {default!r})")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"{source}: trainer.{key}={value!r} must be true or false")


def resolve_resume(output_dir: Path, resume: bool | str) -> str | bool:
    """``resume`` as a checkpoint path (``True``: the latest in ``output_dir/checkpoints``), or ``False``.

    Raises:
        FileNotFoundError: no checkpoint to resume from.
    """
    ckpt_dir = Path(output_dir) / "checkpoints"
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
        if last is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {ckpt_dir}")
        return last
    if resume and not Path(resume).is_dir():
        raise FileNotFoundError(f"--resume: checkpoint {resume} does not exist")
    return resume or False


def start_run(output_dir: Path, config: dict[str, Any], trainer_cfg: dict[str, Any], precision: Precision,
              *, stage: str) -> None:
    """Create the run directory, write ``config.yaml`` and ``run.json`` (module docstring) and print the precision.

    Args:
        output_dir: the run directory (created).
        config: the recipe as given (after overrides).
        trainer_cfg: its ``trainer`` section after device/precision resolution (written in its place).
        precision: the resolved decision.
        stage: ``"rl"`` or ``"sft"``.

    Raises:
        ValueError: ``output_dir`` is a file, or cannot be written (permissions, full disk): one line.
    """
    import torch
    import transformers
    import trl

    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {out}: is an existing file (expected a directory, or a path that does not exist)")
    resolved = {**config, "trainer": {k: v for k, v in trainer_cfg.items() if k in config["trainer"] or k in (
        "bf16", "fp16", "use_cpu", "gradient_checkpointing")}}
    run = {"stage": stage, "precision": precision.as_dict(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
           "started": time.time()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        (out / "run.json").write_text(json.dumps(run, indent=2, default=str))
    except OSError as e:  # read-only folder, full disk, a parent that is a file, ...
        raise ValueError(f"output_dir {out}: cannot write the run directory ({e.strerror or e})") from None
    print(precision.describe(), flush=True)


def heldout_eval(model, tokenizer, heldout, *, max_new_tokens: int, batch_size: int, path: Path, reuse: bool,
                 annotate=None) -> dict[str, Any]:
    """Greedy held-out evaluation (:func:`klear.eval.heldout.evaluate`) saved to ``path`` (reused on resume).

    Args:
        model, tokenizer: the model under training and its tokenizer (its training flag is restored).
        heldout: rows in the verl RL layout.
        max_new_tokens, batch_size: decoding budget and prefill batch.
        path: the JSON file written (``eval_before.json`` / ``eval_after.json``).
        reuse: return the saved result when ``path`` exists (a resumed run keeps its "before").
        annotate: optional ``fn(result) -> None`` adding stage-specific fields before saving.
    """
    from klear.eval.heldout import evaluate

    path = Path(path)
    if reuse and path.is_file():
        return json.loads(path.read_text())
    result = evaluate(model, tokenizer, heldout, max_new_tokens=int(max_new_tokens), batch_size=int(batch_size))
    if annotate is not None:
        annotate(result)
    path.write_text(json.dumps(result, indent=1))
    return result
