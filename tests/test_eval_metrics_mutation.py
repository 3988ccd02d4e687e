"""klear.eval.metrics against values computed another way (issue 21, mutation testing of `klear eval`'s statistics).

pass@k: by enumerating every k-subset of the n samples (the definition: at least one of k samples drawn without
replacement is correct) and by scipy's hypergeometric distribution; the avg@n interval: by scipy's normal
quantile and numpy's float64 sample std; the error messages by their text.
"""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import combinations

import numpy as np
import pytest
from scipy.stats import hypergeom, norm

from klear.eval.metrics import default_ks, majority_vote, normalize_answer, summarize_samples
from klear.stats import CI_METHOD, mean_pass_at_k, mean_with_ci, pass_at_k, pass_at_k_exact


def pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(combinations(range(n), k))
    return Fraction(sum(1 for s in subsets if min(s) < c), len(subsets))


# ------------------------------------------------------------------ pass@k (Chen et al. 2021, Eq. 1)


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = float(pass_at_k_by_enumeration(n, c, k))
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
                assert pass_at_k_exact(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(200, 1, 10), (200, 37, 5), (200, 120, 50), (64, 3, 32), (100, 1, 1), (30, 29, 2)])
def test_pass_at_k_equals_one_minus_the_hypergeometric_probability_of_no_correct_draw(n, c, k):
    # P(no correct among k draws without replacement) = hypergeom(M=n, n=c, N=k).pmf(0)
    expected = 1.0 - hypergeom(n, c, k).pmf(0)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert pass_at_k_exact(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("fn", [pass_at_k, pass_at_k_exact])
@pytest.mark.parametrize(
    "args,message",
    [
        ((True, 0, 1), "pass_at_k: n must be an int, got True"),
        ((4.0, 0, 1), "pass_at_k: n must be an int, got 4.0"),
        ((4, False, 1), "pass_at_k: c must be an int, got False"),
        ((4, 1.0, 1), "pass_at_k: c must be an int, got 1.0"),
        ((4, 1, True), "pass_at_k: k must be an int, got True"),
        ((4, 1, "2"), "pass_at_k: k must be an int, got '2'"),
        ((0, 0, 1), "pass_at_k: n must be >= 1, got n=0"),
        ((-2, 0, 1), "pass_at_k: n must be >= 1, got n=-2"),
        ((4, 1, 0), "pass_at_k: k must be >= 1, got k=0"),
        ((4, 1, -1), "pass_at_k: k must be >= 1, got k=-1"),
        ((4, 1, 5), r"pass_at_k: k=5 > n=4; pass@k needs at least k samples per problem \(draw more samples or ask "),
        ((4, -1, 1), r"pass_at_k: c=-1 correct samples is outside \[0, n=4\]"),
        ((4, 5, 1), r"pass_at_k: c=5 correct samples is outside \[0, n=4\]"),
    ],
)
def test_pass_at_k_errors_name_the_bad_count(fn, args, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        fn(*args)


def test_pass_at_k_edges_are_valid_counts():
    # the boundaries of the checks are allowed: n = 1, k = 1, k = n, c = 0, c = n
    assert pass_at_k(1, 0, 1) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 3, 3) == 1.0
    assert pass_at_k_exact(3, 0, 3) == 0.0 and pass_at_k_exact(3, 3, 1) == 1.0


def test_mean_pass_at_k_is_the_mean_of_per_problem_values_and_names_the_problem():
    counts = [(8, 1), (8, 5), (6, 0), (10, 10)]
    for k in (1, 2, 6):
        expected = sum(float(pass_at_k_by_enumeration(n, c, k)) for n, c in counts) / len(counts)
        assert mean_pass_at_k(counts, k) == pytest.approx(expected, abs=1e-12)
    # by id when given, else by position; the per-problem error follows
    with pytest.raises(ValueError, match=r"^problem p3: pass_at_k: k=7 > n=6; "):
        mean_pass_at_k(counts, 7, ids=["p1", "p2", "p3", "p4"])
    with pytest.raises(ValueError, match=r"^problem #2: pass_at_k: k=7 > n=6; "):
        mean_pass_at_k(counts, 7)
    with pytest.raises(ValueError, match=r"^problem #1: pass_at_k: c=9 correct samples is outside"):
        mean_pass_at_k([(8, 1), (8, 9)], 1)
    with pytest.raises(ValueError, match=r"^pass@k over zero problems is undefined$"):
        mean_pass_at_k([], 1)


# ------------------------------------------------------------------ avg@n and its interval


def _normal_interval(vals, confidence):
    a = np.asarray(vals, dtype=np.float64)
    half = norm.ppf((1 + confidence) / 2) * a.std(ddof=1) / math.sqrt(len(a))
    return a.mean(), a.mean() - half, a.mean() + half


@pytest.mark.parametrize("confidence", [0.5, 0.8, 0.95, 0.99])
@pytest.mark.parametrize("vals", [[0.4, 0.6], [0.1, 0.5, 0.3, 0.6], [0.4, 0.45, 0.5, 0.55, 0.6, 0.35]])
def test_mean_with_ci_is_the_normal_interval_with_the_sample_std(vals, confidence):
    mean, lo, hi = _normal_interval(vals, confidence)
    assert 0.0 < lo and hi < 1.0  # not clipped: the interval itself is checked
    r = mean_with_ci(vals, confidence)
    assert r["mean"] == pytest.approx(mean, abs=1e-12)
    assert r["ci_low"] == pytest.approx(lo, abs=1e-12) and r["ci_high"] == pytest.approx(hi, abs=1e-12)
    assert r["confidence"] == confidence and r["n_problems"] == len(vals)


def test_mean_with_ci_default_level_is_95_percent():
    vals = [0.2, 0.4, 0.5, 0.7]
    mean, lo, hi = _normal_interval(vals, 0.95)
    r = mean_with_ci(vals)
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((lo, hi), abs=1e-12) and r["confidence"] == 0.95


def test_mean_with_ci_clips_to_accuracies_and_collapses_on_equal_values():
    mean, lo, hi = _normal_interval([1.0, 1.0, 0.2], 0.95)
    assert 0.0 < lo and hi > 1.0
    r = mean_with_ci([1.0, 1.0, 0.2])
    assert r["ci_high"] == 1.0 and r["ci_low"] == pytest.approx(lo, abs=1e-12)
    mean, lo, hi = _normal_interval([0.0, 0.0, 0.8], 0.95)
    assert lo < 0.0 and hi < 1.0
    r = mean_with_ci([0.0, 0.0, 0.8])
    assert r["ci_low"] == 0.0 and r["ci_high"] == pytest.approx(hi, abs=1e-12) and r["mean"] == pytest.approx(0.8 / 3)
    for v in (0.0, 0.3, 1.0):
        same = mean_with_ci([v, v, v], 0.9)
        assert same == {"mean": v, "ci_low": v, "ci_high": v, "confidence": 0.9, "n_problems": 3}
    assert mean_with_ci([0.7]) == {"mean": 0.7, "ci_low": None, "ci_high": None, "confidence": 0.95, "n_problems": 1}
    assert mean_with_ci([1, 0], 0.5)["mean"] == 0.5  # ints are read as floats


@pytest.mark.parametrize("confidence", [0.0, 1.0, -0.5, 1.5])
def test_mean_with_ci_refuses_a_level_outside_zero_one(confidence):
    with pytest.raises(ValueError, match=rf"^confidence must be in \(0, 1\), got {confidence}$"):
        mean_with_ci([0.1, 0.2], confidence)
    with pytest.raises(ValueError, match=r"^mean over zero problems is undefined$"):
        mean_with_ci([], 0.9)


# ------------------------------------------------------------------ maj@n


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("a\\!b", "ab"),
        ("a\\,b", "ab"),
        ("a\\;b", "ab"),
        ("a\\ b", "ab"),
        ("\\tfrac{1}{2}", "\\frac{1}{2}"),
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("$\\frac{1}{2}$", "\\frac{1}{2}"),
        ("\\text{a}+\\text{ b }", "a+b"),
        ("5.", "5"),
        (".", "."),  # a lone period is an answer, not an empty one
        ("5..", "5."),  # one trailing period only
        ("-3.000", "-3"),
        ("1.50", "1.50"),
        ("12.0.", "12"),
        ("  \n ", None),
        (None, None),
        (7, "7"),
    ],
)
def test_normalize_answer_each_rule(raw, expected):
    assert normalize_answer(raw) == expected


