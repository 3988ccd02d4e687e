import json
import re

import pytest

from klear.data.rl_data import (
    DEFAULT_FEW_SHOT,
    DEFAULT_INSTRUCTION,
    build_user_message,
    load_rl_dataset,
    load_rl_file,
    make_reasoning_gym_dataset,
    make_train_and_heldout,
)

ARITH = {
    "name": "basic_arithmetic",
    "config": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
}
# sums of two one-digit terms: a space of 121 distinct questions
ONE_DIGIT_SUMS = {**ARITH, "config": {**ARITH["config"], "max_digits": 1, "operators": ["+"]}}
LEGS = {"name": "leg_counting", "weight": 3, "config": {"min_animals": 1, "max_animals": 2}}
COLUMNS = {"prompt", "data_source", "reward_model", "extra_info", "prompt_id"}


# ------------------------------------------------------------------ reasoning gym


def test_reasoning_gym_columns_and_layout():
    ds = make_reasoning_gym_dataset([ARITH], size=12, seed=3)
    assert len(ds) == 12
    assert COLUMNS <= set(ds.column_names)
    row = ds[0]
    assert row["data_source"] == "math_reasoning_gym"
    assert row["reward_model"]["style"] == "rule"
    assert isinstance(row["reward_model"]["ground_truth"], str)
    # default: one demo turn pair, then the problem
    assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "user"]
    demo = DEFAULT_FEW_SHOT[0]
    assert row["prompt"][0]["content"] == build_user_message(demo["question"], DEFAULT_INSTRUCTION)
    assert row["prompt"][1]["content"] == demo["answer"]
    assert row["prompt"][-1]["content"] == build_user_message(row["extra_info"]["question"], DEFAULT_INSTRUCTION)
    assert "\\boxed{" in row["prompt"][-1]["content"]
    assert [r["index"] for r in list(ds["extra_info"])] == list(range(12))
    assert {r["split"] for r in list(ds["extra_info"])} == {"train"}
    assert {r["task"] for r in list(ds["extra_info"])} == {"basic_arithmetic"}
    json.dumps(list(ds["extra_info"]))  # JSON-able
    assert len(set(list(ds["prompt_id"]))) == 12
    # ground truth really is the answer of the question
    for r in ds:
        q = r["extra_info"]["question"]
        a, op, b = re.match(r"Calculate (\d+) ([+-]) (\d+)\.", q).groups()
        assert int(r["reward_model"]["ground_truth"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_reasoning_gym_weighted_mix_and_determinism():
    a = make_reasoning_gym_dataset([ARITH, LEGS], size=10, seed=7, instruction=None)
    b = make_reasoning_gym_dataset([ARITH, LEGS], size=10, seed=7, instruction=None)
    c = make_reasoning_gym_dataset([ARITH, LEGS], size=10, seed=8, instruction=None)
    assert a.to_list() == b.to_list()
    assert list(a["prompt"]) != list(c["prompt"])
    tasks = [r["task"] for r in list(a["extra_info"])]
    # weights 1 : 3 of 10 -> 2.5 / 7.5 -> largest remainder, tie to the first task: 3 / 7
    assert tasks.count("basic_arithmetic") == 3 and tasks.count("leg_counting") == 7
    assert a[0]["prompt"][-1]["content"] == a[0]["extra_info"]["question"].strip()  # no instruction
    assert len(set(r["question"] for r in list(a["extra_info"]))) == 10  # distinct


def test_system_prompt_and_few_shot_options():
    ds = make_reasoning_gym_dataset([ARITH], size=2, seed=0, system_prompt="Be exact.", few_shot=None)
    assert [m["role"] for m in ds[0]["prompt"]] == ["system", "user"]
    assert ds[0]["prompt"][0]["content"] == "Be exact."
    shots = [{"question": "Q1", "answer": "A1"}, {"question": "Q2", "answer": "A2"}]
    ds = make_reasoning_gym_dataset([ARITH], size=2, seed=0, few_shot=shots, instruction="Box it.")
    assert [m["content"] for m in ds[0]["prompt"][:4]] == ["Q1\n\nBox it.", "A1", "Q2\n\nBox it.", "A2"]
    with pytest.raises(ValueError, match="few_shot"):
        make_reasoning_gym_dataset([ARITH], size=2, seed=0, few_shot=[{"question": "Q"}])


def test_demo_question_never_generated():
    ds = make_reasoning_gym_dataset([ONE_DIGIT_SUMS], size=120, seed=0)  # 121 distinct questions exist
    questions = {r["question"] for r in ds["extra_info"]}
    assert len(questions) == 120 and DEFAULT_FEW_SHOT[0]["question"] not in questions


def test_exclusion_keeps_size_and_train_heldout_disjoint():
    train, held = make_train_and_heldout([ARITH], train_size=40, heldout_size=20, seed=0)
    assert len(train) == 40 and len(held) == 20
    tq = {r["question"] for r in list(train["extra_info"])}
    hq = {r["question"] for r in list(held["extra_info"])}
    assert not tq & hq
    assert {r["split"] for r in list(held["extra_info"])} == {"test"}
    assert not set(list(train["prompt_id"])) & set(list(held["prompt_id"]))
    # explicit exclusion
    ex = make_reasoning_gym_dataset([ARITH], size=20, seed=1, exclude_questions=tq)
    assert len(ex) == 20 and not {r["question"] for r in list(ex["extra_info"])} & tq


def test_tiny_problem_space_raises():
    with pytest.raises(ValueError, match="too small"):
        make_reasoning_gym_dataset([ONE_DIGIT_SUMS], size=130, seed=0)  # only 121 distinct questions exist


def test_a_depleted_problem_space_warns_that_the_distribution_changed(caplog):
    """121 one-digit sums: drawing 100 distinct ones skips many repeats, so the kept problems no longer follow the
    generator's distribution; a large space skips almost none and stays quiet."""
    with caplog.at_level("WARNING", logger="klear.data.rl_data"):
        make_reasoning_gym_dataset([ONE_DIGIT_SUMS], size=100, seed=0)
    (record,) = caplog.records
    skipped, drawn = (int(x) for x in re.search(r"(\d+) of (\d+) generated", record.getMessage()).groups())
    assert drawn - skipped == 100 and skipped > 0.1 * drawn and "'basic_arithmetic'" in record.getMessage()
    caplog.clear()
    three_digit = {**ARITH, "config": {**ARITH["config"], "min_digits": 3, "max_digits": 3}}
    with caplog.at_level("WARNING", logger="klear.data.rl_data"):
        make_reasoning_gym_dataset([three_digit], size=100, seed=0)
    assert not caplog.records


@pytest.mark.parametrize(
    "tasks, match",
    [
        ([], "tasks must be a non-empty list"),
        ([{"config": {}}], r"tasks\[0\]: 'name' must be a reasoning_gym dataset name, got None"),
        ([{"name": "basic_arithmetic", "weight": 0}], r"tasks\[0\] \(basic_arithmetic\): 'weight' must be a positive"),
        ([{"name": "no_such_task_xyz"}], "reasoning_gym task 'no_such_task_xyz' with config {} could not be created"),
    ],
)
def test_bad_tasks_raise(tasks, match):
    with pytest.raises(ValueError, match=match):
        make_reasoning_gym_dataset(tasks, size=3, seed=0)


# ------------------------------------------------------------------ verl files


def _rows():
    return [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "data_source": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": 10, "split": "train"},
        },
        {"prompt": "What is 3*3?", "data_source": "math", "reward_model": {"ground_truth": 9}},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "half?"}],
            "data_source": "math",
            "reward_model": {"ground_truth": ["1/2", 0.5]},
            "ability": "math",
        },
    ]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_round_trip(tmp_path):
    f = _write_jsonl(tmp_path / "train.jsonl", _rows())
    ds = load_rl_file(f)
    assert len(ds) == 3 and COLUMNS <= set(ds.column_names)
    assert list(ds["prompt_id"]) == ["10", "train.jsonl:1", "train.jsonl:2"]
    assert ds[1]["prompt"] == [{"role": "user", "content": "What is 3*3?"}]
    assert ds[1]["reward_model"] == {"style": "rule", "ground_truth": "9"}
    # a list ground truth: the first answer stays the ground truth, all of them are an explicit field
    assert ds[2]["reward_model"]["ground_truth"] == "1/2"
    assert ds[2]["extra_info"]["acceptable_answers"] == ["1/2", "0.5"]
    assert ds[0]["extra_info"]["acceptable_answers"] is None
    assert ds[2]["ability"] == "math" and ds[0]["ability"] is None  # extra column kept
    assert ds[1]["extra_info"]["index"] == 1 and ds[1]["extra_info"]["split"] == "train"
    assert ds[1]["extra_info"]["task"] == "math"
    assert load_rl_dataset(str(f)).to_list() == ds.to_list()


