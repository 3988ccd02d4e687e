"""The report of a ``klear experiment``: ``report.md``, ``summary.json`` and PNG plots from the run directories.

Per arm, over its seeds (each number below is first computed per run, then aggregated across seeds):

* held-out accuracy (``heldout_curve.jsonl``, :mod:`klear.rl.periodic_eval`; a run without one, e.g. a ``klear sft``
  run, has the two points of ``eval_before.json`` at step 0 and ``eval_after.json`` at its last step, with
  ``train_summary.json``'s training seconds) at every evaluated step: mean and
  95% interval across seeds, ``mean +/- t_{0.975, n-1} * sd / sqrt(n)`` (Student t, sample sd; no interval for
  one seed). Against wall clock the x value is the seeds' mean training seconds at that step (held-out
  evaluation time excluded);
* final held-out accuracy (``eval_after.json``) and, for every arm but the reference, a paired test on the
  same problems: each problem's correctness averaged over the seeds both arms ran, then
  :func:`klear.stats.paired_difference` (reference as "before", the arm as "after": mean difference,
  normal-approximation 95% CI over problems, sign/McNemar p);
* training metrics from ``metrics.jsonl``, each run's mean over the steps that log it (rollout metrics are
  logged on the first step of a rollout batch), then mean and 95% interval across seeds: :data:`METRICS`.
  klear and TRL name some metrics differently; the first name present is used (TRL logs no ``ppo_kl``); a metric
  no run logs (an RL metric in an SFT experiment) is left out of the tables and plot;
* the same metrics as differences from the reference arm, paired by seed and step (runs of one seed share the
  rollout seed, so their first rollout batch is the same): per seed the mean of ``arm - reference`` over the
  steps both logged, then mean and 95% interval across seeds; and how many (seed, step) pairs are higher or
  lower than the reference (descriptive: steps within a run are not independent).

Files written in the experiment directory: ``report.md``, ``summary.json`` (every number of the report),
``heldout_vs_step.png``, ``heldout_vs_time.png``, ``training_metrics.png``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from klear.stats import mean_ci, paired_difference, seed_paired_comparison

#: (name in the report, metrics.jsonl keys: klear's first, then TRL's)
METRICS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward",)),
    ("clip_frac_high", ("klear/clip_frac_high", "clip_ratio/high_mean")),
    ("clip_frac_low", ("klear/clip_frac_low", "clip_ratio/low_mean")),
    ("ppo_kl", ("klear/ppo_kl",)),
    ("entropy", ("entropy",)),
    ("grad_norm", ("grad_norm",)),
    ("completion_length", ("completions/mean_length",)),
    ("zero_adv_frac", ("klear/zero_adv_group_frac", "frac_reward_zero_std")),
    ("clip_grad_share", ("klear/clip_grad_share",)),
    ("log_ratio_adv_pos", ("klear/log_ratio_adv_pos",)),
    ("log_ratio_adv_neg", ("klear/log_ratio_adv_neg",)),
    ("token_accuracy", ("mean_token_accuracy",)),  # klear sft's
    ("loss", ("loss",)),
]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def metric_series(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[int, float]:
    """``{step: value}`` of the first of ``keys`` that any row has (non-numeric and null values skipped)."""
    for key in keys:
        series = {
            int(r["step"]): float(r[key])
            for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and "step" in r
        }
        if series:
            return series
    return {}


def _read_run(run_dir: Path) -> dict[str, Any]:
    after_path = run_dir / "eval_after.json"
    if not after_path.is_file():
        raise ValueError(f"{run_dir}: no eval_after.json (the run has not finished, or ran without a held-out set)")
    after = json.loads(after_path.read_text())
    curve = sorted(_jsonl(run_dir / "heldout_curve.jsonl"), key=lambda r: r["step"])
    before_path, summary_path = run_dir / "eval_before.json", run_dir / "train_summary.json"
    if not curve and before_path.is_file() and summary_path.is_file():  # e.g. klear sft: before and after only
        trained = json.loads(summary_path.read_text())
        before = json.loads(before_path.read_text())
        curve = [
            {"step": 0, "train_s": 0.0, "accuracy": before["accuracy"]},
            {"step": int(trained["step"]), "train_s": float(trained["train_runtime"]), "accuracy": after["accuracy"]},
        ]
    rows = _jsonl(run_dir / "metrics.jsonl")
    metrics = {name: metric_series(rows, keys) for name, keys in METRICS}
    return {"after": after, "curve": curve, "metrics": metrics, "train_s": curve[-1]["train_s"] if curve else None}


def curve_area(curve: list[dict[str, Any]]) -> float | None:
    """The area under a run's held-out curve (trapezoids over its steps) divided by the steps it spans: the mean
    held-out accuracy over training, the sample-efficiency endpoint. ``None`` without an evaluation between the
    first and the last (fewer than 3 points): the area of two points is their mean, and with the start shared by
    every run it only restates the final accuracy, halved."""
    if len(curve) < 3 or curve[-1]["step"] == curve[0]["step"]:
        return None
    area = sum(
        (b["step"] - a["step"]) * (a["accuracy"] + b["accuracy"]) / 2 for a, b in zip(curve, curve[1:], strict=False)
    )
    return area / (curve[-1]["step"] - curve[0]["step"])


def _curve_stats(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step evaluated in every run: mean accuracy with its interval and the mean training seconds."""
    steps = sorted(set.intersection(*[{r["step"] for r in run["curve"]} for run in runs]))  # one run per seed
    out = []
    for step in steps:
        rows = [next(r for r in run["curve"] if r["step"] == step) for run in runs]
        out.append(
            {
                "step": step,
                "train_s": sum(r["train_s"] for r in rows) / len(rows),
                **{f"accuracy_{k}": v for k, v in mean_ci([r["accuracy"] for r in rows]).items() if k != "n"},
            }
        )
    return out


