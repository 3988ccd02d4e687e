"""Evaluation metrics: the unbiased pass@k estimator (Chen et al. 2021), avg@n with a 95%
interval, maj@n, and the per-problem summary that ``klear eval`` reports.

Every benchmark-level number is computed per problem first and then averaged over problems:
counts are never pooled across problems, k > n is refused, and nothing is resampled.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def _check_counts(n: int, c: int, k: int) -> None:
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"pass_at_k: {name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got n={n}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got k={k}")
    if k > n:
        raise ValueError(
            f"pass_at_k: k={k} > n={n}; pass@k needs at least k samples per problem "
            "(draw more samples or ask for a smaller k)"
        )
    if c < 0 or c > n:
        raise ValueError(f"pass_at_k: c={c} correct samples is outside [0, n={n}]")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``.

    Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"), Eq. 1, computed
    with their numerically stable product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``. Average the
    per-problem values to get a benchmark's pass@k; never pool counts across problems.

    Args:
        n: samples drawn for the problem (int, >= 1).
        c: how many of them are correct (int, 0 <= c <= n).
        k: the k of pass@k (int, 1 <= k <= n).

    Returns:
        A float in [0, 1]: the probability that at least one of k samples drawn without
        replacement from the n is correct. ``0.0`` when ``c == 0``; ``1.0`` when
        ``n - c < k``.

    Raises:
        ValueError: ``k > n``, ``c`` outside ``[0, n]``, ``n < 1``, ``k < 1`` or non-int input.
    """
    _check_counts(n, c, k)
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_exact(n: int, c: int, k: int) -> float:
    """:func:`pass_at_k` by the closed form with exact integer binomials (slow for large n).

    Same arguments, result and errors as :func:`pass_at_k`.
    """
    _check_counts(n, c, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ---------------------------------------------------------------------------------------------
# Benchmark-level metrics. Every function below takes PER-PROBLEM data; nothing pools sample
# counts across problems and nothing resamples (pass@k is the exact unbiased estimator above,
# never a "best of k" drawn with replacement).

#: Two-sided 95% normal quantile, Phi^-1(0.975).
Z95 = 1.959963984540054

CI_METHOD = (
    "normal approximation over problems: mean of the per-problem accuracies +/- 1.96 * "
    "sample std (ddof=1) of the per-problem accuracies / sqrt(#problems), clipped to [0, 1]; "
    "null with fewer than 2 problems"
)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int, ids: Sequence[str] | None = None) -> float:
    """Benchmark pass@k: :func:`pass_at_k` for EACH problem, then the plain mean over problems.

    Args:
        counts: one ``(n, c)`` pair per problem: samples drawn and how many were correct.
        k: the k of pass@k; every problem must have ``n >= k``.
        ids: optional problem ids, only used to name the offending problem in errors.

    Returns:
        The mean over problems of the per-problem unbiased estimate, in [0, 1].

    Raises:
        ValueError: no problems, or any problem with ``k > n`` or ``c`` outside ``[0, n]``
            (the message names the problem). Never guesses a value for k > n.
    """
    if not counts:
        raise ValueError("pass@k over zero problems is undefined")
    total = 0.0
    for i, (n, c) in enumerate(counts):
        try:
            total += pass_at_k(n, c, k)
        except ValueError as e:
            name = ids[i] if ids is not None else f"#{i}"
            raise ValueError(f"problem {name}: {e}") from None
    return total / len(counts)


def mean_with_ci(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean of per-problem values with a normal-approximation confidence interval.

    ``half = z * stdev(values) / sqrt(len(values))`` with the sample standard deviation
    (ddof = 1) and ``z = NormalDist().inv_cdf((1 + confidence) / 2)``; the interval is clipped
    to [0, 1] (accuracies). With one value the interval is ``None``; with identical values it
    collapses to the mean.

    Returns:
        ``{"mean", "ci_low", "ci_high", "confidence", "n_problems"}``.

    Raises:
        ValueError: empty input or confidence outside (0, 1).
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean over zero problems is undefined")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    m = len(vals)
    mean = sum(vals) / m
    if m < 2:
        lo = hi = None
    else:
        sd = statistics.stdev(vals)  # exact arithmetic: 0.0 for identical values
        z = statistics.NormalDist().inv_cdf((1.0 + confidence) / 2.0)
        half = z * sd / math.sqrt(m)
        lo, hi = max(0.0, mean - half), min(1.0, mean + half)
    return {"mean": mean, "ci_low": lo, "ci_high": hi, "confidence": confidence, "n_problems": m}


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