def _math_row(gt, i, **extra):
    return {
        "prompt": "q",
        "data_source": "math",
        "reward_model": {"ground_truth": gt},
        "extra_info": {"index": i, **extra},
    }


def test_several_answers_are_a_real_list_or_an_explicit_field(tmp_path):
    """Issue 20: a list ground truth used to be stored as its JSON text and the judge decoded every
    string starting with "[" (so the interval "[1, 2]" became the answers 1 and 2)."""
    from klear.rewards import compute_scores

    rows = [
        _math_row(["1/2", 0.5], 0),
        _math_row("[1, 2]", 1),  # an interval: one answer
        _math_row('["3", "three"]', 2),  # the JSON text of a list is one (unusable) answer, never a list
        _math_row("7", 3, acceptable_answers=["7.0", 7]),
        _math_row("[0.5, 1]", 4),
    ]
    ds = load_rl_file(_write_jsonl(tmp_path / "t.jsonl", rows))
    gts = [r["ground_truth"] for r in ds["reward_model"]]
    answers = [e["acceptable_answers"] for e in ds["extra_info"]]
    assert gts == ["1/2", "[1, 2]", '["3", "three"]', "7", "[0.5, 1]"]
    assert answers == [["1/2", "0.5"], None, None, ["7", "7.0"], None]
    # the reward, fed the loaded rows as the trainer feeds them
    cases = [(0, "0.5", 1.0), (1, "1", -1.0), (1, "[1, 2]", 1.0), (2, r"\text{three}", -1.0), (3, "7.0", 1.0)]
    cases += [(4, "0.5", -1.0), (4, "[0.5, 1]", 1.0)]
    got = compute_scores(
        [ds[i]["data_source"] for i, _, _ in cases],
        [rf"\boxed{{{a}}}" for _, a, _ in cases],
        [gts[i] for i, _, _ in cases],
        [ds[i]["extra_info"] for i, _, _ in cases],
    )
    assert got == [want for _, _, want in cases]
    # written to parquet and read back: unchanged
    f = tmp_path / "t.parquet"
    ds.to_parquet(str(f))
    assert load_rl_file(f).to_list() == ds.to_list()