def summarize(exp, run_dirs: dict[str, Path], seeds: list[int]) -> dict[str, Any]:
    """Every number of the report (see the module docstring) as a JSON-able dict.

    Raises:
        ValueError: a run without ``eval_after.json``, or runs evaluated on different held-out problems.
    """

    data = {arm: {seed: _read_run(run_dirs[f"{arm}/seed{seed}"]) for seed in seeds} for arm in exp.arms}
    ids = {
        run: r["after"]["prompt_ids"]
        for arm, by_seed in data.items()
        for run, r in ((f"{arm}/seed{s}", v) for s, v in by_seed.items())
    }
    first = next(iter(ids))
    for run, pids in ids.items():
        if pids != ids[first]:
            raise ValueError(
                f"{run_dirs[run]}: evaluated on other held-out problems than {run_dirs[first]}; a "
                "paired comparison needs the same problems (same top-level seed and data)"
            )
    arms: dict[str, Any] = {}
    for arm, by_seed in data.items():
        runs = list(by_seed.values())
        per_problem = [statistics.fmean(vals) for vals in zip(*[r["after"]["correct"] for r in runs])]
        arms[arm] = {
            "overrides": exp.arms[arm],
            "final_accuracy": mean_ci([r["after"]["accuracy"] for r in runs]),
            "final_accuracy_per_seed": {str(s): r["after"]["accuracy"] for s, r in by_seed.items()},
            "start_accuracy": mean_ci([r["curve"][0]["accuracy"] for r in runs if r["curve"]]),
            "train_s": mean_ci([r["train_s"] for r in runs if r["train_s"] is not None]),
            "metrics": {
                name: mean_ci([statistics.fmean(r["metrics"][name].values()) for r in runs if r["metrics"][name]])
                for name, _ in METRICS
            },
            "metric_curves": {name: _series_stats([r["metrics"][name] for r in runs]) for name, _ in METRICS},
            "curve": _curve_stats(runs),
            "curve_area_per_seed": {str(s): curve_area(r["curve"]) for s, r in by_seed.items()},
            "per_problem": per_problem,
        }
    ref = arms[exp.reference]["per_problem"]
    for arm, stats in arms.items():
        if arm != exp.reference:
            stats["paired_vs_reference"] = paired_difference(ref, stats["per_problem"])
            stats["seeds_vs_reference"] = seed_paired_comparison(
                {s: data[exp.reference][s]["after"]["accuracy"] for s in seeds},
                {s: data[arm][s]["after"]["accuracy"] for s in seeds},
            )
            ref_area, arm_area = arms[exp.reference]["curve_area_per_seed"], stats["curve_area_per_seed"]
            areas = [s for s in seeds if ref_area[str(s)] is not None and arm_area[str(s)] is not None]
            if areas:
                stats["curve_area_seeds_vs_reference"] = seed_paired_comparison(
                    {s: ref_area[str(s)] for s in areas}, {s: arm_area[str(s)] for s in areas}
                )
            stats["metrics_vs_reference"] = {
                name: paired_metric_difference(
                    [(data[arm][s]["metrics"][name], data[exp.reference][s]["metrics"][name]) for s in seeds]
                )
                for name, _ in METRICS
            }
    return {
        "experiment": exp.name,
        "reference": exp.reference,
        "seeds": seeds,
        "n_problems": len(ids[first]),
        "arms": arms,
    }


