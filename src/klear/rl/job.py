"""The ``klear rl`` job: data -> held-out eval -> GPPO training -> held-out eval -> report.

Run directory layout (``output_dir``)::

    config.yaml            the resolved recipe (after overrides)
    metrics.jsonl          one row per optimizer step (reward, accuracy, losses, clip fractions, ...)
    tensorboard/           TensorBoard events of the same metrics
    checkpoints/           TRL/transformers checkpoints (``--resume`` continues from the latest)
    eval_before.json       held-out greedy accuracy of the starting model (per-problem results)
    eval_after.json        the same for the trained model
    eval.json              the paired comparison: accuracies, mean difference, 95% interval, McNemar p
    heldout_curve.jsonl    held-out accuracy at step 0, every eval.every_steps steps and the last step
                           (klear.rl.periodic_eval); heldout/step_<N>.json: those evaluations in full
    training_curves.png    reward, accuracy, clip fractions, entropy, grad norm vs step
    final/                 the trained model and tokenizer

Recipe sections: ``model`` (a path, a hub id, or ``embedded``), ``output_dir``, ``seed``, ``data``
(``train``/``heldout`` sources, reasoning-gym ``tasks``, sizes), ``eval`` (held-out decoding) and
``trainer`` (every field of :class:`klear.rl.trainer.GPPOConfig`, i.e. TRL's ``GRPOConfig`` plus the
Klear settings) and ``trainer_impl`` (``klear``, default, or ``trl_grpo``: plain TRL ``GRPOTrainer`` as
the peer arm, :mod:`klear.rl.trl_peer`). See ``configs/rl_demo.yaml`` and ``configs/rl_math_klear.yaml``.
"""

from __future__ import annotations

import logging
from typing import Any

from klear.recipe import TRAINER_IMPLS, UNSET, RLDataSection, RLRecipe, build_section
from klear.runs import Stage, check_data_source

logger = logging.getLogger(__name__)

# GPPOTrainer overrides TRL 1.16's private GRPOTrainer hooks (klear.rl.trainer); TRL 1.12 already differs
# (``_generate_single_turn`` takes other arguments). The klear[verl] environment pins TRL < 1.13 for verl.
MIN_TRL = (1, 16)
__all__ = ["TRAINER_IMPLS", "build_rl_recipe", "plan_rl", "run_rl", "validate_job_config"]


def build_rl_recipe(config: dict[str, Any], source: str = "config") -> RLRecipe:
    """The ``klear rl`` recipe, typed and checked before any heavy work: the one validator of ``klear rl``
    and of each ``klear experiment`` run's plan (every default is a field of :class:`klear.recipe.RLRecipe`).

    Raises:
        ValueError: an unknown key (named with its section and the file, with a "did you mean"), a missing
            required key, a value out of range, a trainer field that :class:`GPPOConfig` (or the TRL peer's
            config) rejects, or ``use_vllm`` that cannot run on this machine
            (:func:`klear.generation.vllm.cpu_rollout_settings`).
    """
    from klear.runs import check_context_holds, check_eval_section, check_int, check_trainer_section, trainer_arguments

    recipe = build_section(RLRecipe, config, source)
    if recipe.data.data_source is not UNSET:
        check_data_source(recipe.data.data_source, source)
    check_eval_section(config, source)  # eval.backend: vllm needs the run's colocated engine
    trainer_section = config["trainer"]
    for key, minimum in (
        ("num_generations", 2),
        ("per_device_train_batch_size", 1),
        ("gradient_accumulation_steps", 1),
        ("steps_per_generation", 1),
        ("max_completion_length", 1),
    ):
        if isinstance(trainer_section, dict) and trainer_section.get(key) is not None:
            check_int(source, f"trainer.{key}", trainer_section[key], minimum)
    check_trl_version()
    config_cls, trainer = trainer_config(config, source)
    check_trainer_section(trainer, config_cls, source)
    if recipe.trainer_impl == "klear":  # the loss settings first, from the mapping (Eq. 5-17's ranges)
        _check_loss_settings(trainer, config_cls, source)
    # every check the run makes on its trainer arguments (TRL's, GPPOConfig's, ranges, vLLM on CPU), now: a later
    # arm of an experiment must not fail after the earlier ones ran
    _, _, args = trainer_arguments(
        {**config, "trainer": trainer}, source=source, config_cls=config_cls, machine_checks=False
    )
    completion = int(args.max_completion_length)  # a prompt of one token + the response budget
    check_context_holds(config, source, "trainer.max_completion_length", completion, completion + 1)
    return recipe


