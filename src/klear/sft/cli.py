"""``klear sft``: long chain-of-thought SFT (TRL ``SFTTrainer``), the stage before ``klear rl``."""

from __future__ import annotations


def add_parser(subparsers):
    """Add the ``sft`` subcommand (:func:`klear.runs.add_stage_parser`; runs :func:`klear.sft.job.run_sft`)."""
    from klear.runs import add_stage_parser

    return add_stage_parser(
        subparsers,
        "sft",
        help="long chain-of-thought SFT (default recipe: the tiny CPU demo with the procedural teacher)",
        description="Supervised fine-tuning on long-CoT responses (loss on the response tokens only). "
        "Overrides use dotted keys, e.g. trainer.learning_rate=8e-5 data.train=sft.jsonl",
        default_recipe="sft_demo",
    )
