"""End to end on the real embedded model: `klear eval` on the 30 AIME 2024 problems, n = 2, CPU."""

from __future__ import annotations

import json

import pytest

from conftest import eval_argv, shared_file
from klear.cli import main


@pytest.mark.slow
def test_embedded_model_aime24_n2(tmp_path, embedded_path):
    aime = shared_file("math", "aime24.qs.jsonl")
    out = tmp_path / "aime24"
    args = eval_argv("embedded", aime, out, "--n 2 --max-tokens 48 --backend hf --no-progress --maj --cpu-threads 1")
    assert main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["n"] == 2 and s["n_problems"] == 30 and s["n_samples"] == 60
    assert set(s["pass_at_k"]) == {"1", "2"}
    assert s["sampling"] == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 48}
    assert s["rope"]["plan"]["source"] == "none" and s["rope"]["loaded"]["rope_type"] == "default"
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 60 and all(0 < r["n_tokens"] <= 48 for r in recs)
    # the verdicts, judged again here, and the metrics recomputed from them
    problems = {p["problem_id"]: p for p in map(json.loads, (out / "problems.jsonl").read_text().splitlines())}
    assert [r["correct"] for r in recs] == _judge(problems, recs)
    _assert_metrics(s, recs)
    assert s["truncation_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in recs) / 60)
    # a second invocation finds everything done and reproduces the summary
    assert main(args) == 0
    assert json.loads((out / "summary.json").read_text()) == s
    # and with some answers right (a 135M model rarely solves AIME in 48 tokens): the first problem's two responses
    # and the second's first one replaced by the ground truth, judged by `klear eval --judge-only`
    first, second = list(problems)[:2]
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "problems.jsonl").write_text((out / "problems.jsonl").read_text())
    edits = [r["problem_id"] == first or (r["problem_id"] == second and r["sample_index"] == 0) for r in recs]
    assert sum(edits) == 3
    for r, edit in zip(recs, edits, strict=True):
        if edit:
            r["response"] = f"The answer is $\\boxed{{{problems[r['problem_id']]['ground_truth']}}}$."
    (edited / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["eval", "--judge-only", str(edited / "samples.jsonl"), "--output", str(tmp_path / "rejudged")]) == 0
    rejudged = json.loads((tmp_path / "rejudged" / "summary.json").read_text())
    verdicts = _judge(problems, recs)
    assert all(ok for ok, edit in zip(verdicts, edits, strict=True) if edit)
    for r, ok in zip(recs, verdicts, strict=True):
        r["correct"] = ok
    _assert_metrics(rejudged, recs)


def _judge(problems: dict, recs: list[dict]) -> list[bool]:
    """Each record's verdict from the reward judge: correct when the reward is exactly 1.0."""
    from klear.rewards import compute_scores

    rewards = compute_scores(
        [problems[r["problem_id"]]["data_source"] for r in recs],
        [r["response"] for r in recs],
        [problems[r["problem_id"]]["ground_truth"] for r in recs],
    )
    return [float(x) == 1.0 for x in rewards]


def _assert_metrics(summary: dict, recs: list[dict]) -> None:
    """avg@2, pass@1 and pass@2 of ``summary`` against their definitions over the records' ``correct`` fields:
    avg@n = pass@1 = mean over problems of c/n; pass@2 with n = 2 = the share of problems with c >= 1."""
    counts: dict[str, list[bool]] = {}
    for r in recs:
        counts.setdefault(r["problem_id"], []).append(bool(r["correct"]))
    assert all(len(v) == 2 for v in counts.values())
    accuracy = sum(sum(v) / 2 for v in counts.values()) / len(counts)
    assert summary["avg_at_n"]["mean"] == pytest.approx(accuracy, abs=1e-12)
    assert summary["pass_at_k"]["1"] == pytest.approx(accuracy, abs=1e-12)
    assert summary["pass_at_k"]["2"] == pytest.approx(sum(any(v) for v in counts.values()) / len(counts), abs=1e-12)
