"""The `klear experiment` report's numbers on hand-written run directories (no training): non-zero, seed-dependent
held-out accuracies and metrics, each number of ``summary.json`` and ``report.md`` recomputed here independently
(numpy float64 and scipy, plus the hand-derived fractions of the paired test)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from scipy import stats

from conftest import math_rows, write_jsonl
from klear.experiment import load_experiment, run_experiment

SEEDS = [0, 1, 2]
PROMPT_IDS = ["p0", "p1", "p2", "p3", "p4", "p5"]
# per run: each problem's avg@4 correctness after training (eval_after.json "correct")
CORRECT = {
    "gppo": {
        0: [1.0, 0.25, 0.0, 0.5, 0.75, 0.0],
        1: [0.75, 0.5, 0.0, 0.25, 1.0, 0.25],
        2: [1.0, 0.0, 0.25, 0.5, 0.5, 0.0],
    },
    "clip": {
        0: [1.0, 0.75, 0.25, 0.5, 1.0, 0.0],
        1: [1.0, 0.5, 0.0, 0.75, 1.0, 0.5],
        2: [0.5, 0.25, 0.5, 1.0, 0.75, 0.0],
    },
}
# by hand: per-problem means over the seeds, clip minus gppo = [-1/12, 1/4, 1/6, 1/3, 1/6, 1/12]
HAND_DIFFS = [-1 / 12, 1 / 4, 1 / 6, 1 / 3, 1 / 6, 1 / 12]
HAND_MEAN_DIFF = 11 / 72
HAND_MCNEMAR_P = 2 * (1 + 6) / 2**6  # 5 improved, 1 worsened: 2 * P(X <= 1), X ~ Binomial(6, 1/2)
START = 5 / 24  # every run starts from the same model and held-out sampling seed
MID = {"gppo": {0: 0.25, 1: 0.375, 2: 0.2916666666666667}, "clip": {0: 0.375, 1: 0.5, 2: 0.4166666666666667}}
TRAIN_S = {"gppo": {0: 61.5, 1: 58.0, 2: 64.25}, "clip": {0: 70.0, 1: 66.5, 2: 73.75}}
# metrics.jsonl: grad_norm every step, reward on the first step of each 2-step rollout batch (steps 1 and 3)
GRAD_NORM = {
    "gppo": {0: [0.9, 0.7, 0.6, 0.4], 1: [1.1, 0.8, 0.5, 0.5], 2: [0.8, 0.6, 0.7, 0.3]},
    "clip": {0: [1.2, 0.9, 0.8, 0.6], 1: [1.0, 1.0, 0.7, 0.4], 2: [1.3, 0.7, 0.9, 0.5]},
}
REWARD = {
    "gppo": {0: [-0.5, 0.0], 1: [-0.25, 0.25], 2: [-0.75, -0.25]},
    "clip": {0: [-0.25, 0.5], 1: [0.0, 0.25], 2: [-0.5, 0.25]},
}


def _t_interval(values):
    """(mean, low, high): scipy's Student-t 95% interval from the standard error (float64)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    low, high = stats.t.interval(0.95, df=len(values) - 1, loc=mean, scale=stats.sem(values))
    return mean, float(low), float(high)