def _check_loss_settings(trainer: dict[str, Any], config_cls: type, source: str) -> None:
    """:class:`klear.rl.losses.LossSettings` of the ``trainer`` mapping (``config_cls``'s defaults for the keys it
    leaves out), without building the trainer's arguments.

    Raises:
        ValueError: ``<source>: trainer: <what LossSettings refuses>``.
    """
    import dataclasses

    from klear.rl.losses import LossSettings

    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    names = [f.name for f in dataclasses.fields(LossSettings)]
    try:
        LossSettings(**{n: trainer.get(n, defaults[n]) for n in names})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: trainer: {' '.join(str(e).split())}") from None


#: Check the recipe before any heavy work (the name ``klear experiment`` and older callers use).
validate_job_config = build_rl_recipe


def plan_rl(config: dict[str, Any], *, source: str = "config", **target: Any):
    """``klear rl --dry-run``: validate the recipe and print its per-GPU memory plan (:func:`klear.runs.dry_run`;
    ``target``: ``gpus``, ``gpu_memory_gb``, ``strategy``). Returns the plan."""
    from klear.runs import dry_run

    build_rl_recipe(config, source)
    config_cls, trainer = trainer_config(config, source)
    return dry_run({**config, "trainer": trainer}, source=source, config_cls=config_cls, **target)


def check_trl_version() -> None:
    """Refuse a TRL older than :data:`MIN_TRL` (``klear rl``'s trainers subclass its private hooks).

    Raises:
        ValueError: one line naming the installed version and the fix.
    """
    import trl
    from packaging.version import Version

    if Version(trl.__version__).release[:2] < MIN_TRL:
        need = ".".join(map(str, MIN_TRL))
        raise ValueError(
            f"klear rl needs TRL >= {need} (installed: {trl.__version__}; the klear[verl] environment pins TRL < 1.13 "
            f"for verl's FSDP engine): run klear rl in an environment with pip install 'trl>={need},<1.17'"
        )


def trainer_config(config: dict[str, Any], source: str) -> tuple[type, dict[str, Any]]:
    """The trainer arguments class of ``config["trainer_impl"]`` and the ``trainer`` section it takes:
    :class:`GPPOConfig` and the section as written, or (``trl_grpo``) :class:`klear.rl.trl_peer.TRLPeerConfig`
    and :func:`klear.rl.trl_peer.peer_trainer_section`."""
    from klear.rl.trainer import GPPOConfig

    if config.get("trainer_impl") == "trl_grpo":
        from klear.rl.trl_peer import TRLPeerConfig, peer_trainer_section

        return TRLPeerConfig, peer_trainer_section(config["trainer"], source)
    return GPPOConfig, config["trainer"]


def _build_datasets(data: RLDataSection | dict[str, Any], seed: int):
    """``(train, heldout_or_None)`` from the ``data`` section (a mapping is built into :class:`RLDataSection`)."""
    from klear.data.rl_data import load_rl_dataset, make_reasoning_gym_dataset, make_train_and_heldout

    if not isinstance(data, RLDataSection):
        data = build_section(RLDataSection, data, "recipe")
    train_src, heldout_src = data.train, data.heldout
    if heldout_src == "humaneval" and train_src != "humaneval":
        raise ValueError(
            "data.heldout=humaneval is a split of data.train=humaneval; with your own training file "
            "set data.heldout to a file of held-out problems or to none"
        )
    if train_src == "humaneval":
        from klear.data.code_data import make_humaneval_datasets

        if heldout_src not in (None, "", "none", "humaneval"):
            raise ValueError("data.train=humaneval takes data.heldout=humaneval (a disjoint split) or none")
        return make_humaneval_datasets(
            data.train_size,
            data.heldout_size if heldout_src else 0,
            seed=seed,
            **data.given("instruction", "data_source", "system_prompt"),
        )
    rg_kwargs = data.given("instruction", "data_source", "system_prompt", "few_shot")
    tasks = data.tasks or []
    if train_src == "reasoning_gym":
        if heldout_src == "reasoning_gym":
            return make_train_and_heldout(
                tasks, train_size=data.train_size, heldout_size=data.heldout_size, seed=seed, **rg_kwargs
            )
        train = make_reasoning_gym_dataset(tasks, size=data.train_size, seed=seed, **rg_kwargs)
    else:
        train = load_rl_dataset(train_src)
    if heldout_src in (None, "", "none"):
        heldout = None
    elif heldout_src == "reasoning_gym":
        exclude = set(_question_texts(train))
        heldout = make_reasoning_gym_dataset(
            tasks,
            size=data.heldout_size,
            seed=seed + 1,
            split="test",
            exclude_questions=exclude,
            **rg_kwargs,
        )
    else:
        heldout = load_rl_dataset(heldout_src)
    return train, heldout


