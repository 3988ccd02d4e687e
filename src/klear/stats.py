"""Statistics shared by every stage, in one place: the unbiased pass@k estimator, intervals for a mean (normal
over problems, Student t over seeds), the paired before/after comparison with the exact McNemar test.

The lowest layer of klear: it imports neither torch nor any other klear module. Quantiles and the binomial
test come from ``scipy.stats``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
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


def mean_ci(values: list[float], confidence: float = 0.95) -> dict[str, Any]:
    """Mean and Student-t interval of independent values (one per seed).

    Returns:
        ``{"n", "mean", "low", "high"}``: ``mean +/- t_{(1+confidence)/2, n-1} * sd / sqrt(n)`` with the sample
        sd (ddof 1); ``low``/``high`` are ``None`` for fewer than 2 values; ``mean`` is ``None`` for none.
    """
    from scipy.stats import t

    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "low": None, "high": None}
    mean = sum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "low": None, "high": None}
    half = float(t.ppf((1 + confidence) / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def _mcnemar_exact(n_improved: int, n_worsened: int) -> float:
    """Exact two-sided McNemar p-value: binomial test of the discordant pairs against p = 1/2.

    p = min(1, 2 * P(X <= min(b, c))) with X ~ Binomial(b + c, 1/2); 1.0 when there are no
    discordant pairs.
    """
    m = n_improved + n_worsened
    if m == 0:
        return 1.0
    k = min(n_improved, n_worsened)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2.0 * tail)


def paired_difference(before_correct: Sequence, after_correct: Sequence, confidence: float = 0.95) -> dict:
    """Paired comparison of per-problem correctness before and after training.

    With d_i = after_i - before_i over the SAME n problems (values are cast to float, so
    booleans or 0/1 work):

    * ``mean_diff`` = mean(d) = after accuracy - before accuracy;
    * CI = mean_diff +/- z * sd(d) / sqrt(n), with sd the SAMPLE std (ddof = 1) and
      z = NormalDist().inv_cdf((1 + confidence) / 2). This is the normal approximation; it
      is reasonable for n >= 30 and optimistic for smaller n. If all d_i are equal, sd = 0
      and the interval collapses to the single point mean_diff;
    * ``mcnemar_p``: exact two-sided McNemar test, i.e. a binomial test (p = 1/2) on the
      discordant pairs b = #improved (0 -> 1) and c = #worsened (1 -> 0) (for per-problem
      fractions such as avg@n, the same formula is the two-sided sign test over the problems
      whose value changed):
      p = min(1, 2 * sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c)); 1.0 if b + c = 0.

    Args:
        before_correct: per-problem correctness (bool / 0-1) before training.
        after_correct: the same problems, in the same order, after training.
        confidence: two-sided confidence level of the interval, in (0, 1).

    Returns:
        ``{"n", "before", "after", "mean_diff", "ci_low", "ci_high", "n_improved",
        "n_worsened", "mcnemar_p"}`` where ``before``/``after`` are the two accuracies.
        ``n_improved``/``n_worsened`` count d_i > 0 and d_i < 0.

    Raises:
        ValueError: the sequences differ in length, n < 2, or confidence is not in (0, 1).
    """
    before = [float(x) for x in before_correct]
    after = [float(x) for x in after_correct]
    if len(before) != len(after):
        raise ValueError(
            f"paired_difference needs the same problems before and after: got {len(before)} and {len(after)} values"
        )
    n = len(before)
    if n < 2:
        raise ValueError(f"paired_difference needs at least 2 problems, got {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = [a - b for a, b in zip(after, before)]
    mean_d = sum(d) / n
    sd = statistics.stdev(d) if len(set(d)) > 1 else 0.0
    z = statistics.NormalDist().inv_cdf((1.0 + confidence) / 2.0)
    half = z * sd / math.sqrt(n)
    n_improved = sum(1 for x in d if x > 0)
    n_worsened = sum(1 for x in d if x < 0)
    return {
        "n": n,
        "before": sum(before) / n,
        "after": sum(after) / n,
        "mean_diff": mean_d,
        "ci_low": mean_d - half,
        "ci_high": mean_d + half,
        "n_improved": n_improved,
        "n_worsened": n_worsened,
        "mcnemar_p": _mcnemar_exact(n_improved, n_worsened),
    }


def seeds_for_effect(sd: float, effect: float, *, alpha: float = 0.05, power: float = 0.8, max_n: int = 10_000) -> int:
    """The fewest seeds ``n`` whose paired two-sided t-test detects ``effect`` with ``power``:
    ``(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n) <= effect`` (the usual t approximation of the paired
    test's power). ``sd``: the SD of the per-seed paired differences.

    Raises:
        ValueError: ``effect <= 0`` or ``sd < 0``; no ``n <= max_n`` suffices.
    """
    if effect <= 0 or sd < 0:
        raise ValueError(f"seeds_for_effect needs effect > 0 and sd >= 0, got effect={effect}, sd={sd}")
    for n in range(2, max_n + 1):
        if minimum_detectable_effect(sd, n, alpha=alpha, power=power) <= effect:
            return n
    raise ValueError(f"more than {max_n} seeds would be needed to detect {effect} with sd {sd}")


def minimum_detectable_effect(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest paired difference ``n`` seeds detect with ``power`` at two-sided level ``alpha``:
    ``(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)`` (``sd``: SD of the per-seed differences).

    Raises:
        ValueError: ``n < 2``.
    """
    from scipy.stats import t

    if n < 2:
        raise ValueError(f"a minimum detectable effect needs at least 2 seeds, got {n}")
    return float((t.ppf(1 - alpha / 2, n - 1) + t.ppf(power, n - 1)) * sd / math.sqrt(n))


def probability_of_improvement(arm: Sequence[float], reference: Sequence[float]) -> float:
    """P(X > Y) for X a run of ``arm`` and Y a run of ``reference``, over every pair of runs, ties counting 1/2
    (the Mann-Whitney form of Agarwal et al., NeurIPS 2021)."""
    wins = sum((x > y) + 0.5 * (x == y) for x in arm for y in reference)
    return wins / (len(arm) * len(reference))


def seed_paired_comparison(
    reference: dict[Any, float],
    arm: dict[Any, float],
    *,
    confidence: float = 0.95,
    power: float = 0.8,
    effects: Sequence[float] = (0.02, 0.05),
    n_resamples: int = 2000,
    random_state: int = 0,
) -> dict[str, Any]:
    """An arm against the reference with the seed as the unit: per-seed values (e.g. final held-out accuracy)
    paired by seed.

    Returns:
        ``n`` (seeds both have), ``mean_diff`` (arm - reference) with its Student-t interval ``ci_low``/``ci_high``
        and two-sided paired t-test ``p``; ``sd_diff`` (sample SD of the differences); ``mde``
        (:func:`minimum_detectable_effect` at ``power`` for these seeds); ``seeds_needed`` (``{effect: seeds}``,
        :func:`seeds_for_effect`). The interval, ``p``, ``mde`` and ``seeds_needed`` are None for fewer than 2 seeds,
        and when every seed's difference is the same (``sd_diff`` 0: a few seeds that happen to tie, e.g. accuracies
        in steps of 1/256, say nothing about the spread, and a zero-width interval would read as decided);
        ``p_improvement`` (:func:`probability_of_improvement`) with a percentile bootstrap interval
        ``p_improvement_low``/``_high`` (``scipy.stats.bootstrap``, each arm's seeds resampled independently).

    Raises:
        ValueError: no seed in common.
    """
    from scipy import stats as sps

    seeds = [s for s in reference if s in arm]
    if not seeds:
        raise ValueError("seed_paired_comparison: the arm and the reference have no seed in common")
    d = [float(arm[s]) - float(reference[s]) for s in seeds]
    n = len(d)
    out: dict[str, Any] = {"n": n, "mean_diff": sum(d) / n}
    xs, ys = [float(arm[s]) for s in seeds], [float(reference[s]) for s in seeds]
    out["p_improvement"] = probability_of_improvement(xs, ys)
    if n < 2:
        return {**out, "ci_low": None, "ci_high": None, "p": None, "sd_diff": None, "mde": None, "seeds_needed": None}
    sd = statistics.stdev(d)
    boot = sps.bootstrap(
        (xs, ys),
        lambda a, b: probability_of_improvement(a, b),
        vectorized=False,
        paired=False,
        n_resamples=n_resamples,
        method="percentile",
        confidence_level=confidence,
        random_state=random_state,
    )
    out.update(
        sd_diff=sd,
        p_improvement_low=float(boot.confidence_interval.low),
        p_improvement_high=float(boot.confidence_interval.high),
    )
    if sd == 0:  # every difference equal: the t statistic, the interval and the power are undefined
        return {**out, "ci_low": None, "ci_high": None, "p": None, "mde": None, "seeds_needed": None}
    interval = mean_ci(d, confidence)  # the Student-t interval of the differences
    return {
        **out,
        "ci_low": interval["low"],
        "ci_high": interval["high"],
        "p": float(sps.ttest_1samp(d, 0.0).pvalue),
        "mde": minimum_detectable_effect(sd, n, alpha=1 - confidence, power=power),
        "seeds_needed": {str(e): seeds_for_effect(sd, e, alpha=1 - confidence, power=power) for e in effects},
    }
