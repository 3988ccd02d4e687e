"""``klear rl``: GPPO reinforcement learning (TRL ``GRPOTrainer`` subclass, :mod:`klear.rl.trainer`)."""

from __future__ import annotations


def add_parser(subparsers):
    """Add the ``rl`` subcommand (:func:`klear.runs.add_stage_parser`; runs :func:`klear.rl.job.run_rl`)."""
    from klear.runs import add_stage_parser

    return add_stage_parser(
        subparsers,
        "rl",
        help="GPPO reinforcement learning (default recipe: the tiny CPU demo)",
        description="Train with GPPO. Overrides use dotted keys, e.g. trainer.learning_rate=1e-6 data.train=x.jsonl",
        default_recipe="rl_demo",
    )