def _question_texts(dataset) -> list[str]:
    return [p[-1]["content"] for p in dataset["prompt"]]


class RLStage(Stage):
    """``klear rl``'s hooks for :func:`klear.runs.run_job` (GPPO, or plain TRL GRPO as the experiments' peer arm)."""

    name = "rl"

    def __init__(self, callbacks: list | None = None):
        from klear.utils.plotting import RL_PANELS

        self.callbacks = list(callbacks or [])
        self.panels = RL_PANELS

    def build_recipe(self, config: dict[str, Any], source: str) -> RLRecipe:
        return build_rl_recipe(config, source)

    def prepare(self, job, resume):
        from klear.runs import prepare_run

        config_cls, trainer = trainer_config(job.config, job.source)
        job.config = {**job.config, "trainer": trainer}
        # the memory plan is checked once the prompts are read (their length, not the whole context)
        return prepare_run(job.config, source=job.source, resume=resume, config_cls=config_cls, plan_memory=False)

    def load_data(self, job) -> None:
        from transformers import AutoTokenizer

        from klear.generation.vllm import rollout_engine_settings
        from klear.runs import cap_eval_batch_size, check_prompt_context, eval_settings, guard_memory

        setup, recipe, args = job.setup, job.recipe, job.setup.args
        tokenizer = job.tokenizer = AutoTokenizer.from_pretrained(setup.model_path, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        # datasets and prompt lengths are checked before the run directory exists
        job.train, job.heldout = _build_datasets(recipe.data, setup.seed)
        # TRL's sampler drops an incomplete rollout batch: fewer prompts than one batch would train 0 steps
        per_rollout = int(args.generation_batch_size) // int(args.num_generations)
        if len(job.train) < per_rollout:
            raise ValueError(
                f"{job.source}: data.train has {len(job.train)} prompts, fewer than one rollout batch of {per_rollout} "
                "(trainer.per_device_train_batch_size x steps_per_generation x processes / num_generations), so the "
                "run would train 0 steps: add prompts (data.train_size) or lower the batch"
            )
        context = setup.context  # the recipe's context_length, else the checkpoint's max_position_embeddings
        longest = check_prompt_context(
            tokenizer,
            job.train,
            budget=args.max_completion_length,
            budget_name="trainer.max_completion_length",
            context=context,
            where=f"data.train={recipe.data.train}",
            chat_template_kwargs=args.chat_template_kwargs,
        )
        setup.memory_plan = guard_memory(job.config, setup, source=job.source, prompt_tokens=longest)
        eval_cfg = eval_settings(
            job.config,
            max_new_tokens=recipe.eval.max_new_tokens or args.max_completion_length,
            batch_size=recipe.eval.batch_size,
            seed=setup.seed,
        )
        job.do_eval = job.heldout is not None and eval_cfg["enabled"]
        longest_heldout = (
            check_prompt_context(
                tokenizer,
                job.heldout,
                budget=eval_cfg["max_new_tokens"],
                budget_name="eval.max_new_tokens",
                context=context,
                where=f"data.heldout={recipe.data.heldout}",
            )
            if job.do_eval
            else 0
        )
        # the held-out evaluation generates on the rollout engine
        on_vllm = job.extra["on_vllm"] = job.do_eval and eval_cfg["backend"] == "vllm"
        if job.do_eval and not on_vllm:  # HF decoding on CUDA: a batch whose KV cache fits
            eval_cfg = cap_eval_batch_size(eval_cfg, setup, tokens=longest_heldout + int(eval_cfg["max_new_tokens"]))
        job.eval_cfg = eval_cfg
        # the colocated vLLM engine's context and (CPU) memory, sized from the data unless the recipe sets them
        try:
            engine = rollout_engine_settings(
                args,
                job.config["trainer"],
                model_path=setup.model_path,
                config=setup.model_config,
                longest_prompt=longest,
                on_cpu=setup.precision.device == "cpu",
                eval_need=(longest_heldout, int(eval_cfg["max_new_tokens"])) if on_vllm else None,
            )
        except ValueError as e:
            raise ValueError(f"{job.source}: {e}") from None
        for field, value in engine.items():
            setattr(args, field, value)
        if engine:
            print(f"vLLM rollout engine (sized from the data): {', '.join(f'{k}={v}' for k, v in engine.items())}")

    def build_trainer(self, job) -> None:
        import torch
        from trl import GRPOTrainer

        from klear.callbacks import MetricsJsonlCallback, cpu_share_callbacks
        from klear.eval.backends import ColocatedEval
        from klear.generation.vllm import build_trainer
        from klear.rl.periodic_eval import HeldoutCurveCallback
        from klear.rl.reward_fn import make_klear_reward
        from klear.rl.trainer import GPPOTrainer

        out = job.setup.out
        torch.manual_seed(job.setup.seed)
        trainer_cls: type[GRPOTrainer] = GPPOTrainer
        if job.recipe.trainer_impl == "trl_grpo":
            from klear.rl.trl_peer import TRLPeerTrainer

            trainer_cls = TRLPeerTrainer
        trainer = job.trainer = build_trainer(
            trainer_cls,
            model=job.setup.model_path,
            reward_funcs=make_klear_reward(**job.recipe.reward.scorer_kwargs()),
            args=job.setup.args,
            train_dataset=job.train,
            processing_class=job.tokenizer,
            callbacks=[MetricsJsonlCallback(out / "metrics.jsonl"), *cpu_share_callbacks(), *self.callbacks],
        )
        job.model = trainer.accelerator.unwrap_model(trainer.model)
        # None: model.generate
        job.extra["backend"] = ColocatedEval(trainer, job.tokenizer) if job.extra["on_vllm"] else None
        curve = job.extra["curve"] = HeldoutCurveCallback(
            out, lambda path: self.evaluate(job, path, reuse=False), job.eval_cfg.get("every_steps")
        )
        if job.do_eval:
            trainer.add_callback(curve)

    def evaluate(self, job, path, *, reuse: bool) -> dict[str, Any]:
        from klear.runs import heldout_eval

        return heldout_eval(
            job.model,
            job.tokenizer,
            job.heldout,
            job.eval_cfg,
            path=path,
            reuse=reuse,
            trainer=job.trainer,
            backend=job.extra["backend"],
        )

    def before_training(self, job, before) -> None:
        if before is not None:
            print(f"held-out accuracy before training: {before['accuracy']:.3f} (n={before['n']})", flush=True)
            job.extra["curve"].record(0, before)

    def after_training(self, job) -> None:
        if job.do_eval:
            job.extra["curve"].pause()

    def report(self, job, before, after) -> dict[str, Any]:
        from klear.runs import eval_fields
        from klear.stats import paired_difference

        report: dict[str, Any] = {"model": str(job.config["model"]), "steps": job.trainer.state.global_step}
        if before is not None and after is not None:
            job.extra["curve"].record(job.trainer.state.global_step, after)
            report.update(paired_difference(before["correct"], after["correct"]))
            report.update(
                samples_per_problem=after.get("samples_per_problem", 1), temperature=after.get("temperature", 0.0)
            )
            report.update(eval_fields(before, after))
        return report

    def report_text(self, report: dict[str, Any]) -> str:
        return format_report(report)


def run_rl(
    config: dict[str, Any], *, source: str = "config", resume: bool | str = False, callbacks: list | None = None
) -> dict[str, Any]:
    """Run the RL job described by ``config`` (see the module docstring): :func:`klear.runs.run_job` with
    :class:`RLStage` (``callbacks``: extra ``TrainerCallback`` objects, e.g. a progress bar). Returns the
    ``eval.json`` content.

    Raises:
        ValueError: an invalid recipe (see :func:`build_rl_recipe`) or dataset.
        FileNotFoundError: ``resume`` was asked but there is no checkpoint.
    """
    from klear.runs import run_job

    return run_job(RLStage(callbacks), config, source=source, resume=resume)


def format_report(report: dict[str, Any]) -> str:
    """One human-readable line of the paired held-out comparison (:func:`klear.runs.format_paired`)."""
    from klear.runs import format_paired

    k, temperature = report.get("samples_per_problem", 1), report.get("temperature", 0.0)
    metric = "greedy accuracy" if not temperature else f"avg@{k} accuracy (temperature {temperature:g})"
    return format_paired(metric, report)
