"""Mutation score per module of klear's exactness claims (`make mutation`, issue 21).

Runs mutmut (configured in pyproject.toml, ``[tool.mutmut]``) on the functions of each unit below, reads each
mutant's status from ``mutmut results --all true`` and prints a table:

    unit | mutants | killed | survived | equivalent | score

score = detected / (mutants - equivalent), where detected counts killed, timed-out and segfaulting mutants
(a test noticed the change) and "no tests" counts as survived. Equivalent mutants (no test can tell them
apart: the program's behaviour is unchanged) are listed with the reason in tools/mutation_equivalent.toml;
a listed mutant that is killed or no longer exists is reported, so the list cannot go stale silently.

    python tools/mutation.py                   # every unit; exit 1 if a unit scores below --min-score
    python tools/mutation.py --unit rl/losses.py --unit rl/advantages.py
    python tools/mutation.py --report-only     # reprint the table from the last run (no mutmut run)
    python tools/mutation.py --survivors       # also list each unit's surviving mutant names

Show one mutant's diff with ``mutmut show NAME``; the tests that cover it: ``mutmut tests-for-mutant NAME``.
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.toml"

# unit -> mutmut mutant-name globs (module path, then x_<function> or xǁ<Class>ǁ<method>).
UNITS: dict[str, list[str]] = {
    "rl/losses.py": ["klear.rl.losses.*"],
    "rl/advantages.py": ["klear.rl.advantages.*"],
    "rl/trainer.py (normalisation, filtering)": [
        "klear.rl.trainer.x_rollout_rewards__mutmut_*",
        "klear.rl.trainer.x__prompt_key__mutmut_*",
        "klear.rl.trainer.x_truncated_mask__mutmut_*",
        "klear.rl.trainer.x_drop_filtered_samples__mutmut_*",
        "klear.rl.trainer.x_rollout_keep_mask__mutmut_*",
        "klear.rl.trainer.x_optimizer_window_counts__mutmut_*",
        "klear.rl.trainer.xǁGPPOTrainerǁ_annotate_optimizer_windows__mutmut_*",
        "klear.rl.trainer.xǁGPPOTrainerǁ_loss_mask__mutmut_*",
    ],
    "eval/metrics.py": ["klear.eval.metrics.*"],
    "stats.py": ["klear.stats.*"],
    # the statistics only: left out are the PNG plots (_plot_curves, _plot_metrics), the text of report.md
    # (format_report, _fmt, _shown_path) and the file writing (write_report)
    "experiment/report.py (statistics)": [
        f"klear.experiment.report.x_{name}__mutmut_*"
        for name in (
            "_jsonl",
            "metric_series",
            "_read_run",
            "_curve_stats",
            "summarize",
            "paired_metric_difference",
            "_series_stats",
        )
    ],
    "resume (lifecycle.py, runs.resolve_resume)": [
        "klear.lifecycle.*",
        "klear.runs.x_resolve_resume__mutmut_*",
    ],
    "data/decontam.py": ["klear.data.decontam.*"],
}

DETECTED = {"killed", "timeout", "segfault", "caught by type check"}
UNDETECTED = {"survived", "no tests", "suspicious"}


def _mutmut(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(exe), *args], cwd=ROOT, text=True, capture_output=True, check=False)


def statuses() -> dict[str, str]:
    """Every generated mutant's status from the last run, by mutant name."""
    out = _mutmut("results", "--all", "true")
    if out.returncode != 0:
        raise SystemExit(f"mutation: `mutmut results` failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    result = {}
    for line in out.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name.startswith("klear."):
            result[name] = status
    return result


def equivalents() -> dict[str, str]:
    """Mutant name -> why it is equivalent, from tools/mutation_equivalent.toml (``[equivalent]`` table)."""
    if not EQUIVALENT_FILE.exists():
        return {}
    table = tomllib.loads(EQUIVALENT_FILE.read_text()).get("equivalent", {})
    for name, why in table.items():
        if not isinstance(why, str) or not why.strip():
            raise SystemExit(f"mutation: {EQUIVALENT_FILE}: equivalent mutant {name!r} needs a reason (a string)")
    return table


def in_unit(name: str, unit: str) -> bool:
    return any(fnmatch.fnmatchcase(name, glob) for glob in UNITS[unit])


def report(units: list[str], min_score: float, show_survivors: bool) -> int:
    status = statuses()
    equivalent = equivalents()
    failed = False
    rows = []
    for unit in units:
        names = sorted(n for n in status if in_unit(n, unit))
        pending = [n for n in names if status[n] not in DETECTED | UNDETECTED and status[n] != "skipped"]
        eq = [n for n in names if n in equivalent]
        killed_eq = [n for n in eq if status[n] in DETECTED]
        counted = [n for n in names if n not in equivalent and status[n] != "skipped"]
        detected = sum(status[n] in DETECTED for n in counted)
        survivors = [n for n in counted if status[n] in UNDETECTED]
        score = detected / len(counted) if counted else float("nan")
        rows.append((unit, len(names), detected, len(survivors), len(eq), score))
        if not names:
            print(f"mutation: unit {unit!r}: no mutants (run it first, or its globs match nothing)", file=sys.stderr)
            failed = True
        if pending:
            print(f"mutation: unit {unit!r}: {len(pending)} mutants not run yet (e.g. {pending[0]})", file=sys.stderr)
            failed = True
        for n in killed_eq:
            print(f"mutation: {n} is listed as equivalent but a test kills it: unlist it", file=sys.stderr)
            failed = True
        if names and not score >= min_score:
            failed = True
        if show_survivors and survivors:
            print(f"\n{unit}: {len(survivors)} surviving")
            for n in survivors:
                print(f"  {n}")
    stale = [n for n in equivalent if n not in status and any(in_unit(n, u) for u in units)]
    for n in stale:
        print(f"mutation: {n} is listed as equivalent but no longer exists: remove it from the list", file=sys.stderr)
        failed = True
    print("\n| unit | mutants | killed | survived | equivalent | score |")
    print("|---|---:|---:|---:|---:|---:|")
    for unit, total, detected, surv, eq, score in rows:
        print(f"| {unit} | {total} | {detected} | {surv} | {eq} | {score:.1%} |")
    if failed:
        print(f"\nmutation: FAILED (every unit needs a score of at least {min_score:.0%}; see above)", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", action="append", choices=list(UNITS), help="run only this unit (repeatable)")
    parser.add_argument("--min-score", type=float, default=0.90, help="the least score of every unit (0.90)")
    parser.add_argument("--report-only", action="store_true", help="do not run mutmut; report the last run")
    parser.add_argument("--survivors", action="store_true", help="list each unit's surviving mutants")
    parser.add_argument("--max-children", type=int, default=2, help="mutmut's parallel test processes (2)")
    args = parser.parse_args(argv)
    units = args.unit or list(UNITS)
    if not args.report_only:
        globs = [g for u in units for g in UNITS[u]]
        run = subprocess.run(
            [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(args.max_children), *globs],
            cwd=ROOT,
            check=False,
        )
        if run.returncode != 0:
            print(f"mutation: `mutmut run` failed with exit status {run.returncode}", file=sys.stderr)
            return run.returncode
    return report(units, args.min_score, args.survivors)


if __name__ == "__main__":
    sys.exit(main())
