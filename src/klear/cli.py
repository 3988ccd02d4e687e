"""Command line: ``klear rl|sft|eval|data|experiment|bench ...``; this module only dispatches.

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
    "klear.rl.cli",  # (klear rl)
    "klear.sft.cli",  # (klear sft)
    "klear.eval.cli",  # (klear eval)
    "klear.data.cli",  # (klear data)
    "klear.experiment.cli",  # (klear experiment)
    "klear.experiment.bench",  # (klear bench); importing it lets model: bench:<name> build on first use
]


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``klear eval: error: ... (see
    klear eval --help)``) instead of the whole usage block; sub-parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="klear", description="Klear-Reasoner post-training: GPPO RL and friends.")
    sub = parser.add_subparsers(dest="command", required=True)
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

        set_cpu_runtime_defaults()  # the OpenMP wait policy; run.json records it
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
