"""Evaluation metrics: the unbiased pass@k estimator (Chen et al. 2021) and friends."""

from __future__ import annotations

import math


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