def _write_runs(tmp_path):
    """A finished 2-arm x 3-seed grid as `klear experiment` leaves it; returns the loaded experiment."""
    train = write_jsonl(tmp_path / "train.jsonl", math_rows(8))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", math_rows(6, start=100))
    (tmp_path / "model").mkdir()
    base = {
        "model": str(tmp_path / "model"),
        "output_dir": "unused",
        "seed": 0,
        "data": {"train": str(train), "heldout": str(heldout)},
        "eval": {"max_new_tokens": 4, "n_samples": 4, "temperature": 1.0, "every_steps": 2},
        "trainer": {"num_generations": 2, "per_device_train_batch_size": 2, "steps_per_generation": 2, "max_steps": 4},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "name": "hand",
        "base": "base.yaml",
        "reference": "gppo",
        "seeds": SEEDS,
        "arms": {"gppo": {}, "clip": {"trainer.loss_mode": "ppo_clip", "trainer.clip_ratio_c": None}},
        "output_dir": str(tmp_path / "exp"),
    }
    (tmp_path / "hand.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    for arm, by_seed in CORRECT.items():
        for seed, correct in by_seed.items():
            run = tmp_path / "exp" / arm / f"seed{seed}"
            run.mkdir(parents=True)
            accuracy = sum(correct) / len(correct)
            after = {"accuracy": accuracy, "n": len(correct), "correct": correct, "prompt_ids": PROMPT_IDS}
            (run / "eval_after.json").write_text(json.dumps({**after, "samples_per_problem": 4, "temperature": 1.0}))
            (run / "eval.json").write_text(json.dumps({"steps": 4}))  # a finished run: not trained again
            curve = [
                {"step": 0, "train_s": 0.0, "accuracy": START},
                {"step": 2, "train_s": TRAIN_S[arm][seed] / 2, "accuracy": MID[arm][seed]},
                {"step": 4, "train_s": TRAIN_S[arm][seed], "accuracy": accuracy},
            ]
            write_jsonl(run / "heldout_curve.jsonl", curve)
            rows = [{"step": s + 1, "grad_norm": g} for s, g in enumerate(GRAD_NORM[arm][seed])]
            rows[0]["reward"], rows[2]["reward"] = REWARD[arm][seed]
            write_jsonl(run / "metrics.jsonl", rows)
    return load_experiment(tmp_path / "hand.yaml")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(summary.json, report.md text) of `klear experiment` re-run on the finished hand-written grid."""
    tmp_path = tmp_path_factory.mktemp("report")
    exp = _write_runs(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("a finished run was trained again"))
        path = run_experiment(exp)
    return json.loads((tmp_path / "exp" / "summary.json").read_text()), path.read_text()


def test_final_and_start_accuracy_per_arm(report):
    summary, text = report
    for arm in ("gppo", "clip"):
        s = summary["arms"][arm]
        accs = [float(np.mean(CORRECT[arm][seed])) for seed in SEEDS]
        assert len(set(accs)) == 3 and min(accs) > 0  # seed-dependent, non-zero
        mean, low, high = _t_interval(accs)
        final = s["final_accuracy"]
        assert (final["n"], final["mean"], final["low"], final["high"]) == pytest.approx((3, mean, low, high))
        assert s["final_accuracy_per_seed"] == pytest.approx({str(k): a for k, a in zip(SEEDS, accs)})
        # the start is the held-out curve's step 0 (the same model for every run: a zero-width interval)
        start = s["start_accuracy"]
        assert (start["mean"], start["low"], start["high"]) == pytest.approx((START, START, START))
        assert abs(final["mean"] - start["mean"]) > 0.05
        row = next(line for line in text.splitlines() if line.startswith(f"| {arm} |"))
        assert f"| {START:.3f} [{START:.3f}, {START:.3f}] | {mean:.3f} [{low:.3f}, {high:.3f}] |" in row
        assert ", ".join(f"{a:.3f}" for a in accs) in row


def test_paired_difference_vs_reference_by_problem(report):
    summary, text = report
    ref = np.mean([CORRECT["gppo"][s] for s in SEEDS], axis=0, dtype=np.float64)
    arm = np.mean([CORRECT["clip"][s] for s in SEEDS], axis=0, dtype=np.float64)
    d = arm - ref
    assert d == pytest.approx(HAND_DIFFS)
    assert float(d.mean()) == pytest.approx(HAND_MEAN_DIFF)
    half = stats.norm.ppf(0.975) * np.std(d, ddof=1) / math.sqrt(len(d))
    p = stats.binomtest(int((d > 0).sum()), int((d != 0).sum()), 0.5).pvalue
    assert p == pytest.approx(HAND_MCNEMAR_P)
    paired = summary["arms"]["clip"]["paired_vs_reference"]
    assert paired["n"] == 6 and (paired["n_improved"], paired["n_worsened"]) == (5, 1)
    assert paired["before"] == pytest.approx(float(ref.mean())) and paired["after"] == pytest.approx(float(arm.mean()))
    assert paired["mean_diff"] == pytest.approx(HAND_MEAN_DIFF)
    assert (paired["ci_low"], paired["ci_high"]) == pytest.approx((HAND_MEAN_DIFF - half, HAND_MEAN_DIFF + half))
    assert paired["mcnemar_p"] == pytest.approx(HAND_MCNEMAR_P)
    assert "paired_vs_reference" not in summary["arms"]["gppo"]
    row = next(line for line in text.splitlines() if line.startswith("| clip |"))
    cells = f"| {HAND_MEAN_DIFF:+.3f} [{HAND_MEAN_DIFF - half:+.3f}, {HAND_MEAN_DIFF + half:+.3f}] | 5 / 1 | 0.22 |"
    assert cells in row
    assert "(reference)" in next(line for line in text.splitlines() if line.startswith("| gppo |"))


def test_the_seed_is_the_unit_of_the_comparison(report):
    """Per-seed final accuracies, clip minus gppo: 1/6, 1/6, 1/8 (by hand from CORRECT); every clip run beats every
    gppo run, so P(improve) is 1."""
    summary, text = report
    gppo = [float(np.mean(CORRECT["gppo"][s])) for s in SEEDS]
    clip = [float(np.mean(CORRECT["clip"][s])) for s in SEEDS]
    d = np.array(clip) - np.array(gppo)
    assert d == pytest.approx([1 / 6, 1 / 6, 1 / 8])
    low, high = stats.t.interval(0.95, df=2, loc=d.mean(), scale=stats.sem(d))
    c = summary["arms"]["clip"]["seeds_vs_reference"]
    assert (c["n"], c["mean_diff"]) == (3, pytest.approx(11 / 72))
    assert (c["ci_low"], c["ci_high"]) == pytest.approx((low, high))
    assert c["p"] == pytest.approx(stats.ttest_rel(clip, gppo).pvalue)
    assert c["sd_diff"] == pytest.approx(float(np.std(d, ddof=1)))
    assert c["p_improvement"] == 1.0 and c["p_improvement_high"] == 1.0
    assert "seeds_vs_reference" not in summary["arms"]["gppo"]
    row = next(line for line in text.splitlines() if line.startswith("| clip | final | 3 |"))
    assert f"| {11 / 72:+.3f} [{low:+.3f}, {high:+.3f}] |" in row


def test_the_area_under_the_heldout_curve_is_paired_by_seed(report):
    """Curve steps 0, 2, 4 with START, MID and the final accuracy: area / 4 = (START + 2 * MID + final) / 4."""
    summary, text = report
    areas = {}
    for arm in ("gppo", "clip"):
        curves = [[START, MID[arm][s], float(np.mean(CORRECT[arm][s]))] for s in SEEDS]
        areas[arm] = [float(np.trapezoid(c, [0, 2, 4])) / 4 for c in curves]
        hand = [(START + 2 * MID[arm][s] + float(np.mean(CORRECT[arm][s]))) / 4 for s in SEEDS]
        assert areas[arm] == pytest.approx(hand)
        assert summary["arms"][arm]["curve_area_per_seed"] == pytest.approx(dict(zip(map(str, SEEDS), areas[arm])))
    d = np.array(areas["clip"]) - np.array(areas["gppo"])
    low, high = stats.t.interval(0.95, df=2, loc=d.mean(), scale=stats.sem(d))
    c = summary["arms"]["clip"]["curve_area_seeds_vs_reference"]
    assert c["mean_diff"] == pytest.approx(float(d.mean())) and (c["ci_low"], c["ci_high"]) == pytest.approx(
        (low, high)
    )
    assert c["p"] == pytest.approx(stats.ttest_rel(areas["clip"], areas["gppo"]).pvalue)
    assert any(line.startswith("| clip | curve area | 3 |") for line in text.splitlines())


def test_no_curve_area_without_an_evaluation_between_start_and_end(tmp_path):
    """Runs evaluated only before and after training: the area of two points is (START + final) / 2, the final
    difference halved, so the report gives no curve-area endpoint and says why."""
    from klear.experiment.report import curve_area

    exp = _write_runs(tmp_path)
    for run in (tmp_path / "exp").glob("*/seed*"):
        curve = [json.loads(line) for line in (run / "heldout_curve.jsonl").read_text().splitlines()]
        assert curve_area(curve) is not None
        write_jsonl(run / "heldout_curve.jsonl", [curve[0], curve[-1]])
        assert curve_area([curve[0], curve[-1]]) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("a finished run was trained again"))
        text = run_experiment(exp).read_text()
    summary = json.loads((tmp_path / "exp" / "summary.json").read_text())
    assert "curve_area_seeds_vs_reference" not in summary["arms"]["clip"]
    assert "| clip | final | 3 |" in text and "| curve area |" not in text
    assert "Endpoint: final held-out accuracy (no curve area: no run was evaluated between its start" in text


def test_curve_training_time_and_metrics(report):
    summary, _ = report
    for arm in ("gppo", "clip"):
        s = summary["arms"][arm]
        by_step = {p["step"]: p for p in s["curve"]}
        assert sorted(by_step) == [0, 2, 4]
        mean, low, high = _t_interval([MID[arm][seed] for seed in SEEDS])
        mid = by_step[2]
        assert (mid["accuracy_mean"], mid["accuracy_low"], mid["accuracy_high"]) == pytest.approx((mean, low, high))
        assert mid["train_s"] == pytest.approx(np.mean([TRAIN_S[arm][seed] / 2 for seed in SEEDS]))
        assert s["train_s"]["mean"] == pytest.approx(np.mean(list(TRAIN_S[arm].values())))
        for name, table in (("grad_norm", GRAD_NORM), ("reward", REWARD)):
            mean, low, high = _t_interval([np.mean(table[arm][seed]) for seed in SEEDS])
            got = s["metrics"][name]
            assert (got["mean"], got["low"], got["high"]) == pytest.approx((mean, low, high)), name
    # metrics minus the reference's, paired by seed and step
    vs_ref = summary["arms"]["clip"]["metrics_vs_reference"]
    for name, table, steps in (("grad_norm", GRAD_NORM, 4), ("reward", REWARD, 2)):
        diffs = np.array([np.subtract(table["clip"][s], table["gppo"][s]) for s in SEEDS], dtype=np.float64)
        assert diffs.shape == (3, steps)
        mean, low, high = _t_interval(diffs.mean(axis=1))
        got = vs_ref[name]
        assert (got["mean"], got["low"], got["high"]) == pytest.approx((mean, low, high)), name
        assert (got["n_higher"], got["n_lower"]) == (int((diffs > 0).sum()), int((diffs < 0).sum())), name