def test_majority_vote_needs_more_than_half_of_the_winning_votes_correct():
    assert majority_vote(["4", "4", "4", "4"], [True, True, False, False]) == ("4", False)  # exactly half
    assert majority_vote(["4", "4", "4"], [True, False, False]) == ("4", False)  # a third
    assert majority_vote(["4", "4", "4"], [True, True, False]) == ("4", True)  # two thirds
    assert majority_vote(["4", "4", "4", "4"], [True, True, True, False]) == ("4", True)
    assert majority_vote(["9", " 9 ", "1"], [1, 1, 0]) == ("9", True)  # truthy verdicts count
    with pytest.raises(ValueError, match=r"^majority_vote: 2 answers but 3 verdicts$"):
        majority_vote(["1", "2"], [True, False, True])


def test_default_ks_refuses_no_samples():
    assert default_ks(3) == [1, 2, 3] and default_ks(16) == [1, 2, 4, 8, 16]
    for n in (0, -1):
        with pytest.raises(ValueError, match=rf"^n must be >= 1, got {n}$"):
            default_ks(n)


# ------------------------------------------------------------------ the summary of `klear eval`


def _rec(i, correct, **kw):
    return {"sample_index": i, "correct": correct, **kw}


def test_summarize_samples_per_problem_fields_and_defaults():
    samples = {
        "a": [_rec(0, True, n_tokens=10), _rec(1, False, n_tokens=30), _rec(2, True, n_tokens=20)],
        "b": [
            _rec(0, False, finish_reason="length"),
            _rec(1, True, finish_reason="stop"),
            _rec(2, False, finish_reason="length"),
        ],
    }
    s = summarize_samples(["a", "b"], samples)
    assert "maj_at_n" not in s and "maj_answer" not in s["per_problem"][0]  # maj@n only when asked
    assert s["n"] == 3 and "n_min" not in s and s["n_samples"] == 6
    a, b = s["per_problem"]
    assert a == {"problem_id": "a", "n": 3, "correct": 2, "accuracy": 2 / 3, "mean_tokens": 20.0, "truncated": None}
    assert b == {"problem_id": "b", "n": 3, "correct": 1, "accuracy": 1 / 3, "mean_tokens": None, "truncated": 2}
    assert s["mean_response_tokens"] == 20.0 and s["truncation_rate"] == 2 / 3  # over the samples that report it
    assert s["pass_at_k"] == pytest.approx({"1": 0.5, "2": (1 + 2 / 3) / 2, "3": 1.0})
    mean, lo, hi = _normal_interval([2 / 3, 1 / 3], 0.95)
    assert s["avg_at_n"] == pytest.approx(
        {"mean": 0.5, "ci_low": max(lo, 0.0), "ci_high": min(hi, 1.0), "confidence": 0.95, "method": CI_METHOD}
    )
    none = summarize_samples(["x"], {"x": [{"correct": True}]})
    assert none["mean_response_tokens"] is None and none["truncation_rate"] is None
    assert none["avg_at_n"]["ci_low"] is None and none["pass_at_k"] == {"1": 1.0}


