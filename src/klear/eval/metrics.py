"""Evaluation metrics: the unbiased pass@k estimator (Chen et al. 2021), avg@n with a 95%
interval, maj@n, and the per-problem summary that ``klear eval`` reports.

Every benchmark-level number is computed per problem first and then averaged over problems:
counts are never pooled across problems, k > n is refused, and nothing is resampled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from klear.stats import CI_METHOD, mean_pass_at_k, mean_with_ci

# ---------------------------------------------------------------------------------------------
# Benchmark-level metrics. Every function below takes PER-PROBLEM data; nothing pools sample
# counts across problems and nothing resamples (pass@k is the exact unbiased estimator above,
# never a "best of k" drawn with replacement).


def normalize_answer(answer: str | None) -> str | None:
    """Normalised form of an extracted final answer, used to group votes for maj@n.

    Removes all whitespace, ``$``, ``\\left``/``\\right``, ``\\!``/``\\,``/``\\;``/``\\ ``,
    ``\\text{...}`` wrappers (kept: their content), ``\\dfrac``/``\\tfrac`` -> ``\\frac``, one
    trailing period, and a trailing ``.0...`` on integers (``17.00`` -> ``17``). ``None`` or an
    empty result is ``None`` (no vote).
    """
    if answer is None:
        return None
    s = str(answer)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("$", ""),
    ):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    if s.endswith(".") and len(s) > 1:
        s = s[:-1]
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    return s or None


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> tuple[str | None, bool]:
    """maj@n for one problem: the most frequent normalised answer and whether it is correct.

    Votes are grouped by :func:`normalize_answer` (exact string equality after
    normalisation); samples without an answer do not vote. Ties go to the answer whose first
    vote came earliest (deterministic). The winning group counts as correct when more than
    half of its samples were judged correct (they all agree unless the judge timed out on
    some). No votes at all: ``(None, False)``.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_vote: {len(answers)} answers but {len(correct)} verdicts")
    groups: dict[str, list[bool]] = {}
    for a, ok in zip(answers, correct):
        key = normalize_answer(a)
        if key is not None:
            groups.setdefault(key, []).append(bool(ok))  # dict keeps first-vote order
    if not groups:
        return None, False
    best = max(groups, key=lambda g: len(groups[g]))  # first maximal in insertion order
    votes = groups[best]
    return best, sum(votes) * 2 > len(votes)


def default_ks(n: int) -> list[int]:
    """The k values reported by default for n samples: powers of two below n, and n itself."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def summarize_samples(
    problem_ids: Sequence[str],
    samples: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    ks: Sequence[int] | None = None,
    maj: bool = False,
    confidence: float = 0.95,
) -> dict:
    """Benchmark metrics from judged samples, computed per problem first.

    Args:
        problem_ids: the problems, in report order; each must have at least one sample.
        samples: ``problem_id -> list of sample records``; a record has ``correct`` (bool) and
            optionally ``n_tokens`` (int), ``finish_reason`` (``"stop"``/``"length"``/...),
            ``extracted`` (str, used by maj@n) and ``sample_index``.
        ks: the k values of pass@k; default :func:`default_ks` of the smallest per-problem n.
        maj: also compute maj@n (majority vote over extracted answers).
        confidence: level of the avg@n interval.

    Returns:
        A dict with ``n`` (samples per problem; ``n_min``/``n_max`` when they differ),
        ``n_problems``, ``n_samples``, ``avg_at_n`` (``mean``, ``ci_low``, ``ci_high``,
        ``confidence``, ``method``), ``pass_at_k`` (``{"k": value}``), ``maj_at_n`` (only with
        ``maj``), ``mean_response_tokens`` and ``truncation_rate`` (``None`` when no sample
        carries that information), and ``per_problem`` (a list with ``problem_id``, ``n``,
        ``correct``, ``accuracy``, ``mean_tokens``, ``truncated`` and, with ``maj``,
        ``maj_answer``/``maj_correct``).

        avg@n is the mean over problems of the per-problem accuracy c_i / n_i (with equal n it
        is also the mean over all samples). pass@k is :func:`mean_pass_at_k`.

    Raises:
        ValueError: no problems, a problem without samples, or a k larger than some problem's
            sample count (the error names it).
    """
    ids = [str(p) for p in problem_ids]
    if not ids:
        raise ValueError("no problems to summarise")
    per_problem: list[dict[str, Any]] = []
    counts: list[tuple[int, int]] = []
    all_tokens: list[int] = []
    finish: list[str] = []
    for pid in ids:
        recs = list(samples.get(pid, ()))
        if not recs:
            raise ValueError(f"problem {pid} has no samples")
        n = len(recs)
        c = sum(1 for r in recs if r["correct"])
        counts.append((n, c))
        toks = [int(r["n_tokens"]) for r in recs if r.get("n_tokens") is not None]
        fins = [str(r["finish_reason"]) for r in recs if r.get("finish_reason") is not None]
        all_tokens += toks
        finish += fins
        row = {
            "problem_id": pid,
            "n": n,
            "correct": c,
            "accuracy": c / n,
            "mean_tokens": (sum(toks) / len(toks)) if toks else None,
            "truncated": sum(1 for f in fins if f == "length") if fins else None,
        }
        if maj:
            ordered = sorted(recs, key=lambda r: r.get("sample_index", 0))
            ans, ok = majority_vote([r.get("extracted") for r in ordered], [bool(r["correct"]) for r in ordered])
            row["maj_answer"], row["maj_correct"] = ans, ok
        per_problem.append(row)

    ns = [n for n, _ in counts]
    n_min, n_max = min(ns), max(ns)
    ks = list(default_ks(n_min) if ks is None else ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"pass@k: k must be a positive int, got {k!r}")
        if k > n_min:
            short = next(pid for pid, (n, _) in zip(ids, counts) if n < k)
            raise ValueError(
                f"pass@{k} needs at least {k} samples per problem, but problem {short} has "
                f"{dict(zip(ids, ns))[short]} (k > n is refused, never estimated)"
            )
    ci = mean_with_ci([row["accuracy"] for row in per_problem], confidence)
    out: dict[str, Any] = {
        "n": n_min if n_min == n_max else None,
        "n_problems": len(ids),
        "n_samples": sum(ns),
        "avg_at_n": {
            "mean": ci["mean"],
            "ci_low": ci["ci_low"],
            "ci_high": ci["ci_high"],
            "confidence": confidence,
            "method": CI_METHOD,
        },
        # every n >= k and 0 <= c <= n here (checked above), so no problem needs naming
        "pass_at_k": {str(k): mean_pass_at_k(counts, k) for k in sorted(set(ks))},
    }
    if n_min != n_max:
        out["n_min"], out["n_max"] = n_min, n_max
    if maj:
        out["maj_at_n"] = sum(1 for row in per_problem if row["maj_correct"]) / len(per_problem)
    out["mean_response_tokens"] = (sum(all_tokens) / len(all_tokens)) if all_tokens else None
    out["truncation_rate"] = (sum(1 for f in finish if f == "length") / len(finish)) if finish else None
    out["per_problem"] = per_problem
    return out