@pytest.mark.parametrize("bad", [[], ["1", ""], "0.5", [None]])
def test_bad_acceptable_answers_name_the_field(tmp_path, bad):
    f = _write_jsonl(tmp_path / "t.jsonl", [_math_row("1", 0), _math_row("1", 1, acceptable_answers=bad)])
    with pytest.raises(ValueError, match=r"t\.jsonl: row 1: field 'extra_info\.acceptable_answers' is .*expected a"):
        load_rl_file(f)


def test_parquet_round_trip(tmp_path):
    ds = make_reasoning_gym_dataset([ARITH], size=6, seed=5)
    f = tmp_path / "rg.parquet"
    ds.to_parquet(str(f))
    back = load_rl_file(f)
    assert list(back["prompt"]) == list(ds["prompt"])
    assert list(back["reward_model"]) == list(ds["reward_model"])
    assert list(back["prompt_id"]) == list(ds["prompt_id"])  # own prompt_id column kept
    assert list(back["data_source"]) == list(ds["data_source"])
    assert list(back["extra_info"]) == list(ds["extra_info"])
    # without a prompt_id column the id is extra_info.index
    f2 = tmp_path / "noid.parquet"
    ds.remove_columns("prompt_id").to_parquet(str(f2))
    assert list(load_rl_file(f2)["prompt_id"]) == [str(i) for i in range(6)]


