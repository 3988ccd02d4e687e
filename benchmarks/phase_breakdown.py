"""Where a ``klear rl`` run's training time went, from the ``timing/<phase>_s`` columns of its ``metrics.jsonl``.

Usage: ``python benchmarks/phase_breakdown.py RUN_DIR [RUN_DIR ...]``. For each run: seconds per phase
summed over all optimizer steps, their share, and the held-out result from ``eval.json`` when present.
With several runs (e.g. seeds) the last table is the mean over runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PHASES = ("generate", "reward", "rollout_other", "old_log_prob", "forward_backward", "optimizer")


def breakdown(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/forward_backward_s" in r]
    if not rows:
        raise SystemExit(f"{run}/metrics.jsonl: no timing/*_s columns (a run from before klear logged them?)")
    total = {p: 0.0 for p in PHASES}
    for r in rows:
        total["generate"] += r["timing/generate_s"]
        total["reward"] += r["timing/reward_s"]
        total["rollout_other"] += r["timing/rollout_s"] - r["timing/generate_s"] - r["timing/reward_s"]
        for p in ("old_log_prob", "forward_backward", "optimizer"):
            total[p] += r[f"timing/{p}_s"]
    total["steps"] = len(rows)
    total["step_time"] = sum(r.get("step_time", 0.0) for r in rows)
    return total


def show(name: str, total: dict[str, float]) -> None:
    train = sum(total[p] for p in PHASES)
    print(
        f"\n{name}: {int(total['steps'])} optimizer steps, {train:.0f} s in the phases "
        f"(TRL step_time sum {total['step_time']:.0f} s)"
    )
    for p in PHASES:
        print(f"  {p:<17}{total[p]:>8.1f} s {100 * total[p] / train:>6.1f}%")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    totals = []
    for arg in argv:
        run = Path(arg)
        total = breakdown(run)
        totals.append(total)
        show(str(run), total)
        e = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
        if "before" in e:  # a run with its held-out evaluation (eval.enabled)
            print(
                f"  held-out {e['before']:.3f} -> {e['after']:.3f}, diff {e['mean_diff']:+.3f} "
                f"[{e['ci_low']:+.3f}, {e['ci_high']:+.3f}], improved {e['n_improved']} / worsened "
                f"{e['n_worsened']}, McNemar p = {e['mcnemar_p']:.3g}"
            )
    if len(totals) > 1:
        show(f"mean of {len(totals)} runs", {k: sum(t[k] for t in totals) / len(totals) for k in totals[0]})


if __name__ == "__main__":
    main(sys.argv[1:])
