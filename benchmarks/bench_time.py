"""Where the time of bench RL runs goes, from their run directories (no re-run).

    python benchmarks/bench_time.py runs/experiments/bench_gppo_vs_baselines

For every run directory below the given folders (one with ``metrics.jsonl``, ``heldout_curve.jsonl`` and
``eval.json``): the run's wall clock from ``run.json``'s start to ``eval.json`` (process start-up and imports
before the run directory exists are not in it), the training loop's seconds without held-out evaluation
(``train_s`` of the last curve row), the held-out evaluations, and the loop split by phase from the per-step
``timing/*`` metrics of klear's trainer (the TRL peer logs none: its loop is one "other" figure). Printed per arm
(the folder above ``seed<k>``): the mean over its runs, seconds and shares of the wall clock. Also prints the load
average and CPU flags of this machine now (the runs' own load is not recorded: note it when they run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from _machine import cpu_flags, cpu_model

PHASES = ("generate_s", "reward_s", "old_log_prob_s", "forward_backward_s", "optimizer_s")


def run_times(run: Path) -> dict[str, float]:
    """Seconds of one finished run: ``wall``, ``train`` (the loop without evaluation), ``eval``, ``setup`` and the
    loop's phases (``timing/*`` sums; ``loop_other`` the rest of the loop)."""
    started = json.loads((run / "run.json").read_text())["started"]
    wall = (run / "eval.json").stat().st_mtime - started
    curve = [json.loads(line) for line in (run / "heldout_curve.jsonl").read_text().splitlines()]
    train = float(curve[-1]["train_s"])
    runtime = float(json.loads((run / "train_summary.json").read_text())["train_runtime"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {"wall": wall, "train": train, "eval": runtime - train, "setup_and_final": wall - runtime}
    for phase in PHASES:
        out[phase] = sum(float(r.get(f"timing/{phase}", 0.0)) for r in rows)
    out["loop_other"] = train - sum(out[p] for p in PHASES)
    return out


def main(folders: list[str]) -> int:
    by_arm: dict[str, list[dict[str, float]]] = defaultdict(list)
    for folder in folders:
        for eval_file in sorted(Path(folder).rglob("eval.json")):
            run = eval_file.parent
            if (run / "metrics.jsonl").is_file() and (run / "run.json").is_file():
                by_arm[run.parent.name if run.name.startswith("seed") else run.name].append(run_times(run))
    if not by_arm:
        print(f"no finished run directories under {folders}", file=sys.stderr)
        return 2
    print(f"{cpu_model()}, cores {os.cpu_count()}, load average now {os.getloadavg()}, CPU flags {cpu_flags()}")
    keys = ["wall", "setup_and_final", "eval", "train", *PHASES, "loop_other"]
    print("| arm | runs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for arm, runs in by_arm.items():
        means = {k: statistics.fmean(r[k] for r in runs) for k in keys}
        cells = [f"{means[k]:.1f} ({100 * means[k] / means['wall']:.0f}%)" for k in keys]
        print(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["runs/experiments/bench_gppo_vs_baselines"]))
