"""The ``klear sft`` job: data -> held-out eval -> long-CoT SFT -> held-out eval -> report.

Run directory layout (``output_dir``)::

    config.yaml            the resolved recipe (after overrides)
    sft_data.jsonl         with data.train=teacher: the generated examples (prompt / completion messages)
    metrics.jsonl          one row per logging step (loss, learning_rate, grad_norm, token accuracy, ...)
    tensorboard/           TensorBoard events of the same metrics
    checkpoints/           TRL/transformers checkpoints (``--resume`` continues from the latest)
    eval_before.json       held-out results of the starting model (greedy, or avg@n: ``eval`` section)
    eval_after.json        the same for the SFT model
    eval.json              paired comparisons: accuracy and format compliance, 95% intervals, McNemar p
    training_curves.png    loss, learning rate, grad norm and token accuracy vs step
    final/                 the SFT model and tokenizer: ``klear rl model=<output_dir>/final`` continues from it

Recipe sections: ``model`` (a path, a hub id, or ``embedded``), ``output_dir``, ``seed``, ``data``,
``eval`` and ``trainer`` (every field of :class:`klear.sft.trainer.KlearSFTConfig`, i.e. TRL's
``SFTConfig`` plus ``lr_floor``). ``trainer.bf16`` and ``trainer.gradient_checkpointing`` may be
``auto``: on when a CUDA GPU is visible, off otherwise. See ``configs/sft_demo.yaml`` and
``configs/sft_klear.yaml``.

``data``:

* ``train``: ``teacher`` (the embedded procedural teacher writes worked solutions for the
  reasoning-gym ``tasks``, :func:`klear.sft.data.make_teacher_sft_dataset`) or an SFT file
  (:func:`klear.sft.data.load_sft_file`: ``messages``, or ``prompt`` + ``response``);
* ``heldout``: ``reasoning_gym`` (problems of ``tasks``, disjoint from the teacher's training
  problems), a verl RL-layout file (:func:`klear.data.rl_data.load_rl_dataset`), or ``none``;
* ``tasks``, ``train_size``, ``heldout_size``, ``system_prompt``, ``instruction``, ``data_source``:
  as in ``klear rl`` (no few-shot turn: the SFT data teaches the format);
* ``filter`` (``none`` | ``correct`` | ``by_difficulty``) and ``easy_pass_rate``: correctness
  filtering of file data, see :func:`klear.sft.data.filter_sft_dataset`.

Held-out metrics, each compared before/after with :func:`klear.stats.paired_difference`:
``accuracy`` (reward 1.0 from the held-out ``data_source``'s scorer) and ``format`` (the response
closes a think block, ``</think>``, and puts a non-empty ``\\boxed{}`` after it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from klear.recipe import SFTDataSection, SFTEvalSection, SFTRecipe, build_section
from klear.runs import Stage, check_data_source

logger = logging.getLogger(__name__)

# klear's SFT defaults under the recipe's trainer section: the loss on the response tokens only (paper Sec. 3.1)
SFT_TRAINER_DEFAULTS = {"completion_only_loss": True}

__all__ = ["build_sft_recipe", "format_compliant", "format_report", "plan_sft", "run_sft", "validate_sft_config"]


def build_sft_recipe(config: dict[str, Any], source: str = "config") -> SFTRecipe:
    """The ``klear sft`` recipe, typed and checked before any heavy work: the one validator of ``klear sft``
    (every default is a field of :class:`klear.recipe.SFTRecipe`).

    Raises:
        ValueError: an unknown key (named with its section and the file, with a "did you mean"), a missing
            required key, a value out of range, a trainer field that :class:`KlearSFTConfig` does not have or
            rejects, or a trainer value of the wrong type.
    """
    from klear.runs import check_context_holds, check_eval_section, check_int, check_trainer_section, trainer_arguments
    from klear.sft.trainer import KlearSFTConfig

    recipe = build_section(SFTRecipe, config, source)
    check_data_source(recipe.data.data_source, source)
    check_eval_section(config, source, SFTEvalSection)
    check_trainer_section(config["trainer"], KlearSFTConfig, source)
    trainer = config["trainer"]
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if trainer.get(key) is not None:
            check_int(source, f"trainer.{key}", trainer[key], 1)
    if "max_length" in trainer:  # null: no truncation; 0 would truncate every example to nothing
        check_int(source, "trainer.max_length", trainer["max_length"], 1, allow_none=True)
    warmup, steps = trainer.get("warmup_steps"), trainer.get("max_steps")
    if (
        isinstance(warmup, int)
        and warmup >= 1
        and isinstance(steps, int)
        and 0 < steps < warmup
        and trainer.get("lr_floor") is not None
    ):  # the warm-up + cosine-to-floor schedule needs W <= T
        raise ValueError(
            f"{source}: trainer.warmup_steps={warmup} exceeds trainer.max_steps={steps}: lower "
            "warmup_steps (or give it as a fraction of the steps, e.g. 0.03)"
        )
    # every check the run makes on its trainer arguments (SFTConfig's, ranges), before any model loads
    _, _, args = trainer_arguments(
        config, source=source, config_cls=KlearSFTConfig, trainer_defaults=SFT_TRAINER_DEFAULTS, machine_checks=False
    )
    check_context_holds(config, source, "trainer.max_length", args.max_length, int(args.max_length or 0))
    return recipe


#: Check the recipe before any heavy work (the name older callers use).
validate_sft_config = build_sft_recipe


def plan_sft(config: dict[str, Any], *, source: str = "config", **target: Any):
    """``klear sft --dry-run``: validate the recipe and print its per-GPU memory plan (:func:`klear.runs.dry_run`;
    ``target``: ``gpus``, ``gpu_memory_gb``, ``strategy``). Returns the plan."""
    from klear.runs import dry_run
    from klear.sft.trainer import KlearSFTConfig

    build_sft_recipe(config, source)
    return dry_run(config, source=source, config_cls=KlearSFTConfig, trainer_defaults=SFT_TRAINER_DEFAULTS, **target)


def _build_datasets(data: SFTDataSection, seed: int):
    """``(sft_train, heldout_or_None, filter_stats_or_None)`` from the ``data`` section."""
    from klear.data.rl_data import load_rl_dataset, make_reasoning_gym_dataset
    from klear.sft.data import filter_sft_dataset, load_sft_file, make_teacher_sft_dataset

    prompts = (("system_prompt", data.system_prompt), ("instruction", data.instruction))
    prompt_kwargs = {k: v for k, v in prompts if v is not None}
    tasks = data.tasks or []
    stats = None
    if data.train == "teacher":
        assert data.train_size is not None  # required with train: teacher (SFTDataSection.check)
        train, heldout = make_teacher_sft_dataset(
            tasks,
            train_size=data.train_size,
            heldout_size=data.heldout_size or 2,
            seed=seed,
            data_source=data.data_source,
            slip_rate=data.teacher_slip_rate,
            **prompt_kwargs,
        )
        if data.heldout != "reasoning_gym":
            heldout = None
    else:
        train = load_sft_file(data.train)
        heldout = None
        if data.heldout == "reasoning_gym":
            heldout = make_reasoning_gym_dataset(
                tasks,
                size=int(data.heldout_size or 0),
                seed=seed + 1,
                split="test",
                few_shot=None,
                data_source=data.data_source,
                **prompt_kwargs,
            )
    if data.filter != "none":
        train, stats = filter_sft_dataset(train, data.filter, easy_pass_rate=float(data.easy_pass_rate))
    if data.heldout not in (None, "", "none", "reasoning_gym"):
        heldout = load_rl_dataset(data.heldout)
    return train, heldout, stats


def format_compliant(text: str) -> bool:
    """True when a response closes a think block and then gives a non-empty ``\\boxed{}``: the math
    judge's extraction (:func:`klear.rewards.math_reward.final_answer`) with the think block required.
    Correctness is not considered.
    """
    from klear.rewards.math_reward import final_answer

    return final_answer(text, require_think=True)[0] is not None


def _heldout_eval(
    model, tokenizer, heldout, eval_cfg: dict, path: Path, *, reuse: bool, trainer=None
) -> dict[str, Any]:
    """Held-out accuracy and format compliance; saved to ``path`` (reused on resume).

    :func:`klear.runs.heldout_eval` (the evaluator ``klear rl`` uses too) plus ``format_ok``,
    ``format_rate``, ``think_closed_rate`` and ``mean_completion_tokens``.
    """
    from klear.runs import heldout_eval

    def annotate(result: dict[str, Any]) -> None:
        completions, k = result["completions"], result["samples_per_problem"]
        ok = [format_compliant(c) for c in completions]
        # per problem, like ``correct``: a bool (greedy) or the fraction of its k samples (avg@k)
        result["format_ok"] = ok if k == 1 else [sum(ok[i : i + k]) / k for i in range(0, len(ok), k)]
        m = max(1, len(completions))
        result["format_rate"] = sum(ok) / m
        result["think_closed_rate"] = sum("</think>" in c for c in completions) / m
        result["mean_completion_tokens"] = (
            sum(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions) / m
        )

    return heldout_eval(model, tokenizer, heldout, eval_cfg, path=path, reuse=reuse, annotate=annotate, trainer=trainer)


def format_report(report: dict[str, Any]) -> str:
    """Two human-readable lines: held-out accuracy and format compliance (:func:`klear.runs.format_paired`)."""
    from klear.runs import format_paired

    return "\n".join(
        format_paired(name, report[key]) for key, name in (("accuracy", "accuracy"), ("format", "format compliance"))
    )


class SFTStage(Stage):
    """``klear sft``'s hooks for :func:`klear.runs.run_job`."""

    name = "sft"

    def __init__(self, callbacks: list | None = None):
        from klear.utils.plotting import SFT_PANELS

        self.panels = SFT_PANELS
        self.callbacks = list(callbacks or [])

    def build_recipe(self, config: dict[str, Any], source: str) -> SFTRecipe:
        return build_sft_recipe(config, source)

    def prepare(self, job, resume):
        from klear.runs import prepare_run
        from klear.sft.trainer import KlearSFTConfig

        return prepare_run(
            job.config,
            source=job.source,
            resume=resume,
            config_cls=KlearSFTConfig,
            trainer_defaults=SFT_TRAINER_DEFAULTS,
        )

    def load_data(self, job) -> None:
        job.train, job.heldout, job.extra["filter_stats"] = _build_datasets(job.recipe.data, job.setup.seed)

    def build_trainer(self, job) -> None:
        import torch
        from transformers import AutoTokenizer

        from klear.callbacks import MetricsJsonlCallback, cpu_share_callbacks
        from klear.runs import cap_eval_batch_size, check_prompt_context, eval_settings, is_main_process
        from klear.sft.trainer import KlearSFTTrainer

        setup, recipe, out = job.setup, job.recipe, job.setup.out
        if is_main_process() and recipe.data.train == "teacher":  # generated data: keep it (a file already is one)
            job.train.to_json(str(out / "sft_data.jsonl"), lines=True, force_ascii=False)
        torch.manual_seed(setup.seed)
        tokenizer = job.tokenizer = AutoTokenizer.from_pretrained(setup.model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        job.trainer = KlearSFTTrainer(
            model=setup.model_path,
            args=setup.args,
            train_dataset=job.train,
            processing_class=tokenizer,
            callbacks=[MetricsJsonlCallback(out / "metrics.jsonl"), *cpu_share_callbacks(), *self.callbacks],
        )
        assert recipe.eval.max_new_tokens is not None  # SFTEvalSection.check
        eval_cfg = eval_settings(
            job.config,
            max_new_tokens=recipe.eval.max_new_tokens,
            batch_size=recipe.eval.batch_size,
            seed=setup.seed,
        )
        job.do_eval = job.heldout is not None and eval_cfg["enabled"]
        if job.do_eval:
            heldout_longest = check_prompt_context(
                tokenizer,
                job.heldout,
                budget=int(eval_cfg["max_new_tokens"]),
                budget_name="eval.max_new_tokens",
                context=setup.context,
                where=f"data.heldout={recipe.data.heldout}",
            )
            tokens = heldout_longest + int(eval_cfg["max_new_tokens"])
            eval_cfg = cap_eval_batch_size(eval_cfg, setup, tokens=tokens)
        job.eval_cfg = eval_cfg
        job.model = job.trainer.accelerator.unwrap_model(job.trainer.model)

    def evaluate(self, job, path, *, reuse: bool) -> dict[str, Any]:
        return _heldout_eval(
            job.model, job.tokenizer, job.heldout, job.eval_cfg, path, reuse=reuse, trainer=job.trainer
        )

    def before_training(self, job, before) -> None:
        from klear.runs import is_main_process

        if before is None:
            return
        if is_main_process():
            print(
                f"held-out before SFT: accuracy {before['accuracy']:.3f}, format compliance "
                f"{before['format_rate']:.3f} (n={before['n']})",
                flush=True,
            )
        job.model.train()

    def report(self, job, before, after) -> dict[str, Any]:
        from klear.runs import eval_fields
        from klear.stats import paired_difference

        report: dict[str, Any] = {
            "model": str(job.config["model"]),
            "steps": job.trainer.state.global_step,
            "train_examples": len(job.train),
        }
        if job.extra["filter_stats"] is not None:
            report["filter"] = job.extra["filter_stats"]
        if before is not None and after is not None:
            report["accuracy"] = paired_difference(before["correct"], after["correct"])
            report["format"] = paired_difference(before["format_ok"], after["format_ok"])
            report["mean_completion_tokens"] = {
                "before": before["mean_completion_tokens"],
                "after": after["mean_completion_tokens"],
            }
            report.update(eval_fields(before, after))
        return report

    def report_text(self, report: dict[str, Any]) -> str:
        return format_report(report)

    def finished(self, job) -> None:
        from klear.runs import is_main_process

        if is_main_process():
            out = job.setup.out
            print(
                f"SFT model: {out / 'final'}  (continue with: klear rl model={out / 'final'} data.few_shot=null "
                f"data.data_source=math_longcot_reasoning_gym ...)",
                flush=True,
            )


def run_sft(
    config: dict[str, Any], *, source: str = "config", resume: bool | str = False, callbacks: list | None = None
) -> dict[str, Any]:
    """Run the SFT job described by ``config`` (see the module docstring): :func:`klear.runs.run_job` with
    :class:`SFTStage` (``callbacks``: extra ``TrainerCallback`` objects, e.g. a progress bar).

    Returns:
        ``{"model", "steps", "train_examples", "filter"?, "accuracy"?, "format"?}``; the last two are
        :func:`klear.stats.paired_difference` results (when a held-out set is evaluated).

    Raises:
        ValueError: an invalid recipe (see :func:`build_sft_recipe`) or dataset.
        FileNotFoundError: ``resume`` was asked but there is no checkpoint, or a data file is missing.
    """
    from klear.runs import run_job

    return run_job(SFTStage(callbacks), config, source=source, resume=resume)
