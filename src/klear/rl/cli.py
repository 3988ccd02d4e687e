"""``klear rl``: GPPO reinforcement learning (TRL ``GRPOTrainer`` subclass, :mod:`klear.rl.trainer`)."""

from __future__ import annotations

import argparse


def _rl(ns: argparse.Namespace) -> int:
    from klear.rl.job import plan_rl, run_rl
    from klear.runs import run_command

    return run_command(ns, "rl", run_rl, plan_rl)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``rl`` subcommand (handler: :func:`_rl`, returns the exit code)."""
    from klear.runs import add_run_arguments

    p = subparsers.add_parser(
        "rl",
        help="GPPO reinforcement learning (default recipe: the tiny CPU demo)",
        description="Train with GPPO. Overrides use dotted keys, e.g. trainer.learning_rate=1e-6 data.train=x.jsonl",
    )
    add_run_arguments(
        p,
        default_recipe="rl_demo",
        recipes="rl_demo, rl_math_klear, rl_math_cegppo, rl_math_erc, rl_code_demo, rl_code_klear",
    )
    p.set_defaults(func=_rl)
    return p
