"""klear.experiment.report's statistics on hand-written run directories (issue 21, mutation testing of
`klear experiment`): per-seed Student-t intervals (scipy's t.interval), the paired per-problem test against the
reference arm (hand values), training metrics per run then across seeds, and metric differences paired by seed
and step. No training: every file of a run is written here.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from klear.experiment.report import METRICS, metric_series, paired_metric_difference, summarize
from klear.stats import mean_ci

T_975_DF1 = 12.706204736174707  # Student t quantile 0.975, 1 degree of freedom (tables)
T_975_DF2 = 4.302652729749464  # ... 2 degrees of freedom (tables)


def t_interval(values, confidence=0.95):
    """(mean, low, high) by scipy: t.interval around the mean with the standard error of the mean."""
    a = np.asarray(values, dtype=np.float64)
    low, high = stats.t.interval(confidence, len(a) - 1, loc=a.mean(), scale=stats.sem(a))
    return a.mean(), low, high


def assert_ci(got, values, confidence=0.95):
    mean, low, high = t_interval(values, confidence)
    assert got["n"] == len(values)
    assert got["mean"] == pytest.approx(mean, abs=1e-12)
    assert got["low"] == pytest.approx(low, abs=1e-12) and got["high"] == pytest.approx(high, abs=1e-12)


# ------------------------------------------------------------------ mean_ci


@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("values", [[0.2, 0.5], [0.1, 0.4, 0.35], [3.0, -1.0, 2.5, 0.0, 7.25]])
def test_mean_ci_is_the_student_t_interval(values, confidence):
    assert_ci(mean_ci(values, confidence), values, confidence)


def test_mean_ci_hand_values_and_few_seeds():
    # two seeds: mean +/- t(0.975, 1) * |a - b| / sqrt(2) / sqrt(2)
    r = mean_ci([0.25, 0.75])
    assert r["mean"] == 0.5 and r["high"] - 0.5 == pytest.approx(T_975_DF1 * 0.5 / 2)
    assert r["low"] == pytest.approx(0.5 - T_975_DF1 * 0.25)
    # three seeds 1, 2, 3: sd 1, half = t(0.975, 2) / sqrt(3); never clipped (not accuracies only)
    r = mean_ci([1.0, 2.0, 3.0])
    assert r == pytest.approx(
        {"n": 3, "mean": 2.0, "low": 2 - T_975_DF2 / math.sqrt(3), "high": 2 + T_975_DF2 / 3**0.5}
    )
    assert mean_ci([0.5, 0.5, 0.5]) == {"n": 3, "mean": 0.5, "low": 0.5, "high": 0.5}
    assert mean_ci([0.3]) == {"n": 1, "mean": 0.3, "low": None, "high": None}
    assert mean_ci([]) == {"n": 0, "mean": None, "low": None, "high": None}


# ------------------------------------------------------------------ metric_series


def test_metric_series_takes_the_first_name_present_and_skips_non_numbers():
    rows = [
        {"step": 1, "klear/clip_frac_high": 0.5, "clip_ratio/high_mean": 9.0},
        {"step": 2, "klear/clip_frac_high": 1, "clip_ratio/high_mean": 9.0},  # an int is a number
        {"step": 3, "klear/clip_frac_high": None},
        {"step": 4, "klear/clip_frac_high": True},  # a bool is not a metric value
        {"step": 5, "klear/clip_frac_high": "0.7"},
        {"klear/clip_frac_high": 0.9},  # no step
        {"step": 6.0, "klear/clip_frac_high": 0.25},
    ]
    keys = ("klear/clip_frac_high", "clip_ratio/high_mean")
    series = metric_series(rows, keys)
    assert series == {1: 0.5, 2: 1.0, 6: 0.25}
    assert all(type(k) is int and type(v) is float for k, v in series.items())
    trl = [{"step": 1, "clip_ratio/high_mean": 0.125}, {"step": 2, "clip_ratio/high_mean": 0.375}]
    assert metric_series(trl, keys) == {1: 0.125, 2: 0.375}  # TRL's name when klear's is absent
    assert metric_series(trl + [{"step": 3, "klear/clip_frac_high": None}], keys) == {1: 0.125, 2: 0.375}
    assert metric_series(trl, ("entropy",)) == {} and metric_series([], keys) == {}


# ------------------------------------------------------------------ paired_metric_difference


def test_paired_metric_difference_per_seed_means_over_common_steps():
    pairs = [
        ({1: 1.0, 2: 2.0, 3: 4.0}, {1: 0.5, 2: 2.0, 3: 1.0, 4: 100.0}),  # diffs 0.5, 0, 3 -> mean 7/6
        ({1: 0.0, 2: 1.0}, {1: 1.0, 2: 2.0}),  # diffs -1, -1 -> -1
        ({5: 3.0}, {1: 1.0}),  # no common step: left out
        ({2: 2.0, 4: 1.0}, {2: 1.5, 3: 0.0, 4: 1.5}),  # diffs 0.5, -0.5 -> 0
    ]
    r = paired_metric_difference(pairs)
    assert_ci(r, [7 / 6, -1.0, 0.0])
    assert (r["n_higher"], r["n_lower"]) == (3, 3)  # zero differences count as neither
    one = paired_metric_difference([({1: 2.0, 2: 3.0}, {1: 1.0, 2: 1.0})])
    assert one == {"n": 1, "mean": 1.5, "low": None, "high": None, "n_higher": 2, "n_lower": 0}
    none = paired_metric_difference([({1: 2.0}, {2: 1.0})])
    assert none == {"n": 0, "mean": None, "low": None, "high": None, "n_higher": 0, "n_lower": 0}


# ------------------------------------------------------------------ summarize on hand-written runs

PROBLEMS = ["p0", "p1", "p2", "p3"]
SEEDS = [0, 1, 2]
# per run: per-problem correctness (avg@n fractions allowed), the held-out curve (step, accuracy, train_s)
# and the metrics.jsonl rows. The reference arm is "ref"; "alt" logs TRL's metric names.
CORRECT = {
    "ref/seed0": [1, 0, 0, 1],
    "ref/seed1": [1, 1, 0, 0],
    "ref/seed2": [0, 0, 0.5, 1],
    "alt/seed0": [1, 1, 0, 1],
    "alt/seed1": [1, 1, 1, 0],
    "alt/seed2": [1, 0, 0.5, 1],
}
CURVE = {
    "ref/seed0": [(0, 0.25, 0.0), (2, 0.5, 30.0), (4, 0.5, 70.0)],
    "ref/seed1": [(4, 0.5, 90.0), (0, 0.0, 0.0), (2, 0.25, 40.0)],  # written out of step order
    "ref/seed2": [(0, 0.5, 0.0), (2, 0.25, 20.0), (3, 0.75, 35.0), (4, 0.375, 50.0)],  # step 3: this run only
    "alt/seed0": [(0, 0.25, 0.0), (2, 0.75, 60.0), (4, 0.75, 100.0)],
    "alt/seed1": [(0, 0.0, 0.0), (2, 0.5, 50.0), (4, 0.75, 120.0)],
    "alt/seed2": [(0, 0.5, 0.0), (2, 0.5, 25.0), (4, 0.625, 80.0)],
}
REWARD = {  # {step: reward}
    "ref/seed0": {1: 0.1, 2: 0.3, 3: 0.5},
    "ref/seed1": {1: 0.2, 2: 0.2, 3: 0.8},
    "ref/seed2": {1: 0.0, 2: 0.6, 3: 0.3},
    "alt/seed0": {1: 0.4, 2: 0.3, 3: 0.9},
    "alt/seed1": {1: 0.2, 2: 0.5},  # step 3 logs no reward
    "alt/seed2": {1: 0.0, 2: 0.7, 3: 0.8},
}
CLIP_HIGH = {  # ref as klear/clip_frac_high, alt as TRL's clip_ratio/high_mean; seed2 of alt logs none
    "ref/seed0": {1: 0.02, 2: 0.04},
    "ref/seed1": {1: 0.01, 2: 0.03},
    "ref/seed2": {1: 0.05, 2: 0.01},
    "alt/seed0": {1: 0.03, 2: 0.08},
    "alt/seed1": {1: 0.02, 2: 0.02},
    "alt/seed2": {},
}


def _accuracy(run):
    return sum(CORRECT[run]) / len(PROBLEMS)


def _write_runs(root, correct=CORRECT, problems=None):
    run_dirs = {}
    for run in correct:
        d = root / run
        d.mkdir(parents=True)
        ids = (problems or {}).get(run, PROBLEMS)
        (d / "eval_after.json").write_text(
            json.dumps({"prompt_ids": ids, "correct": correct[run], "accuracy": sum(correct[run]) / len(ids)})
        )
        (d / "heldout_curve.jsonl").write_text(
            "".join(json.dumps({"step": s, "accuracy": a, "train_s": t}) + "\n" for s, a, t in CURVE[run])
        )
        clip_key = "klear/clip_frac_high" if run.startswith("ref") else "clip_ratio/high_mean"
        rows = []
        for step in (1, 2, 3):
            row = {"step": step, "loss": 1.0}
            if step in REWARD[run]:
                row["reward"] = REWARD[run][step]
            if step in CLIP_HIGH[run]:
                row[clip_key] = CLIP_HIGH[run][step]
            rows.append(row)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        run_dirs[run] = d
    return run_dirs


EXP = SimpleNamespace(name="hand", arms={"ref": {}, "alt": {"trainer.loss_mode": "ppo_clip"}}, reference="ref")


@pytest.fixture()
def summary(tmp_path):
    return summarize(EXP, _write_runs(tmp_path), SEEDS)


def test_summary_head_and_final_accuracy_across_seeds(summary):
    assert {k: summary[k] for k in ("experiment", "reference", "seeds", "n_problems")} == {
        "experiment": "hand",
        "reference": "ref",
        "seeds": [0, 1, 2],
        "n_problems": 4,
    }
    for arm in ("ref", "alt"):
        stats_ = summary["arms"][arm]
        finals = [_accuracy(f"{arm}/seed{s}") for s in SEEDS]
        assert_ci(stats_["final_accuracy"], finals)
        assert stats_["final_accuracy_per_seed"] == {str(s): f for s, f in zip(SEEDS, finals)}
        assert stats_["overrides"] == EXP.arms[arm]
        # start accuracy: the curve's step 0 (the files are read in step order); training seconds: the last step's
        curves = [sorted(CURVE[f"{arm}/seed{s}"]) for s in SEEDS]
        assert_ci(stats_["start_accuracy"], [c[0][1] for c in curves])
        assert_ci(stats_["train_s"], [c[-1][2] for c in curves])
    assert summary["arms"]["ref"]["final_accuracy"]["mean"] == pytest.approx((0.5 + 0.5 + 0.375) / 3)
    assert summary["arms"]["ref"]["start_accuracy"]["mean"] == pytest.approx(0.25)
    assert summary["arms"]["ref"]["train_s"]["mean"] == pytest.approx(70.0)


def test_paired_test_against_the_reference_on_seed_averaged_problems(summary):
    ref = summary["arms"]["ref"]
    alt = summary["arms"]["alt"]
    assert "paired_vs_reference" not in ref and "metrics_vs_reference" not in ref
    # per problem, correctness averaged over the three seeds
    assert ref["per_problem"] == pytest.approx([2 / 3, 1 / 3, 1 / 6, 2 / 3])
    assert alt["per_problem"] == pytest.approx([1.0, 2 / 3, 1 / 2, 2 / 3])
    p = alt["paired_vs_reference"]
    d = np.array([1 / 3, 1 / 3, 1 / 3, 0.0])  # alt minus ref: three problems better, one the same
    half = 1.959963984540054 * d.std(ddof=1) / 2
    assert p["n"] == 4 and p["before"] == pytest.approx(11 / 24) and p["after"] == pytest.approx(17 / 24)
    assert p["mean_diff"] == pytest.approx(0.25) and p["ci_low"] == pytest.approx(0.25 - half)
    assert p["ci_high"] == pytest.approx(0.25 + half)
    assert (p["n_improved"], p["n_worsened"]) == (3, 0)
    assert p["mcnemar_p"] == pytest.approx(0.25)  # 2 * P(Binomial(3, 1/2) <= 0)


def test_heldout_curve_on_the_steps_every_run_evaluated(summary):
    for arm in ("ref", "alt"):
        curve = summary["arms"][arm]["curve"]
        assert [p["step"] for p in curve] == [0, 2, 4]  # step 3 of ref/seed2 alone is left out
        for point in curve:
            rows = [next(r for r in CURVE[f"{arm}/seed{s}"] if r[0] == point["step"]) for s in SEEDS]
            mean, low, high = t_interval([r[1] for r in rows])
            assert set(point) == {"step", "train_s", "accuracy_mean", "accuracy_low", "accuracy_high"}
            assert point["train_s"] == pytest.approx(sum(r[2] for r in rows) / 3)
            assert point["accuracy_mean"] == pytest.approx(mean, abs=1e-12)
            assert (point["accuracy_low"], point["accuracy_high"]) == pytest.approx((low, high), abs=1e-12)
    assert summary["arms"]["ref"]["curve"][1]["train_s"] == pytest.approx(30.0)


def test_training_metrics_per_run_then_across_seeds(summary):
    ref, alt = summary["arms"]["ref"], summary["arms"]["alt"]
    assert set(ref["metrics"]) == {name for name, _ in METRICS}
    assert_ci(ref["metrics"]["reward"], [0.3, 0.4, 0.3])  # each run's mean over its steps
    assert_ci(alt["metrics"]["reward"], [1.6 / 3, 0.35, 0.5])
    assert_ci(ref["metrics"]["clip_frac_high"], [0.03, 0.02, 0.03])
    assert_ci(alt["metrics"]["clip_frac_high"], [0.055, 0.02])  # TRL's name; seed2 logs none: left out
    assert ref["metrics"]["entropy"] == {"n": 0, "mean": None, "low": None, "high": None}
    # per step across seeds: only steps every run logs, and none when a run lacks the metric
    assert [p["step"] for p in ref["metric_curves"]["reward"]] == [1, 2, 3]
    assert [p["step"] for p in alt["metric_curves"]["reward"]] == [1, 2]
    for p in alt["metric_curves"]["reward"]:
        assert p["step"] in (1, 2)
        assert_ci(p, [REWARD[f"alt/seed{s}"][p["step"]] for s in SEEDS])
    assert alt["metric_curves"]["clip_frac_high"] == [] and ref["metric_curves"]["entropy"] == []


def test_metrics_minus_the_reference_paired_by_seed_and_step(summary):
    vs = summary["arms"]["alt"]["metrics_vs_reference"]
    assert set(vs) == {name for name, _ in METRICS}
    # reward: seed0 diffs .3, 0, .4; seed1 (steps 1, 2 only) 0, .3; seed2 0, .1, .5
    assert_ci(vs["reward"], [0.7 / 3, 0.15, 0.2])
    assert (vs["reward"]["n_higher"], vs["reward"]["n_lower"]) == (5, 0)
    # clip_frac_high: seed0 diffs .01, .04; seed1 .01, -.01; seed2 has no alt series: left out
    assert_ci(vs["clip_frac_high"], [0.025, 0.0])
    assert (vs["clip_frac_high"]["n_higher"], vs["clip_frac_high"]["n_lower"]) == (3, 1)
    assert vs["entropy"]["n"] == 0 and vs["entropy"]["mean"] is None


def test_runs_without_curve_or_metrics_files(tmp_path):
    correct = {"ref/seed0": [1, 0, 0, 0], "ref/seed1": [1, 1, 0, 0]}
    run_dirs = _write_runs(tmp_path, correct)
    for run in correct:
        (run_dirs[run] / "heldout_curve.jsonl").unlink()
    (run_dirs["ref/seed1"] / "metrics.jsonl").unlink()
    s = summarize(SimpleNamespace(name="x", arms={"ref": {}}, reference="ref"), run_dirs, [0, 1])["arms"]["ref"]
    assert s["curve"] == [] and s["start_accuracy"]["n"] == 0 and s["train_s"]["n"] == 0
    assert s["metrics"]["reward"] == {"n": 1, "mean": 0.3, "low": None, "high": None}
    assert s["metric_curves"]["reward"] == []
    assert_ci(s["final_accuracy"], [0.25, 0.5])


def test_a_run_without_eval_after_or_on_other_problems_is_refused(tmp_path):
    run_dirs = _write_runs(tmp_path / "a")
    (run_dirs["alt/seed1"] / "eval_after.json").unlink()
    with pytest.raises(ValueError, match=r"alt/seed1: no eval_after\.json \(the run has not finished, or ran without"):
        summarize(EXP, run_dirs, SEEDS)
    run_dirs = _write_runs(tmp_path / "b", problems={"alt/seed2": ["p0", "p1", "p3", "p2"]})
    msg = r"b/alt/seed2: evaluated on other held-out problems than .*b/ref/seed0; a paired comparison needs the same"
    with pytest.raises(ValueError, match=msg):
        summarize(EXP, run_dirs, SEEDS)
