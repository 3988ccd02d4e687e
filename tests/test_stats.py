"""klear.stats: the one statistics module, checked against values computed another way."""

import math
import subprocess
import sys
from fractions import Fraction
from itertools import combinations

import pytest
from scipy.stats import binomtest

from klear.stats import (
    _mcnemar_exact,
    mean_ci,
    minimum_detectable_effect,
    paired_difference,
    pass_at_k,
    probability_of_improvement,
    seed_paired_comparison,
    seeds_for_effect,
)


def test_stats_imports_without_torch_or_other_klear_modules():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import klear.stats\n"
        "print(sorted(m for m in sys.modules if m.startswith('klear')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['klear', 'klear.stats']"


@pytest.mark.parametrize("b, c", [(0, 0), (1, 0), (5, 1), (3, 3), (12, 2), (0, 9), (40, 25)])
def test_mcnemar_is_the_two_sided_binomial_test(b, c):
    expected = 1.0 if b + c == 0 else binomtest(b, b + c, 0.5).pvalue
    assert _mcnemar_exact(b, c) == pytest.approx(expected, rel=1e-12)


def test_mean_ci_is_the_student_t_interval():
    # t_{0.975, 3} = 3.182446305 (table value); sd of 1..4 = sqrt(5/3)
    r = mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2
    assert r["n"] == 4 and r["mean"] == 2.5
    assert r["low"] == pytest.approx(2.5 - half, rel=1e-9) and r["high"] == pytest.approx(2.5 + half, rel=1e-9)
    assert mean_ci([0.3]) == {"n": 1, "mean": 0.3, "low": None, "high": None}
    assert mean_ci([]) == {"n": 0, "mean": None, "low": None, "high": None}


def test_paired_difference_by_hand():
    before = [1, 0, 0, 1, 0, 1]
    after = [1, 1, 1, 0, 1, 1]
    # d = [0, 1, 1, -1, 1, 0]: mean 1/3, sample variance (sum d^2 - n mean^2)/(n-1) = (4 - 6/9)/5 = 2/3
    r = paired_difference(before, after)
    half = 1.959963984540054 * math.sqrt(2 / 3) / math.sqrt(6)
    assert (r["n"], r["n_improved"], r["n_worsened"]) == (6, 3, 1)
    assert r["before"] == 0.5 and r["after"] == pytest.approx(5 / 6)
    assert r["mean_diff"] == pytest.approx(1 / 3)
    assert r["ci_low"] == pytest.approx(1 / 3 - half) and r["ci_high"] == pytest.approx(1 / 3 + half)
    assert r["mcnemar_p"] == pytest.approx(0.625)  # 2 * (1 + 4) / 16


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n, c, k in [(5, 2, 2), (6, 1, 3), (7, 3, 4), (4, 0, 2), (4, 4, 1)]:
        subsets = list(combinations([1] * c + [0] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(float(Fraction(sum(any(s) for s in subsets), len(subsets))))


def test_minimum_detectable_effect_and_seeds_needed_from_table_t_quantiles():
    # (t_{0.975,n-1} + t_{0.8,n-1}) * sd / sqrt(n); table values: n=5: 2.776445 + 0.940965; n=7: 2.446912 + 0.905570;
    # n=8: 2.364624 + 0.896317
    assert minimum_detectable_effect(0.04, 5) == pytest.approx(3.717410 * 0.04 / math.sqrt(5), rel=1e-5)
    assert 3.352482 * 0.04 / math.sqrt(7) > 0.05 >= 3.260941 * 0.04 / math.sqrt(8)
    assert seeds_for_effect(0.04, 0.05) == 8
    with pytest.raises(ValueError, match="at least 2 seeds"):
        minimum_detectable_effect(0.04, 1)


def test_probability_of_improvement_counts_pairs_and_halves_ties():
    # pairs (0.5, 0.5) tie, (0.5, 0.4) win, (0.6, 0.5) win, (0.6, 0.4) win: 3.5 / 4
    assert probability_of_improvement([0.5, 0.6], [0.5, 0.4]) == 0.875


def test_seed_paired_comparison_by_hand():
    ref, arm = {0: 0.45, 1: 0.43, 2: 0.51}, {0: 0.385, 1: 0.495, 2: 0.469}
    # d = [-0.065, 0.065, -0.041]; mean -0.041/3; sample SD 0.0691761; t_{0.975,2} = 4.302653
    c = seed_paired_comparison(ref, arm)
    sd = math.sqrt(((-0.065 + 0.041 / 3) ** 2 + (0.065 + 0.041 / 3) ** 2 + (-0.041 + 0.041 / 3) ** 2) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert c["mean_diff"] == pytest.approx(-0.041 / 3) and c["sd_diff"] == pytest.approx(sd)
    assert (c["ci_low"], c["ci_high"]) == pytest.approx((-0.041 / 3 - half, -0.041 / 3 + half), rel=1e-5)
    tstat = (-0.041 / 3) / (sd / math.sqrt(3))
    assert c["p"] == pytest.approx(1 - abs(tstat) / math.sqrt(2 + tstat**2))  # the t CDF with 2 df in closed form
    assert c["p_improvement"] == pytest.approx(4 / 9)  # 0.495 and 0.469 each beat 0.45 and 0.43
    assert 0.0 <= c["p_improvement_low"] <= 4 / 9 <= c["p_improvement_high"] <= 1.0
    assert c == seed_paired_comparison(ref, arm)  # the bootstrap is seeded


@pytest.mark.parametrize("shift", [5 / 256, 0.0])
def test_seeds_that_tie_leave_the_comparison_undecided(shift):
    """Two seeds that each differ by exactly 5 of 256 problems have no spread: the report called that p 0, an
    interval of zero width and an MDE of 0 (decided)."""
    ref = {0: 150 / 256, 1: 140 / 256}
    c = seed_paired_comparison(ref, {s: v + shift for s, v in ref.items()})
    assert c["mean_diff"] == pytest.approx(shift) and c["sd_diff"] == 0.0
    assert c["p"] is None and c["ci_low"] is None and c["ci_high"] is None
    assert c["mde"] is None and c["seeds_needed"] is None
    assert c["p_improvement"] == (0.75 if shift else 0.5)  # over all 4 pairs of runs, ties 1/2