def test_summarize_samples_uses_the_asked_confidence_and_unequal_n():
    samples = {
        "a": [_rec(i, i < 3) for i in range(4)],
        "b": [_rec(i, i < 1) for i in range(2)],
        "c": [_rec(i, i < 2) for i in range(5)],
    }
    s = summarize_samples(["a", "b", "c"], samples, confidence=0.8, ks=[2, 1, 2])
    mean, lo, hi = _normal_interval([3 / 4, 1 / 2, 2 / 5], 0.8)
    assert s["avg_at_n"]["confidence"] == 0.8
    assert (s["avg_at_n"]["ci_low"], s["avg_at_n"]["ci_high"]) == pytest.approx((lo, hi), abs=1e-12)
    assert s["n"] is None and s["n_min"] == 2 and s["n_max"] == 5 and s["n_samples"] == 11
    assert list(s["pass_at_k"]) == ["1", "2"]  # sorted, once each
    assert s["pass_at_k"]["2"] == pytest.approx((1 + 1 + 1 - 3 / 10) / 3)
    assert list(summarize_samples(["a", "c"], samples)["pass_at_k"]) == ["1", "2", "4"]  # default_ks(min n)


def test_summarize_samples_votes_in_sample_index_order():
    # stored out of order: the tie between "1" and "2" goes to the answer of the lower sample_index
    recs = [_rec(3, False, extracted="2"), _rec(0, True, extracted="1"), _rec(2, False, extracted="2")]
    recs.append(_rec(1, True, extracted="1"))
    s = summarize_samples(["p"], {"p": recs}, maj=True)
    assert (s["per_problem"][0]["maj_answer"], s["per_problem"][0]["maj_correct"]) == ("1", True)
    assert s["maj_at_n"] == 1.0
    # without sample_index the stored order stands (a missing index counts as 0)
    plain = [{"correct": False, "extracted": "2"}, {"correct": True, "extracted": "1"}]
    s = summarize_samples(["p"], {"p": plain}, maj=True)
    assert s["per_problem"][0]["maj_answer"] == "2" and s["maj_at_n"] == 0.0
    mixed = [{"correct": False, "extracted": "2"}, _rec(0, True, extracted="1")]
    assert summarize_samples(["p"], {"p": mixed}, maj=True)["per_problem"][0]["maj_answer"] == "2"


@pytest.mark.parametrize("k", [0, -1, True, 1.5, "2"])
def test_summarize_samples_refuses_a_k_that_is_not_a_positive_int(k):
    samples = {"a": [_rec(i, True) for i in range(4)]}
    with pytest.raises(ValueError, match=rf"^pass@k: k must be a positive int, got {k!r}$"):
        summarize_samples(["a"], samples, ks=[1, k])


def test_summarize_samples_names_the_first_problem_with_too_few_samples():
    samples = {"a": [_rec(i, True) for i in range(4)], "b": [_rec(i, True) for i in range(2)]}
    samples["c"] = samples["b"]
    with pytest.raises(ValueError, match=r"^pass@4 needs at least 4 samples per problem, but problem b has 2 \(k > n"):
        summarize_samples(["a", "b", "c"], samples, ks=[4])
    with pytest.raises(ValueError, match=r"^pass@3 needs at least 3 samples per problem, but problem b has 2 "):
        summarize_samples(["a", "b"], samples, ks=[3])
    with pytest.raises(ValueError, match=r"^no problems to summarise$"):
        summarize_samples([], samples)
    with pytest.raises(ValueError, match=r"^problem d has no samples$"):
        summarize_samples(["a", "d"], {**samples, "d": []})
