"""Command line: ``klear rl|sft|eval|data ...``.

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``; the
parser it adds must ``set_defaults(func=handler)`` where ``handler(ns) -> int`` returns the
exit code. ``ValueError`` / ``FileNotFoundError`` raised by a handler become a one-line
``klear <command>: error: ...`` message and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules that each add one subcommand with ``add_parser(subparsers)``.
_SUBCOMMAND_MODULES: list[str] = [
    "klear.sft.cli",  # (klear sft)
    "klear.eval.cli",  # (klear eval)
    "klear.data.cli",  # (klear data)
    "klear.experiment.cli",  # (klear experiment)
]


def _rl(ns: argparse.Namespace) -> int:
    from klear.rl.job import plan_rl, run_rl
    from klear.runs import run_command

    return run_command(ns, "rl", run_rl, plan_rl)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``klear eval: error: ... (see
    klear eval --help)``) instead of the whole usage block; sub-parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from klear.runs import add_run_arguments

    parser = OneLineErrorParser(prog="klear", description="Klear-Reasoner post-training: GPPO RL and friends.")
    sub = parser.add_subparsers(dest="command", required=True)
    rl = sub.add_parser(
        "rl",
        help="GPPO reinforcement learning (default recipe: the tiny CPU demo)",
        description="Train with GPPO. Overrides use dotted keys, e.g. trainer.learning_rate=1e-6 data.train=x.jsonl",
    )
    add_run_arguments(
        rl,
        default_recipe="rl_demo",
        recipes="rl_demo, rl_math_klear, rl_math_cegppo, rl_math_erc, rl_code_demo, rl_code_klear",
    )
    rl.set_defaults(func=_rl)
    for module_name in _SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``klear`` console script. Returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    ns = build_parser().parse_args(argv)
    if "torch" not in sys.modules:  # must be set before torch starts its OpenMP pool
        from klear.precision import set_cpu_runtime_defaults

        set_cpu_runtime_defaults()
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        _close_progress_bars()  # an error during training: the message gets its own line
        print(f"klear {ns.command}: error: {e}", file=sys.stderr)
        return 2


def _close_progress_bars() -> None:
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is not None:
        for bar in list(getattr(tqdm_module.tqdm, "_instances", ())):
            bar.close()


if __name__ == "__main__":
    sys.exit(main())
