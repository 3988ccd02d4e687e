"""Training-curve plots from a per-step metrics JSONL (headless, matplotlib Agg backend)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

# (subplot title, metric keys drawn on it). A panel is drawn when at least one key has data.
# RL_PANELS: ``klear rl`` (GPPOTrainer's and TRL's metrics); SFT_PANELS: ``klear sft``.
RL_PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward",)),
    ("accuracy", ("klear/accuracy",)),
    ("clip fraction", ("klear/clip_frac_high", "klear/clip_frac_low")),
    ("entropy", ("entropy",)),
    ("entropy ratio clipping (ERC)", ("klear/erc_frac_high", "klear/erc_frac_low")),
    ("grad norm", ("grad_norm",)),
    ("SFT loss", ("klear/sft_loss",)),
    ("policy loss", ("klear/policy_loss",)),
    ("mean completion length", ("completions/mean_length",)),
]
SFT_PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("loss (response-token NLL)", ("loss",)),
    ("learning rate", ("learning_rate",)),
    ("grad norm", ("grad_norm",)),
    ("token accuracy", ("mean_token_accuracy",)),
]


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(metrics_jsonl: str | os.PathLike) -> dict[str, list[tuple[float, float]]]:
    """Read per-step metrics: ``{key: [(step, value), ...]}`` for every numeric key.

    Lines that are blank, not valid JSON, not an object or without a numeric ``"step"`` are
    skipped, and so are non-numeric (or non-finite) values.

    Args:
        metrics_jsonl: JSONL file, one ``{"step": int, <metric>: number, ...}`` per line.

    Returns:
        Series per metric key, in file order.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    series: dict[str, list[tuple[float, float]]] = {}
    with open(metrics_jsonl, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            step = _number(rec.get("step"))
            if step is None:
                continue
            for key, value in rec.items():
                v = _number(value)
                if key != "step" and v is not None:
                    series.setdefault(key, []).append((step, v))
    return series


def plot_training_curves(
    metrics_jsonl: str | os.PathLike,
    out_png: str | os.PathLike,
    title: str | None = None,
    panels: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> Path:
    """Plot the training curves found in a metrics JSONL into one PNG.

    One subplot per metric group (``panels``, default :data:`RL_PANELS`) present in the file. The RL
    groups, in order: reward (``reward``),
    accuracy (``klear/accuracy``), clip fractions (``klear/clip_frac_high`` and
    ``klear/clip_frac_low`` together), entropy (``entropy``), the ERC masked fractions
    (``klear/erc_frac_high`` and ``klear/erc_frac_low``), grad norm (``grad_norm``), SFT
    loss (``klear/sft_loss``), policy loss (``klear/policy_loss``) and mean completion length
    (``completions/mean_length``). Absent groups are skipped. x axis = ``step``.

    Args:
        metrics_jsonl: per-step metrics file (see :func:`read_metrics` for what is skipped).
        out_png: output image path (parent folders are created).
        title: figure title; default the file name.
        panels: ``[(subplot title, metric keys)]``, e.g. :data:`SFT_PANELS`; default :data:`RL_PANELS`.

    Returns:
        The path of the written PNG.

    Raises:
        FileNotFoundError: ``metrics_jsonl`` does not exist.
        ValueError: the file holds no plottable rows (no row with a step and one of the keys
            above); the message names the file.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    groups = RL_PANELS if panels is None else panels
    series = read_metrics(metrics_jsonl)
    found = [(name, [k for k in keys if series.get(k)]) for name, keys in groups]
    panels = [(name, keys) for name, keys in found if keys]
    if not panels:
        known = sorted(k for _, keys in groups for k in keys)
        raise ValueError(f"{metrics_jsonl}: no plottable rows (need lines with a numeric 'step' and any of {known})")

    n = len(panels)
    ncols = 1 if n == 1 else 2
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3 * nrows), squeeze=False)
    try:
        flat = axes.ravel()
        for ax, (name, keys) in zip(flat, panels):
            for key in keys:
                pts = sorted(series[key])
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=key)
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, alpha=0.3)
            if len(keys) > 1:
                ax.legend(fontsize=8)
            if name == "learning rate":
                ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        for ax in flat[n:]:
            ax.set_visible(False)
        fig.suptitle(title if title is not None else Path(metrics_jsonl).name)
        fig.tight_layout()
        out = Path(out_png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
