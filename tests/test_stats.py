"""klear.stats: the one statistics module, checked against values computed another way."""

import math
import subprocess
import sys
from fractions import Fraction
from itertools import combinations

import pytest
from scipy.stats import binomtest

from klear.stats import _mcnemar_exact, mean_ci, paired_difference, pass_at_k


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