def paired_metric_difference(pairs: list[tuple[dict[int, float], dict[int, float]]]) -> dict[str, Any]:
    """An arm's metric minus the reference's, paired by seed and step.

    Args:
        pairs: per seed, ``(arm series, reference series)``, each ``{step: value}`` (:func:`metric_series`).

    Returns:
        :func:`mean_ci` of the per-seed mean differences over the steps both series have (seeds with no
        common step are left out), plus ``n_higher``/``n_lower``: (seed, step) pairs where the arm is
        above/below the reference.
    """
    per_seed, higher, lower = [], 0, 0
    for arm, ref in pairs:
        steps = sorted(set(arm) & set(ref))
        if not steps:
            continue
        diffs = [arm[k] - ref[k] for k in steps]
        per_seed.append(statistics.fmean(diffs))
        higher += sum(d > 0 for d in diffs)
        lower += sum(d < 0 for d in diffs)
    return {**mean_ci(per_seed), "n_higher": higher, "n_lower": lower}


def _series_stats(series: list[dict[int, float]]) -> list[dict[str, Any]]:
    """Per step logged by every run (none if a run lacks the metric): :func:`mean_ci` across the runs."""
    steps = sorted(set.intersection(*[set(s) for s in series]))
    return [{"step": step, **mean_ci([s[step] for s in series])} for step in steps]