def test_default_data_source(tmp_path):
    f = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(ValueError, match=r"d\.jsonl: row 0: field 'data_source' is missing"):
        load_rl_file(f)
    assert list(load_rl_file(f, default_data_source="math")["data_source"]) == ["math"]


GOOD = {"prompt": "q", "data_source": "math", "reward_model": {"ground_truth": "1"}}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"prompt": "q", "data_source": "math", "reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
        ({"prompt": "q", "data_source": "math", "reward_model": {"ground_truth": ""}}, "reward_model.ground_truth"),
        ({"prompt": "q", "data_source": "math", "reward_model": {"ground_truth": True}}, "reward_model.ground_truth"),
        ({"prompt": "q", "data_source": "math"}, "reward_model"),
        ({"data_source": "math", "reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"prompt": [], "data_source": "math", "reward_model": {"ground_truth": "1"}}, "prompt"),
        (
            {"prompt": [{"role": "user"}], "data_source": "math", "reward_model": {"ground_truth": "1"}},
            r"prompt\[0\]\.content",
        ),
        (
            {"prompt": [{"role": "user", "content": 5}], "data_source": "math", "reward_model": {"ground_truth": "1"}},
            r"prompt\[0\]\.content",
        ),
        (
            {"prompt": [{"role": "bot", "content": "x"}], "data_source": "math", "reward_model": {"ground_truth": "1"}},
            r"prompt\[0\]\.role",
        ),
        ({"prompt": ["hi"], "data_source": "math", "reward_model": {"ground_truth": "1"}}, r"prompt\[0\]"),
        ({"prompt": "q", "data_source": 3, "reward_model": {"ground_truth": "1"}}, "data_source"),
        (
            {"prompt": "q", "data_source": "math", "reward_model": {"ground_truth": "1"}, "extra_info": [1]},
            "extra_info",
        ),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path, bad, field):
    f = _write_jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=rf"train\.jsonl: row 3: field '{field}'") as info:
        load_rl_file(f)
    assert "expected" in str(info.value)


def test_missing_ground_truth_exact_message(tmp_path):
    f = _write_jsonl(
        tmp_path / "train.jsonl", [GOOD, GOOD, GOOD, {"prompt": "q", "data_source": "m", "reward_model": {}}]
    )
    with pytest.raises(ValueError) as info:
        load_rl_file(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: row 3: field 'reward_model.ground_truth' is missing (expected a non-empty string")


def test_bad_row_in_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(GOOD), dict(GOOD, reward_model={"ground_truth": None})]
    f = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    with pytest.raises(ValueError, match=r"x\.parquet: row 1: field 'reward_model\.ground_truth' is missing"):
        load_rl_file(f)


def test_invalid_json_names_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"t\.jsonl: line 3 \(row 1\): invalid JSON"):
        load_rl_file(f)


def test_duplicate_prompt_ids_name_both_rows(tmp_path):
    rows = [dict(GOOD, extra_info={"index": 4}), GOOD, dict(GOOD, extra_info={"index": 4})]
    f = _write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=r"dup\.jsonl: rows 0 and 2 have the same prompt id '4' "
        r"\(field 'extra_info\.index'",
    ):
        load_rl_file(f)
    f = _write_jsonl(tmp_path / "dup2.jsonl", [dict(GOOD, prompt_id="a"), GOOD, dict(GOOD, prompt_id="a")])
    with pytest.raises(ValueError, match=r"dup2\.jsonl: rows 0 and 2 .* \(field 'prompt_id'"):
        load_rl_file(f)


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: no such file"):
        load_rl_file(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        load_rl_file(empty)
    other = tmp_path / "x.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_rl_file(other)
    with pytest.raises(ValueError, match="directory"):
        load_rl_dataset(tmp_path)
    with pytest.raises(ValueError, match=r"row 0: is list"):
        load_rl_file(_write_jsonl(tmp_path / "l.jsonl", [[1, 2]]))


def test_load_rl_dataset_task_list():
    ds = load_rl_dataset([ARITH], size=4, seed=0)
    assert len(ds) == 4
