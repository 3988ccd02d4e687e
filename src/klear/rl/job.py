"""The ``klear rl`` job: data -> held-out eval -> GPPO training -> held-out eval -> report.

Run directory layout (``output_dir``)::

    config.yaml            the resolved recipe (after overrides)
    metrics.jsonl          one row per optimizer step (reward, accuracy, losses, clip fractions, ...)
    tensorboard/           TensorBoard events of the same metrics
    checkpoints/           TRL/transformers checkpoints (``--resume`` continues from the latest)
    eval_before.json       held-out greedy accuracy of the starting model (per-problem results)
    eval_after.json        the same for the trained model
    eval.json              the paired comparison: accuracies, mean difference, 95% interval, McNemar p
    training_curves.png    reward, accuracy, clip fractions, entropy, grad norm vs step
    final/                 the trained model and tokenizer

Recipe sections: ``model`` (a path, a hub id, or ``embedded``), ``output_dir``, ``seed``, ``data``
(``train``/``heldout`` sources, reasoning-gym ``tasks``, sizes), ``eval`` (held-out decoding) and
``trainer`` (every field of :class:`klear.rl.trainer.GPPOConfig`, i.e. TRL's ``GRPOConfig`` plus the
Klear settings). See ``configs/rl_demo.yaml`` and ``configs/rl_math_klear.yaml``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

_TOP_KEYS = {"model", "output_dir", "seed", "data", "eval", "trainer", "reward"}
_DATA_KEYS = {"train", "heldout", "tasks", "train_size", "heldout_size", "data_source", "instruction", "system_prompt",
              "few_shot"}
# scorer options passed to klear.rewards.compute_scores (math reads require_think and timeout_s;
# code reads all of them)
_REWARD_KEYS = {"reward_mode", "require_think", "time_limit_s", "timeout_s", "stop_on_first_failure"}
_EVAL_KEYS = {"enabled", "max_new_tokens", "batch_size", "n_samples", "temperature"}


def validate_job_config(config: dict[str, Any], source: str = "config") -> None:
    """Check the recipe's structure before any heavy work.

    Raises:
        ValueError: an unknown key (named with its section and the file), a missing required key,
            or a trainer field that :class:`GPPOConfig` rejects.
    """
    from klear.runs import check_section_keys as _check_keys

    _check_keys(config, _TOP_KEYS, "the top level", source)
    for key in ("model", "output_dir", "data", "trainer"):
        if config.get(key) in (None, ""):
            raise ValueError(f"{source}: '{key}' is required")
    _check_keys(config["data"], _DATA_KEYS, "'data'", source)
    if not isinstance(config.get("reward") or {}, dict):
        raise ValueError(f"{source}: 'reward' must be a mapping of scorer options (e.g. reward_mode: soft)")
    _check_keys(config.get("reward") or {}, _REWARD_KEYS, "'reward'", source)
    mode = (config.get("reward") or {}).get("reward_mode", "soft")
    if mode not in ("soft", "hard"):
        raise ValueError(f"{source}: reward.reward_mode={mode!r} must be 'soft' or 'hard'")
    _check_keys(config.get("eval") or {}, _EVAL_KEYS, "'eval'", source)

    from klear.runs import check_int

    def _int(where: str, value: Any, minimum: int) -> None:
        check_int(source, where, value, minimum)

    if "seed" in config:
        _int("seed", config["seed"], 0)
    for key in ("train_size", "heldout_size"):
        if key in config["data"]:
            _int(f"data.{key}", config["data"][key], 0 if key == "heldout_size" else 1)
    for key in ("max_new_tokens", "batch_size", "n_samples"):
        if key in (config.get("eval") or {}):
            _int(f"eval.{key}", config["eval"][key], 1)
    temperature = (config.get("eval") or {}).get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"{source}: eval.temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if (config.get("eval") or {}).get("n_samples", 1) > 1 and temperature == 0:
        raise ValueError(f"{source}: eval.n_samples > 1 needs eval.temperature > 0 (0 means greedy decoding)")
    if config.get("eval") and "enabled" in config["eval"] and not isinstance(config["eval"]["enabled"], bool):
        raise ValueError(f"{source}: eval.enabled={config['eval']['enabled']!r} must be true or false")
    for key, minimum in (("num_generations", 2), ("per_device_train_batch_size", 1),
                         ("gradient_accumulation_steps", 1), ("steps_per_generation", 1),
                         ("max_completion_length", 1)):
        if config["trainer"].get(key) is not None:
            _int(f"trainer.{key}", config["trainer"][key], minimum)
    from klear.rl.trainer import GPPOConfig
    from klear.runs import check_trainer_section

    check_trainer_section(config["trainer"], GPPOConfig, source)


def _build_datasets(data: dict[str, Any], seed: int):
    from klear.data.rl_data import load_rl_dataset, make_reasoning_gym_dataset, make_train_and_heldout

    train_src, heldout_src = data.get("train", "reasoning_gym"), data.get("heldout")
    if heldout_src == "humaneval" and train_src != "humaneval":
        raise ValueError("data.heldout=humaneval is a split of data.train=humaneval; with your own training file "
                         "set data.heldout to a file of held-out problems or to none")
    if train_src == "humaneval":
        from klear.data.code_data import make_humaneval_datasets

        he_kwargs = {k: data[k] for k in ("instruction", "data_source", "system_prompt") if k in data}
        if heldout_src not in (None, "", "none", "humaneval"):
            raise ValueError("data.train=humaneval takes data.heldout=humaneval (a disjoint split) or none")
        train, heldout = make_humaneval_datasets(
            int(data.get("train_size", 32)), int(data.get("heldout_size", 0)) if heldout_src else 0,
            seed=seed, **he_kwargs)
        return train, heldout
    rg_kwargs = {k: data[k] for k in ("instruction", "data_source", "system_prompt", "few_shot") if k in data}
    if train_src == "reasoning_gym":
        if not data.get("tasks"):
            raise ValueError("data.train=reasoning_gym needs data.tasks (a list of {name, config, weight})")
        if heldout_src == "reasoning_gym":
            return make_train_and_heldout(
                data["tasks"], train_size=int(data["train_size"]), heldout_size=int(data["heldout_size"]),
                seed=seed, **rg_kwargs,
            )
        train = make_reasoning_gym_dataset(data["tasks"], size=int(data["train_size"]), seed=seed, **rg_kwargs)
    else:
        train = load_rl_dataset(train_src)
    if heldout_src in (None, "", "none"):
        heldout = None
    elif heldout_src == "reasoning_gym":
        exclude = set(_question_texts(train))
        heldout = make_reasoning_gym_dataset(
            data["tasks"], size=int(data["heldout_size"]), seed=seed + 1, split="test",
            exclude_questions=exclude, **rg_kwargs,
        )
    else:
        heldout = load_rl_dataset(heldout_src)
    return train, heldout


def _question_texts(dataset) -> list[str]:
    return [p[-1]["content"] for p in dataset["prompt"]]


def _device_defaults(trainer_cfg: dict[str, Any], source: str = "config"):
    """``(trainer section with device/precision resolved, Precision)``: see :mod:`klear.precision`.

    Raises:
        ValueError: ``bf16``/``fp16`` without a CUDA GPU, or ``use_vllm`` without one.
    """
    from klear.precision import resolve_trainer_precision

    try:
        out, precision = resolve_trainer_precision(trainer_cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if precision.device == "cpu" and out.get("use_vllm"):
        raise ValueError(f"{source}: trainer.use_vllm=true needs a CUDA GPU; none is visible")
    return out, precision


def run_rl(config: dict[str, Any], *, source: str = "config", resume: bool | str = False) -> dict[str, Any]:
    """Run the RL job described by ``config`` (see the module docstring). Returns the ``eval.json`` content.

    Args:
        config: the recipe (already merged with overrides).
        source: where it came from, for error messages.
        resume: ``False``; ``True`` to continue from the latest checkpoint in ``output_dir/checkpoints``;
            or a checkpoint path.

    Raises:
        ValueError: an invalid recipe (see :func:`validate_job_config`) or dataset.
        FileNotFoundError: ``resume`` was asked but there is no checkpoint.
    """
    from klear.runs import silence_checkpointing_deprecations

    silence_checkpointing_deprecations()
    validate_job_config(config, source)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from klear.models.embedded import resolve_model_path
    from klear.rl.callbacks import MetricsJsonlCallback
    from klear.rl.trainer import GPPOConfig, GPPOTrainer

    from klear.runs import check_checkpoint_model, check_prompt_context, is_main_process, resolve_resume, start_run

    out = Path(config["output_dir"])
    ckpt_dir = out / "checkpoints"
    flag = "--resume" if resume is True else "--resume-from"
    resume = resolve_resume(out, resume)
    seed = int(config.get("seed", 0))
    trainer_cfg, precision = _device_defaults(config["trainer"], source)
    trainer_cfg.setdefault("seed", seed)
    trainer_cfg.setdefault("logging_steps", 1)
    trainer_cfg.setdefault("report_to", ["tensorboard"])
    try:  # before any heavy work or file is written
        args = GPPOConfig(output_dir=str(ckpt_dir), **trainer_cfg)
    except ValueError as e:
        raise ValueError(f"{source}: trainer: {e}") from None
    model_path = resolve_model_path(str(config["model"]))
    model_config = AutoConfig.from_pretrained(model_path)
    if resume:
        check_checkpoint_model(resume, model_config, str(config["model"]), flag=flag)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    t0 = time.time()  # datasets and prompt lengths are checked before the run directory exists
    train, heldout = _build_datasets(config["data"], seed)
    context = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    eval_cfg = {"enabled": True, "max_new_tokens": args.max_completion_length, "batch_size": 64, "n_samples": 1,
                "temperature": 0.0, "seed": seed, **(config.get("eval") or {})}
    do_eval = heldout is not None and eval_cfg["enabled"]
    if context:
        check_prompt_context(tokenizer, train, budget=args.max_completion_length,
                             budget_name="trainer.max_completion_length", context=context,
                             where=f"data.train={config['data'].get('train', 'reasoning_gym')}",
                             chat_template_kwargs=args.chat_template_kwargs)
        if do_eval:
            check_prompt_context(tokenizer, heldout, budget=eval_cfg["max_new_tokens"],
                                 budget_name="eval.max_new_tokens", context=context,
                                 where=f"data.heldout={config['data'].get('heldout')}")
    logger.info("data: %d train prompts, %s held-out (%.1fs)", len(train), len(heldout) if heldout else 0,
                time.time() - t0)
    run_dir = start_run(out, config, trainer_cfg, precision, stage="rl", resumed=bool(resume))
    torch.manual_seed(seed)

    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
    from klear.rl.reward_fn import make_klear_reward

    with run_dir.removed_on_failure():  # a run that fails before training leaves no directory behind
        trainer = GPPOTrainer(
            model=model_path,
            reward_funcs=make_klear_reward(**(config.get("reward") or {})),
            args=args,
            train_dataset=train,
            processing_class=tokenizer,
            callbacks=[MetricsJsonlCallback(out / "metrics.jsonl")],
        )
        before = None
        if do_eval:
            before = _heldout_eval(trainer, heldout, eval_cfg, out / "eval_before.json", reuse=bool(resume))
            print(f"held-out accuracy before training: {before['accuracy']:.3f} (n={before['n']})", flush=True)

    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(str(out / "final"))
    main = is_main_process()
    if main:
        tokenizer.save_pretrained(str(out / "final"))

    report: dict[str, Any] = {"model": str(config["model"]), "steps": trainer.state.global_step}
    if do_eval:
        after = _heldout_eval(trainer, heldout, eval_cfg, out / "eval_after.json", reuse=False)
        from klear.eval.heldout import paired_difference

        report.update(paired_difference(before["correct"], after["correct"]))
        report.update(samples_per_problem=after.get("samples_per_problem", 1), temperature=after.get("temperature", 0.0))
        if main:
            (out / "eval.json").write_text(json.dumps(report, indent=2))
            print(format_report(report), flush=True)
    if main and (out / "metrics.jsonl").is_file():
        from klear.utils.plotting import plot_training_curves

        try:
            png = plot_training_curves(out / "metrics.jsonl", out / "training_curves.png", title=str(out))
            print(f"training curves: {png}", flush=True)
        except ValueError as e:  # no logged step (e.g. max_steps=0)
            logger.warning("no plot: %s", e)
    return report


def _heldout_eval(trainer, heldout, eval_cfg: dict, path: Path, *, reuse: bool) -> dict[str, Any]:
    """Held-out accuracy of the trainer's current model (:func:`klear.runs.heldout_eval`; greedy, or avg@n
    with ``eval.n_samples`` samples at ``eval.temperature``, sampling seed = the run's seed)."""
    from klear.runs import heldout_eval

    return heldout_eval(trainer.accelerator.unwrap_model(trainer.model), trainer.processing_class, heldout,
                        max_new_tokens=eval_cfg["max_new_tokens"], batch_size=eval_cfg["batch_size"], path=path,
                        reuse=reuse, n_samples=int(eval_cfg.get("n_samples", 1)),
                        temperature=float(eval_cfg.get("temperature", 0.0)), seed=int(eval_cfg.get("seed", 0)))


def format_report(report: dict[str, Any]) -> str:
    """One human-readable paragraph of the paired held-out comparison."""
    k, temperature = report.get("samples_per_problem", 1), report.get("temperature", 0.0)
    metric = "greedy accuracy" if not temperature else f"avg@{k} accuracy (temperature {temperature:g})"
    return (
        f"held-out {metric} (n={report['n']}): before {report['before']:.3f} -> after {report['after']:.3f}; "
        f"paired difference {report['mean_diff']:+.3f}, 95% CI [{report['ci_low']:+.3f}, {report['ci_high']:+.3f}]; "
        f"improved {report['n_improved']}, worsened {report['n_worsened']}, McNemar p={report['mcnemar_p']:.2g}"
    )