def _seed_list(seeds: list[int]) -> str:
    """Seeds for a plot title: ``0-9`` for a run of consecutive seeds, else the list (its first 6 and the last)."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    shown = [str(s) for s in seeds] if len(seeds) <= 7 else [*map(str, seeds[:6]), "...", str(seeds[-1])]
    return ", ".join(shown)


def _plot_curves(summary: dict[str, Any], x_key: str, xlabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, stats in summary["arms"].items():
        curve = stats["curve"]
        x = [p[x_key] / (60.0 if x_key == "train_s" else 1.0) for p in curve]
        ax.plot(x, [p["accuracy_mean"] for p in curve], marker="o", label=arm)
        if all(p["accuracy_low"] is not None for p in curve):
            ax.fill_between(x, [p["accuracy_low"] for p in curve], [p["accuracy_high"] for p in curve], alpha=0.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy")
    seeds = summary["seeds"]
    ax.set_title(
        f"{summary['experiment']}\nmean and 95% interval over {len(seeds)} seeds ({_seed_list(seeds)})", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def logged_metrics(summary: dict[str, Any]) -> list[str]:
    """The :data:`METRICS` some run of the experiment logged (those the tables and the plot show)."""
    return [
        name for name, _ in METRICS if any(a["metrics"][name]["mean"] is not None for a in summary["arms"].values())
    ]


def _plot_metrics(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = logged_metrics(summary)
    if not names:
        return
    cols, rows = 4, math.ceil(len(names) / 4)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for arm, stats in summary["arms"].items():
            points = stats["metric_curves"][name]
            if not points:
                continue
            x = [p["step"] for p in points]
            ax.plot(x, [p["mean"] for p in points], marker="o", markersize=3, label=arm)
            if all(p["low"] is not None for p in points):
                ax.fill_between(x, [p["low"] for p in points], [p["high"] for p in points], alpha=0.2)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(stats: dict[str, Any], digits: int = 3) -> str:
    if stats["mean"] is None:
        return "n/a"
    if stats["low"] is None:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} [{stats['low']:.{digits}f}, {stats['high']:.{digits}f}]"


def _shown_path(path: Path) -> str:
    """A shipped experiment file as ``configs/experiments/<name>.yaml`` (not this machine's install path)."""
    from klear.config import CONFIG_DIR

    try:
        return "configs/" + Path(path).resolve().relative_to(CONFIG_DIR.resolve()).as_posix()
    except ValueError:
        return str(path)


def _side_by_side(jobs: dict[str, int]) -> str:
    """The report's sentence on runs that ran side by side (``klear experiment --jobs``), or ``""`` if none did."""
    shared = {run: n for run, n in jobs.items() if n > 1}
    if not shared:
        return ""
    which = "Runs" if len(shared) == len(jobs) else f"{len(shared)} of the {len(jobs)} runs"
    counts = "/".join(map(str, sorted(set(shared.values()))))
    return (
        f' {which} ran up to {counts} at a time (`jobs`), each with that share of the threads: their "train min" '
        "is a run's time beside the others."
    )


def format_report(exp, summary: dict[str, Any]) -> str:
    """``report.md``'s text for a :func:`summarize` result."""
    arms, ref = summary["arms"], summary["reference"]
    shown = logged_metrics(summary)
    lines = [f"# Experiment `{summary['experiment']}`", ""]
    if exp.description:
        lines += [exp.description, ""]
    lines += [
        f"Experiment file `{_shown_path(exp.source)}`; seeds {summary['seeds']} (`trainer.seed`); "
        f"{summary['n_problems']} held-out problems, the same for every run; reference arm `{ref}`."
        + _side_by_side(summary.get("jobs", {})),
        "",
        "Intervals: 95% Student-t across seeds. The comparison that decides is the one with the seed as the unit "
        "(next table). The per-problem columns below are a within-run check: per-problem correctness averaged over "
        "seeds, arm minus reference (normal-approximation 95% CI over problems, exact sign/McNemar p).",
        "",
        "## Held-out accuracy",
        "",
        "| arm | overrides | start | final (mean [95% CI]) | per seed | within-run check vs reference: diff "
        "[95% CI] | better / worse | p | train min |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in arms.items():
        overrides = ", ".join(f"{k}={v}" for k, v in s["overrides"].items()) or "(base)"
        per_seed = ", ".join(f"{v:.3f}" for v in s["final_accuracy_per_seed"].values())
        if "paired_vs_reference" in s:
            p = s["paired_vs_reference"]
            paired = [
                f"{p['mean_diff']:+.3f} [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}]",
                f"{p['n_improved']} / {p['n_worsened']}",
                f"{p['mcnemar_p']:.2g}",
            ]
        else:
            paired = ["(reference)", "", ""]
        train_min = "n/a" if s["train_s"]["mean"] is None else f"{s['train_s']['mean'] / 60:.1f}"
        lines.append(
            f"| {arm} | {overrides} | {_fmt(s['start_accuracy'])} | {_fmt(s['final_accuracy'])} | "
            f"{per_seed} | {' | '.join(paired)} | {train_min} |"
        )
    lines += [
        "",
        "## The seed as the unit (arm minus reference, paired by seed)",
        "",
        (
            "Endpoints: final held-out accuracy; curve area, the area under the held-out curve over the steps it spans "
            "(the mean accuracy over training: sample efficiency). "
            if any(area is not None for s in arms.values() for area in s["curve_area_per_seed"].values())
            else "Endpoint: final held-out accuracy (no curve area: no run was evaluated between its start and its "
            "end, and the area of those two points only restates the final accuracy). "
        )
        + "MDE: the smallest difference these seeds detect at 95% confidence and 80% power, from the observed SD of "
        "the paired differences; seeds needed: for a difference of 0.02 / 0.05. P(improve): the probability that "
        "a run of the arm beats a run of the reference (Agarwal et al., 2021), with a 95% bootstrap interval.",
        "",
        "| arm | endpoint | seeds | diff [95% CI] | p (paired t) | SD of diffs | MDE | seeds needed (0.02 / 0.05) | "
        "P(improve) [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(arm, "final", s["seeds_vs_reference"]) for arm, s in arms.items() if "seeds_vs_reference" in s]
    rows += [
        (arm, "curve area", s["curve_area_seeds_vs_reference"])
        for arm, s in arms.items()
        if "curve_area_seeds_vs_reference" in s
    ]
    for arm, endpoint, c in rows:
        if c["ci_low"] is None:
            why = (
                "one seed: no interval" if c["n"] < 2 else "every seed's difference the same: spread unknown, undecided"
            )
            lines.append(f"| {arm} | {endpoint} | {c['n']} | {c['mean_diff']:+.3f} ({why}) | | | | | |")
            continue
        needed = " / ".join(str(v) for v in c["seeds_needed"].values())
        lines.append(
            f"| {arm} | {endpoint} | {c['n']} | {c['mean_diff']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] | "
            f"{c['p']:.2g} | "
            f"{c['sd_diff']:.3f} | {c['mde']:.3f} | {needed} | {c['p_improvement']:.2f} "
            f"[{c['p_improvement_low']:.2f}, {c['p_improvement_high']:.2f}] |"
        )
    lines += [
        "",
        "![held-out accuracy vs step](heldout_vs_step.png)",
        "![held-out accuracy vs wall clock](heldout_vs_time.png)",
        "",
        "## Training metrics (mean over steps, then mean [95% CI] over seeds)",
        "",
        "| arm | " + " | ".join(shown) + " |",
        "|---" * (len(shown) + 1) + "|",
    ]
    for arm, s in arms.items():
        lines.append(f"| {arm} | " + " | ".join(_fmt(s["metrics"][name], 4) for name in shown) + " |")
    lines += ["", "![training metrics](training_metrics.png)" if shown else "(no training metrics logged)", ""]
    others = [arm for arm in arms if arm != ref]
    if others:
        lines += [
            f"## Training metrics minus `{ref}`, paired by seed and step",
            "",
            "Per seed the mean over steps of arm minus reference, then mean [95% CI] over seeds; in brackets the "
            "(seed, step) pairs above / below the reference.",
            "",
            "| arm | " + " | ".join(shown) + " |",
            "|---" * (len(shown) + 1) + "|",
        ]
        for arm in others:
            cells = []
            for name in shown:
                d = arms[arm]["metrics_vs_reference"][name]
                cells.append("n/a" if d["mean"] is None else f"{_fmt(d, 4)} ({d['n_higher']}/{d['n_lower']})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(
    out: Path, exp, run_dirs: dict[str, Path], seeds: list[int], jobs: dict[str, int] | None = None
) -> Path:
    """Write ``report.md``, ``summary.json`` and the plots into ``out``; print where. Returns ``report.md``'s path.
    ``jobs``: per run, how many runs ran side by side when it ran (default 1; said in the report: it sets what
    "train min" means).

    Raises:
        ValueError: as :func:`summarize`.
    """
    out = Path(out)
    summary = summarize(exp, run_dirs, seeds)
    summary["jobs"] = {run: (jobs or {}).get(run, 1) for run in run_dirs}
    for stats in summary["arms"].values():
        stats.pop("per_problem")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _plot_curves(summary, "step", "optimizer step", out / "heldout_vs_step.png")
    _plot_curves(
        summary, "train_s", "training wall clock (min, held-out evaluation excluded)", out / "heldout_vs_time.png"
    )
    _plot_metrics(summary, out / "training_metrics.png")
    path = out / "report.md"
    path.write_text(format_report(exp, summary))
    print(f"experiment report: {path}", flush=True)
    return path
