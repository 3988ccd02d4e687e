"""klear.eval.metrics: pass@k against the closed form, per-problem averaging, avg@n interval, maj@n."""

from __future__ import annotations

import math
import statistics

import pytest

from klear.eval.metrics import default_ks, majority_vote, normalize_answer, summarize_samples
from klear.stats import Z95, mean_pass_at_k, mean_with_ci, pass_at_k, pass_at_k_exact


def closed_form(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),  # c = 0: never 1, whatever k
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),  # c = n
        (5, 1, 5, 1.0),
        (5, 2, 5, 1.0),  # k = n: 1 as soon as one is correct
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 3, 1, 0.3),
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (64, 1, 8, 0.125),
        (64, 10, 16, closed_form(64, 10, 16)),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)
    assert pass_at_k_exact(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_closed_form_exhaustively():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_k_greater_than_n_even_with_nothing_correct():
    # the classic shortcut "n - c < k -> 1.0" would report 1.0 here
    with pytest.raises(ValueError, match="k=3 > n=2"):
        pass_at_k(2, 0, 3)
    with pytest.raises(ValueError, match="pass_at_k: k=3 > n=2"):
        pass_at_k(2, 2, 3)
    with pytest.raises(ValueError, match="outside"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match=r"c=-1 correct samples is outside \[0, n=4\]"):
        pass_at_k(4, -1, 1)
    with pytest.raises(ValueError, match="n must be >= 1, got n=0"):
        pass_at_k(0, 0, 1)
    with pytest.raises(ValueError, match="k must be >= 1, got k=0"):
        pass_at_k(4, 1, 0)


def test_pass_at_k_is_not_best_of_k_with_replacement():
    # with replacement: 1 - (1 - c/n)^k = 0.75; without (the unbiased estimator): 1.0
    assert pass_at_k(2, 1, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # with replacement: 1 - 0.75^2 = 0.4375
    # deterministic: no resampling anywhere
    assert len({pass_at_k(64, 7, 8) for _ in range(5)}) == 1


def test_mean_pass_at_k_is_per_problem_not_pooled():
    counts = [(2, 2), (2, 0)]
    # per problem: (1 + 0) / 2; pooled counts (n=4, c=2) would give 1 - C(2,2)/C(4,2) = 5/6
    assert mean_pass_at_k(counts, 2) == pytest.approx(0.5)
    assert mean_pass_at_k(counts, 2) != pytest.approx(closed_form(4, 2, 2))
    with pytest.raises(ValueError, match="problem b"):
        mean_pass_at_k([(4, 1), (2, 0)], 3, ids=["a", "b"])
    with pytest.raises(ValueError, match="pass@k over zero problems is undefined"):
        mean_pass_at_k([], 1)


def test_mean_with_ci_normal_approximation():
    vals = [1.0, 0.25, 0.0]
    r = mean_with_ci(vals)
    half = Z95 * statistics.stdev(vals) / math.sqrt(3)
    assert r["mean"] == pytest.approx(1.25 / 3)
    assert r["ci_low"] == pytest.approx(max(0.0, 1.25 / 3 - half))
    assert r["ci_high"] == pytest.approx(min(1.0, 1.25 / 3 + half))
    assert mean_with_ci([0.5, 0.5])["ci_low"] == 0.5
    one = mean_with_ci([0.3])
    assert one["ci_low"] is None and one["ci_high"] is None
    with pytest.raises(ValueError, match="mean over zero problems is undefined"):
        mean_with_ci([])


def test_majority_vote_groups_normalised_answers():
    assert normalize_answer(" \\dfrac{1}{2} ") == "\\frac{1}{2}"
    assert normalize_answer("17.00") == "17"
    assert normalize_answer("$17$.") == "17"
    assert normalize_answer("\\text{ yes }") == "yes"
    assert normalize_answer("") is None
    ans, ok = majority_vote(["5", "7", " 7", None, "5", "7"], [False, True, True, False, False, True])
    assert (ans, ok) == ("7", True)
    # tie -> earliest first vote
    assert majority_vote(["3", "4", "4", "3"], [True, False, False, True]) == ("3", True)
    assert majority_vote([None, None], [False, False]) == (None, False)
    with pytest.raises(ValueError, match="majority_vote: 1 answers but 0 verdicts"):
        majority_vote(["1"], [])


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(2) == [1, 2]
    assert default_ks(8) == [1, 2, 4, 8]
    assert default_ks(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_ks(6) == [1, 2, 4, 6]


def _recs(flags, tokens=None, fins=None, answers=None):
    return [
        {
            "sample_index": i,
            "correct": f,
            "n_tokens": None if tokens is None else tokens[i],
            "finish_reason": None if fins is None else fins[i],
            "extracted": None if answers is None else answers[i],
        }
        for i, f in enumerate(flags)
    ]


def test_summarize_samples_exact_values():
    samples = {
        "a": _recs([True] * 4, [10, 10, 10, 10], ["stop"] * 4, ["1"] * 4),
        "b": _recs(
            [True, False, False, False], [20, 40, 40, 40], ["stop", "length", "length", "stop"], ["2", "9", "9", "8"]
        ),
        "c": _recs([False] * 4, [5, 5, 5, 5], ["stop"] * 4, [None] * 4),
    }
    s = summarize_samples(["a", "b", "c"], samples, ks=[1, 2, 4], maj=True)
    assert s["n"] == 4 and s["n_problems"] == 3 and s["n_samples"] == 12
    assert s["avg_at_n"]["mean"] == pytest.approx(1.25 / 3)
    assert s["pass_at_k"] == pytest.approx({"1": 1.25 / 3, "2": (1 + 0.5 + 0) / 3, "4": 2 / 3})
    assert s["maj_at_n"] == pytest.approx(1 / 3)  # a: "1" right; b: "9" wrong; c: no votes
    assert s["mean_response_tokens"] == pytest.approx((40 + 140 + 20) / 12)
    assert s["truncation_rate"] == pytest.approx(2 / 12)
    assert [r["accuracy"] for r in s["per_problem"]] == [1.0, 0.25, 0.0]
    assert s["per_problem"][1]["truncated"] == 2
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        summarize_samples(["a"], samples, ks=[8])
    with pytest.raises(ValueError, match="no samples"):
        summarize_samples(["a", "zzz"], samples)
