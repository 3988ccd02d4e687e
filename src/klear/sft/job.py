"""The ``klear sft`` job: data -> held-out eval -> long-CoT SFT -> held-out eval -> report.

Run directory layout (``output_dir``)::

    config.yaml            the resolved recipe (after overrides)
    sft_data.jsonl         with data.train=teacher: the generated examples (prompt / completion messages)
    metrics.jsonl          one row per logging step (loss, learning_rate, grad_norm, token accuracy, ...)
    tensorboard/           TensorBoard events of the same metrics
    checkpoints/           TRL/transformers checkpoints (``--resume`` continues from the latest)
    eval_before.json       held-out greedy results of the starting model (per-problem completions)
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

Held-out metrics, each compared before/after with :func:`klear.eval.heldout.paired_difference`:
``accuracy`` (reward 1.0 from the held-out ``data_source``'s scorer) and ``format`` (the response
closes a think block, ``</think>``, and puts a non-empty ``\\boxed{}`` after it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

_TOP_KEYS = {"model", "output_dir", "seed", "data", "eval", "trainer"}
_DATA_KEYS = {"train", "heldout", "tasks", "train_size", "heldout_size", "system_prompt", "instruction",
              "data_source", "filter", "easy_pass_rate"}
_EVAL_KEYS = {"enabled", "max_new_tokens", "batch_size"}

__all__ = ["format_compliant", "format_report", "plot_sft_curves", "run_sft", "validate_sft_config"]


def validate_sft_config(config: dict[str, Any], source: str = "config") -> None:
    """Check the recipe's structure before any heavy work.

    Raises:
        ValueError: an unknown key (named with its section and the file), a missing required key, a
            trainer field that :class:`KlearSFTConfig` does not have (with a "did you mean"), or a
            trainer value of the wrong type.
    """
    from klear.runs import check_int, check_trainer_section
    from klear.runs import check_section_keys as _check_keys
    from klear.sft.trainer import KlearSFTConfig

    _check_keys(config, _TOP_KEYS, "the top level", source)
    for key in ("model", "output_dir", "data", "trainer"):
        if config.get(key) in (None, ""):
            raise ValueError(f"{source}: '{key}' is required")
    _check_keys(config["data"], _DATA_KEYS, "'data'", source)
    _check_keys(config.get("eval") or {}, _EVAL_KEYS, "'eval'", source)
    check_trainer_section(config["trainer"], KlearSFTConfig, source)
    if "seed" in config:
        check_int(source, "seed", config["seed"], 0)
    for key in ("train_size", "heldout_size"):
        if key in config["data"]:
            check_int(source, f"data.{key}", config["data"][key], 1)
    for key in ("max_new_tokens", "batch_size"):
        if key in (config.get("eval") or {}):
            check_int(source, f"eval.{key}", config["eval"][key], 1)
    trainer = config["trainer"]
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if trainer.get(key) is not None:
            check_int(source, f"trainer.{key}", trainer[key], 1)
    if "max_length" in trainer:  # null: no truncation; 0 would truncate every example to nothing
        check_int(source, "trainer.max_length", trainer["max_length"], 1, allow_none=True)
    warmup, steps = trainer.get("warmup_steps"), trainer.get("max_steps")
    if (isinstance(warmup, int) and warmup >= 1 and isinstance(steps, int) and 0 < steps < warmup
            and trainer.get("lr_floor") is not None):  # the warm-up + cosine-to-floor schedule needs W <= T
        raise ValueError(f"{source}: trainer.warmup_steps={warmup} exceeds trainer.max_steps={steps}: lower "
                         "warmup_steps (or give it as a fraction of the steps, e.g. 0.03)")
    data = config["data"]
    train = data.get("train")
    if not isinstance(train, str) or not train:
        raise ValueError(f"{source}: data.train must be 'teacher' or the path of an SFT file, got {train!r}")
    if train == "teacher" or data.get("heldout") == "reasoning_gym":
        for key in ("tasks",) + (("train_size",) if train == "teacher" else ()) + (
                ("heldout_size",) if data.get("heldout") == "reasoning_gym" else ()):
            if data.get(key) in (None, "", []):
                raise ValueError(f"{source}: data.{key} is required with data.train=teacher / "
                                 f"data.heldout=reasoning_gym")
    if data.get("filter", "none") not in ("none", "correct", "by_difficulty"):
        raise ValueError(f"{source}: data.filter={data.get('filter')!r} must be none, correct or by_difficulty")


def _device_defaults(trainer_cfg: dict[str, Any], source: str = "config"):
    """``(trainer section with device/precision resolved, Precision)``: see :mod:`klear.precision`."""
    from klear.precision import resolve_trainer_precision

    try:
        return resolve_trainer_precision(trainer_cfg)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _build_datasets(data: dict[str, Any], seed: int):
    """``(sft_train, heldout_or_None, filter_stats_or_None)`` from the ``data`` section."""
    from klear.data.rl_data import load_rl_dataset, make_reasoning_gym_dataset
    from klear.sft.data import filter_sft_dataset, load_sft_file, make_teacher_sft_dataset

    prompt_kwargs = {k: data[k] for k in ("system_prompt", "instruction") if data.get(k) is not None}
    data_source = data.get("data_source", "math_reasoning_gym")
    heldout_src = data.get("heldout")
    stats = None
    if data["train"] == "teacher":
        train, heldout = make_teacher_sft_dataset(
            data["tasks"], train_size=int(data["train_size"]), heldout_size=int(data.get("heldout_size") or 2),
            seed=seed, data_source=data_source, **prompt_kwargs)
        if heldout_src != "reasoning_gym":
            heldout = None
    else:
        train = load_sft_file(data["train"])
        heldout = None
        if heldout_src == "reasoning_gym":
            heldout = make_reasoning_gym_dataset(data["tasks"], size=int(data["heldout_size"]), seed=seed + 1,
                                                 split="test", few_shot=None, data_source=data_source,
                                                 **prompt_kwargs)
    if data.get("filter", "none") != "none":
        train, stats = filter_sft_dataset(train, data["filter"], easy_pass_rate=float(data.get("easy_pass_rate", 0.5)))
    if heldout_src not in (None, "", "none", "reasoning_gym"):
        heldout = load_rl_dataset(heldout_src)
    return train, heldout, stats


def format_compliant(text: str) -> bool:
    """True when a response closes a think block and then gives a non-empty ``\\boxed{}``.

    Precisely: :func:`klear.rewards.math_reward.answer_region` with ``require_think=True`` finds the
    text after the last ``</think>`` (no unclosed ``<think>`` after it), and that text's last box
    (:func:`klear.rewards.math_reward.extract_last_boxed`) is closed and non-empty. Correctness is
    not considered.
    """
    from klear.rewards.math_reward import answer_region, extract_last_boxed

    region, _ = answer_region(text, require_think=True)
    return region is not None and extract_last_boxed(region).status == "ok"


def _heldout_eval(model, tokenizer, heldout, eval_cfg: dict, path: Path, *, reuse: bool) -> dict[str, Any]:
    """Greedy held-out accuracy and format compliance; saved to ``path`` (reused on resume).

    :func:`klear.runs.heldout_eval` (the evaluator ``klear rl`` uses too) plus ``format_ok``,
    ``format_rate``, ``think_closed_rate`` and ``mean_completion_tokens``.
    """
    from klear.runs import heldout_eval

    def annotate(result: dict[str, Any]) -> None:
        completions, n = result["completions"], max(1, result["n"])
        result["format_ok"] = [format_compliant(c) for c in completions]
        result["format_rate"] = sum(result["format_ok"]) / n
        result["think_closed_rate"] = sum("</think>" in c for c in completions) / n
        result["mean_completion_tokens"] = sum(len(tokenizer(c, add_special_tokens=False)["input_ids"])
                                               for c in completions) / n

    return heldout_eval(model, tokenizer, heldout, max_new_tokens=eval_cfg["max_new_tokens"],
                        batch_size=eval_cfg["batch_size"], path=path, reuse=reuse, annotate=annotate)


def format_report(report: dict[str, Any]) -> str:
    """Two human-readable lines: held-out accuracy and format compliance, before -> after, with 95% CIs."""
    lines = []
    for key, name in (("accuracy", "accuracy"), ("format", "format compliance")):
        r = report[key]
        lines.append(
            f"held-out {name} (n={r['n']}): before {r['before']:.3f} -> after {r['after']:.3f}; paired difference "
            f"{r['mean_diff']:+.3f}, 95% CI [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]; improved {r['n_improved']}, "
            f"worsened {r['n_worsened']}, McNemar p={r['mcnemar_p']:.2g}")
    return "\n".join(lines)


_SFT_PANELS = [("loss (response-token NLL)", ("loss",)), ("learning rate", ("learning_rate",)),
               ("grad norm", ("grad_norm",)), ("token accuracy", ("mean_token_accuracy",))]


def plot_sft_curves(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, title: str | None = None) -> Path:
    """Plot loss, learning rate, grad norm and token accuracy vs step from an SFT ``metrics.jsonl``.

    Args:
        metrics_jsonl: one ``{"step", "loss", "learning_rate", ...}`` object per line (see
            :func:`klear.utils.plotting.read_metrics` for the lines that are skipped).
        out_png: output image (parent folders are created).
        title: figure title (default: the file name).

    Returns:
        The written PNG path.

    Raises:
        FileNotFoundError: no such metrics file.
        ValueError: no row holds any of the plotted keys (the message names the file).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from klear.utils.plotting import read_metrics

    series = read_metrics(metrics_jsonl)
    panels = [(name, [k for k in keys if series.get(k)]) for name, keys in _SFT_PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        raise ValueError(f"{metrics_jsonl}: no plottable rows (need a numeric 'step' and loss / learning_rate)")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.2), squeeze=False)
    try:
        for ax, (name, keys) in zip(axes[0], panels):
            for key in keys:
                pts = sorted(series[key])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None,
                        markersize=3, label=key)
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if name == "learning rate":
                ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        fig.suptitle(title if title is not None else Path(metrics_jsonl).name)
        fig.tight_layout()
        out = Path(out_png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def run_sft(config: dict[str, Any], *, source: str = "config", resume: bool | str = False) -> dict[str, Any]:
    """Run the SFT job described by ``config`` (see the module docstring). Returns the ``eval.json`` content.

    Args:
        config: the recipe (already merged with overrides).
        source: where it came from, for error messages.
        resume: ``False``; ``True`` to continue from the latest checkpoint in ``output_dir/checkpoints``;
            or a checkpoint path.

    Returns:
        ``{"model", "steps", "train_examples", "filter"?, "accuracy"?, "format"?}``; the last two are
        :func:`klear.eval.heldout.paired_difference` results (when a held-out set is evaluated).

    Raises:
        ValueError: an invalid recipe (see :func:`validate_sft_config`) or dataset.
        FileNotFoundError: ``resume`` was asked but there is no checkpoint, or a data file is missing.
    """
    from klear.runs import silence_checkpointing_deprecations

    silence_checkpointing_deprecations()
    validate_sft_config(config, source)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from klear.models.embedded import resolve_model_path
    from klear.rl.callbacks import MetricsJsonlCallback
    from klear.sft.trainer import KlearSFTConfig, KlearSFTTrainer

    from klear.runs import check_checkpoint_model, is_main_process, resolve_resume, start_run

    out = Path(config["output_dir"])
    ckpt_dir = out / "checkpoints"
    flag = "--resume" if resume is True else "--resume-from"
    resume = resolve_resume(out, resume)
    seed = int(config.get("seed", 0))
    trainer_cfg, precision = _device_defaults(config["trainer"], source)
    trainer_cfg.setdefault("seed", seed)
    trainer_cfg.setdefault("logging_steps", 1)
    trainer_cfg.setdefault("report_to", ["tensorboard"])
    trainer_cfg.setdefault("completion_only_loss", True)
    try:  # before any heavy work or file is written
        args = KlearSFTConfig(output_dir=str(ckpt_dir), **trainer_cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: trainer: {e}") from None
    model_path = resolve_model_path(str(config["model"]))
    if resume:
        check_checkpoint_model(resume, AutoConfig.from_pretrained(model_path), str(config["model"]), flag=flag)

    t0 = time.time()
    train, heldout, filter_stats = _build_datasets(config["data"], seed)
    logger.info("data: %d SFT examples, %s held-out (%.1fs)", len(train), len(heldout) if heldout else 0,
                time.time() - t0)
    run_dir = start_run(out, config, trainer_cfg, precision, stage="sft", resumed=bool(resume))
    main = is_main_process()
    with run_dir.removed_on_failure():  # a run that fails before training leaves no directory behind
        if main and config["data"]["train"] == "teacher":  # generated data: keep it (a file is already a file)
            train.to_json(str(out / "sft_data.jsonl"), lines=True, force_ascii=False)
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token

        os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
        trainer = KlearSFTTrainer(
            model=model_path,
            args=args,
            train_dataset=train,
            processing_class=tokenizer,
            callbacks=[MetricsJsonlCallback(out / "metrics.jsonl")],
        )

        eval_cfg = {"enabled": True, "max_new_tokens": 512, "batch_size": 32, **(config.get("eval") or {})}
        do_eval = heldout is not None and eval_cfg["enabled"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        before = None
        if do_eval:
            before = _heldout_eval(model, tokenizer, heldout, eval_cfg, out / "eval_before.json", reuse=bool(resume))
            if main:
                print(f"held-out before SFT: accuracy {before['accuracy']:.3f}, format compliance "
                      f"{before['format_rate']:.3f} (n={before['n']})", flush=True)
            model.train()

    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(str(out / "final"))
    if main:
        tokenizer.save_pretrained(str(out / "final"))

    report: dict[str, Any] = {"model": str(config["model"]), "steps": trainer.state.global_step,
                              "train_examples": len(train)}
    if filter_stats is not None:
        report["filter"] = filter_stats
    if do_eval:
        from klear.eval.heldout import paired_difference

        after = _heldout_eval(model, tokenizer, heldout, eval_cfg, out / "eval_after.json", reuse=False)
        report["accuracy"] = paired_difference(before["correct"], after["correct"])
        report["format"] = paired_difference(before["format_ok"], after["format_ok"])
        report["mean_completion_tokens"] = {"before": before["mean_completion_tokens"],
                                            "after": after["mean_completion_tokens"]}
    if not main:
        return report
    if do_eval:
        print(format_report(report), flush=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    if (out / "metrics.jsonl").is_file():
        try:
            png = plot_sft_curves(out / "metrics.jsonl", out / "training_curves.png", title=str(out))
            print(f"training curves: {png}", flush=True)
        except ValueError as e:  # no logged step (e.g. max_steps=0)
            logger.warning("no plot: %s", e)
    print(f"SFT model: {out / 'final'}  (continue with: klear rl model={out / 'final'} ...)", flush=True)
    return report
