"""klear's own procedural task ``sums_code`` (klear.data.procedural): a code problem with one sandbox test per sum,
its teacher solution, and the soft and hard code rewards on it (paper Sec. 3.2.4)."""

from __future__ import annotations

import json

import pytest

from klear.data.procedural import SUMS_CODE
from klear.data.rl_data import make_reasoning_gym_dataset, regenerate_entries
from klear.rewards import compute_scores
from klear.rewards.code_reward import parse_ground_truth
from klear.sft.teacher import teacher_response

TASKS = [{"name": SUMS_CODE, "config": {"n_sums": 3, "min_digits": 2, "max_digits": 2}}]
SOURCE = "code_longcot_bench"


def _rows(size=6, seed=0, tasks=TASKS):
    return make_reasoning_gym_dataset(
        tasks, size=size, seed=seed, data_source=SOURCE, instruction="", few_shot=None, system_prompt=None
    )


def test_entries_are_seeded_and_the_ground_truth_has_one_call_test_per_sum():
    rows = _rows()
    assert rows["prompt"] == _rows()["prompt"] and rows["prompt"] != _rows(seed=1)["prompt"]
    for row in rows:
        lines = row["prompt"][-1]["content"].split("\n")
        assert lines[0] == "Write a Python function f(i) that returns the i-th of these sums."
        sums = []
        for i, line in enumerate(lines[1:]):
            index, expression = line.split(": ")
            a, b = (int(x) for x in expression.split("+"))
            assert int(index) == i and 10 <= a <= 99 and 10 <= b <= 99
            sums.append(a + b)
        tests = parse_ground_truth(row["reward_model"]["ground_truth"])
        assert (tests.format, tests.fn_name, tests.total) == ("call", "f", 3)
        assert [list(x) for x in tests.inputs] == [[0], [1], [2]] and list(tests.outputs) == sums


def test_difficulty_settings_shape_the_problems_and_bad_ones_are_named():
    row = _rows(size=1, tasks=[{"name": SUMS_CODE, "config": {"n_sums": 5, "min_digits": 4, "max_digits": 4}}])[0]
    lines = row["prompt"][-1]["content"].split("\n")[1:]
    assert len(lines) == 5 and all(len(x) == 4 for line in lines for x in line.split(": ")[1].split("+"))
    with pytest.raises(ValueError, match="min_digits 3 > max_digits 2"):
        _rows(tasks=[{"name": SUMS_CODE, "config": {"min_digits": 3, "max_digits": 2}}])
    with pytest.raises(ValueError, match=r"n_sums must be an integer in \[1, 20\], got 0"):
        _rows(tasks=[{"name": SUMS_CODE, "config": {"n_sums": 0}}])


def _with_sums(response: str, sums: list[int]) -> str:
    head, _, _ = response.rpartition("return [")
    return f"{head}return [{', '.join(map(str, sums))}][i]\n```"


def test_teacher_program_passes_every_test_and_a_wrong_sum_fails_only_its_own():
    """Soft reward = passed / total, hard = +1 only when all pass (values by hand: 2 of 3 -> 2/3 and -1)."""
    rows = _rows(size=4)
    entries = regenerate_entries(TASKS, 0, rows["extra_info"])
    responses = [teacher_response(entry, dataset=gen) for entry, gen in entries]
    truth = [json.loads(r["reward_model"]["ground_truth"])["outputs"] for r in rows]
    assert responses[0].startswith("<think>\n") and "</think>\n```python\ndef f(i):\n    return [" in responses[0]
    one_wrong = _with_sums(responses[1], [truth[1][0], truth[1][1] + 1, truth[1][2]])
    two_wrong = _with_sums(responses[2], [truth[2][0] + 10, truth[2][1], truth[2][2] - 1])
    no_think = responses[3].split("</think>\n", 1)[1]  # the think block is required (data source *longcot*)
    batch = [responses[0], one_wrong, two_wrong, no_think]
    gts = [r["reward_model"]["ground_truth"] for r in rows]
    soft = compute_scores([SOURCE] * 4, batch, gts, reward_mode="soft")
    hard = compute_scores([SOURCE] * 4, batch, gts, reward_mode="hard")
    assert soft == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])
    assert hard == [1.0, -1.0, -1.0, -1.0]


def _tampered(change):
    import copy

    entry, _ = regenerate_entries(TASKS, 0, _rows(size=1)["extra_info"])[0]
    entry = copy.deepcopy(entry)
    change(entry)
    return entry


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            lambda e: e["metadata"].update(sums=[s + 1 for s in e["metadata"]["sums"]]),
            "mismatch",
            "metadata\\['sums'\\]",
        ),
        (lambda e: e["metadata"].pop("expressions"), "error", "must be a non-empty list of 'a\\+b' strings, got None"),
        (lambda e: e["metadata"].update(expressions="47+85"), "error", "non-empty list"),
        (lambda e: e["metadata"].update(expressions=[]), "error", "non-empty list"),
        (lambda e: e.update(question=e["question"].rsplit("\n", 1)[0]), "mismatch", "question's lines"),
        (lambda e: e.update(answer="hello"), "mismatch", "is not the ground truth of the sums"),
        (lambda e: e.update(answer=e["answer"].replace('"f"', '"g"')), "mismatch", "is not the ground truth"),
        (lambda e: e.pop("answer"), "mismatch", "answer None is not the ground truth"),
    ],
)
def test_teacher_refuses_an_entry_whose_parts_disagree(change, error, message):
    """Question, metadata and ground truth must describe the same sums, or no SFT example is written."""
    from klear.sft.teacher import TeacherError, TeacherMismatch

    with pytest.raises(TeacherMismatch if error == "mismatch" else TeacherError, match=message):
        teacher_response(_tampered(change))
    with pytest.raises(TeacherError, match="expected a reasoning-gym entry"):
        teacher_response("47+85")


def test_regenerating_a_row_without_its_reasoning_gym_keys_names_the_row():
    info = dict(_rows(size=2)["extra_info"][1])
    good = _rows(size=2)["extra_info"][0]
    del info["rg_index"]
    with pytest.raises(ValueError, match=r"^row 1: extra_info .* has no integer 'rg_seed' and 'rg_index'"):
        regenerate_entries(TASKS, 0, [good, info])
    with pytest.raises(ValueError, match="row 0: extra_info None has no integer"):
        regenerate_entries(TASKS, 0, [None])
    for index in (True, -1):
        with pytest.raises(ValueError, match="row 0: .* has no integer 'rg_seed' and 'rg_index' >= 0"):
            regenerate_entries(TASKS, 0, [dict(good, rg_index=index)])
    with pytest.raises(ValueError, match="row 0: .*is not from these tasks and seed"):
        regenerate_entries(TASKS, 1, [good])
    with pytest.raises(ValueError, match="its question is not the problem rg_seed/rg_index give"):
        regenerate_entries(TASKS, 0, [dict(good, question="What is 1+1?")])
