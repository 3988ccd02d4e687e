"""``klear sft``: long chain-of-thought SFT (TRL ``SFTTrainer``), the stage before ``klear rl``."""

from __future__ import annotations

import argparse


def _sft(ns: argparse.Namespace) -> int:
    from klear.runs import run_command
    from klear.sft.job import plan_sft, run_sft

    return run_command(ns, "sft", run_sft, plan_sft)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sft`` subcommand (handler: :func:`_sft`, returns the exit code)."""
    from klear.runs import add_run_arguments

    p = subparsers.add_parser(
        "sft",
        help="long chain-of-thought SFT (default recipe: the tiny CPU demo with the procedural teacher)",
        description="Supervised fine-tuning on long-CoT responses (loss on the response tokens only). "
        "Overrides use dotted keys, e.g. trainer.learning_rate=8e-5 data.train=sft.jsonl",
    )
    add_run_arguments(p, default_recipe="sft_demo", recipes="sft_demo, sft_klear")
    p.set_defaults(func=_sft)
    return p
