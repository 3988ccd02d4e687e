"""``klear experiment --config <file> [--seeds 0,1,2] [--resume] [--output DIR] [--jobs N]``
(:mod:`klear.experiment`)."""

from __future__ import annotations


def _run(ns) -> int:
    from klear.experiment import load_experiment, parse_seeds, run_experiment

    exp = load_experiment(ns.config)
    seeds = parse_seeds(ns.seeds) if ns.seeds is not None else None
    try:
        run_experiment(exp, seeds=seeds, resume=ns.resume, output_dir=ns.output, jobs=ns.jobs)
    except KeyboardInterrupt:
        again = f"klear experiment --config {ns.config}"
        again += "".join(f" --{key} {value}" for key, value in (("seeds", ns.seeds), ("output", ns.output)) if value)
        print(f"\nklear experiment: interrupted; finished runs are kept: continue the others with {again} --resume")
        return 130
    return 0


def _jobs(text: str) -> int:
    import argparse
    import re

    value = int(text) if re.fullmatch(r"[0-9]+", text.strip()) else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    """Add the ``experiment`` subcommand."""
    from klear.config import shipped_configs
    from klear.experiment import EXPERIMENT_DIR

    names = [n for n in shipped_configs(EXPERIMENT_DIR) if not n.endswith("_gpu")]
    p = subparsers.add_parser(
        "experiment",
        help="a base RL (or SFT) recipe x arms x seeds, then a report with plots",
        description="Run every arm x seed of an experiment file as a klear rl run (klear sft with 'stage: sft'; "
        "finished runs are skipped), then write report.md, summary.json and plots in the experiment directory.",
    )
    p.add_argument(
        "--config",
        required=True,
        help=f"an experiment YAML path, or a shipped name (configs/experiments: {', '.join(names)}, *_gpu)",
    )
    p.add_argument("--seeds", default=None, help="comma-separated trainer seeds (default: the file's seeds)")
    p.add_argument(
        "--resume", action="store_true", help="continue unfinished (killed) runs from their latest checkpoint"
    )
    p.add_argument("--output", default=None, metavar="DIR", help="experiment directory (default: the file's)")
    p.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        metavar="N",
        help="CPU runs side by side, each in its own process with 1/N of the threads (default: the file's jobs, "
        "else 1); memory: N runs' worth",
    )
    p.set_defaults(func=_run)
