"""``klear sft``: long chain-of-thought SFT (TRL ``SFTTrainer``), the stage before ``klear rl``."""

from __future__ import annotations

import argparse


def _sft(ns: argparse.Namespace) -> int:
    from klear.config import load_config
    from klear.sft.job import run_sft

    config, path = load_config(ns.config, ns.overrides)
    if ns.output_dir:
        config["output_dir"] = ns.output_dir
    resume = ns.resume_from or ns.resume
    print(f"klear sft: recipe {path}, run directory {config.get('output_dir')}", flush=True)
    source = f"{path} + command-line overrides" if ns.overrides else str(path)
    run_sft(config, source=source, resume=resume)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sft`` subcommand (handler: :func:`_sft`, returns the exit code)."""
    p = subparsers.add_parser(
        "sft",
        help="long chain-of-thought SFT (default recipe: the tiny CPU demo with the procedural teacher)",
        description="Supervised fine-tuning on long-CoT responses (loss on the response tokens only). "
                    "Overrides use dotted keys, e.g. trainer.learning_rate=8e-5 data.train=sft.jsonl",
    )
    p.add_argument("--config", default="sft_demo",
                   help="a YAML recipe path, or a shipped recipe name (sft_demo, sft_klear); default sft_demo")
    p.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in <output_dir>/checkpoints")
    p.add_argument("--resume-from", default=None, metavar="CHECKPOINT",
                   help="continue from this checkpoint directory")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    p.set_defaults(func=_sft)
    return p
