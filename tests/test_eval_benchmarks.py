"""klear.eval.benchmarks: real file shapes, LiveCodeBench conversion and windows, errors naming file:line."""

from __future__ import annotations

import base64
import gzip
import json
import pickle
import zlib

import pytest

from conftest import assert_error_names_file_and_line, shared_file
from klear.eval.benchmarks import (
    DEFAULT_MATH_TEMPLATE,
    decode_lcb_tests,
    get_field,
    gold_answer,
    load_benchmark,
    parse_release_window,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ real files
def test_aime24_file_shape():
    b = load_benchmark(str(shared_file("math", "aime24.qs.jsonl")))
    assert len(b.problems) == 30 and b.name == "aime24.qs"
    p = b.problems[0]
    assert p.problem_id == "2024-II-1" and p.ground_truth == "73" and p.kind == "math"
    assert p.data_source == "math_eval"
    assert p.messages[-1]["content"].endswith("put your final answer within \\boxed{}.")
    assert len({q.problem_id for q in b.problems}) == 30


def test_aime25_answer_lives_in_meta_solution():
    b = load_benchmark(str(shared_file("math", "aime25.qs.jsonl")), prompt_template=None)
    assert len(b.problems) == 30
    assert b.problems[0].ground_truth == "70" and b.problems[0].problem_id == "0"
    assert "boxed" not in b.problems[0].messages[-1]["content"]  # verbatim


def test_gsm8k_hash_answers():
    b = load_benchmark(str(shared_file("math", "gsm8k_test_500.jsonl")), limit=5)
    assert [p.ground_truth for p in b.problems][:2] == ["18", "3"]
    assert b.problems[0].problem_id == "line1"
    assert gold_answer("x", "so 1,000 in total\n#### 1,000") == "1000"
    assert gold_answer("x", "thus $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert gold_answer("x", 7.0) == "7" and gold_answer("x", ["1/2", 0.5]) == ["1/2", "0.5"]
    with pytest.raises(ValueError, match="empty"):
        gold_answer("f:3", "  ")


def test_verl_rows_keep_their_data_source():
    b = load_benchmark(str(shared_file("math", "aime960_math_verify.json")), limit=3)
    assert b.problems[0].data_source == "math_longcot_math_verify"
    assert b.problems[0].ground_truth == "540"


def test_code_rows_get_case_insensitive_from_their_statement(tmp_path):
    """Issue 20: a statement accepting any output case sets the flag in klear eval as in klear rl."""
    tests = {"format": "stdio", "inputs": ["1\n"], "outputs": ["YES\n"]}
    statements = [
        "Print YES or NO. You can output the answer in any case (upper or lower).",
        "Print YES if the array is sorted and NO otherwise.",
        "Print YES or NO. You can output the answer in any case.",
    ]
    answers = [json.dumps(tests), tests, {**tests, "case_insensitive": False}]  # explicit flag: kept
    rows = [
        {"prompt": [{"role": "user", "content": st}], "data_source": "code_cf", "reward_model": {"ground_truth": gt}}
        for st, gt in zip(statements, answers)
    ]
    b = load_benchmark(str(_write_jsonl(tmp_path / "cf.jsonl", rows)))
    assert [p.kind for p in b.problems] == ["code"] * 3
    assert [p.ground_truth.get("case_insensitive") for p in b.problems] == [True, None, False]
    assert b.problems[0].ground_truth == {**tests, "case_insensitive": True}
    bad = [{**rows[0], "reward_model": {"ground_truth": {"format": "stdio", "inputs": ["1"]}}}]
    with pytest.raises(ValueError, match=r"cf2\.jsonl: row 0: field 'reward_model\.ground_truth': "):
        load_benchmark(str(_write_jsonl(tmp_path / "cf2.jsonl", bad)))


def test_humaneval_from_package_and_file():
    b = load_benchmark("humaneval")
    assert len(b.problems) == 164
    p = b.problems[0]
    assert p.problem_id == "HumanEval/0" and p.kind == "code" and p.data_source == "code_humaneval"
    assert p.ground_truth["format"] == "assert" and p.ground_truth["entry_point"] == "has_close_elements"
    assert p.ground_truth["prefix"].startswith("from typing import List\n")
    assert "def check(candidate)" in p.ground_truth["test"]
    f = load_benchmark(str(shared_file("code", "HumanEval.jsonl.gz")), limit=2)
    assert f.problems[0].ground_truth == p.ground_truth


def test_prompts_only_livecodebench_file_is_refused():
    with pytest.raises(ValueError, match="prompts-only"):
        load_benchmark(str(shared_file("code", "qwq_livecodebench_v5_prompts.jsonl")))


# ------------------------------------------------------------------------------ synthetic
def test_custom_fields_dotted_paths_and_template(tmp_path):
    f = _write_jsonl(
        tmp_path / "hmmt.jsonl",
        [
            {"q": {"text": "What is 1+1?"}, "gold": {"value": 2}, "key": "p1"},
            {"q": {"text": "What is 2+2? Put it in \\boxed{}."}, "gold": {"value": "4"}, "key": "p2"},
        ],
    )
    b = load_benchmark(
        str(f),
        prompt_field="q.text",
        answer_field="gold.value",
        id_field="key",
        prompt_template="Q: {problem}\nA (boxed):",
    )
    assert [p.problem_id for p in b.problems] == ["p1", "p2"]
    assert b.problems[0].messages == [{"role": "user", "content": "Q: What is 1+1?\nA (boxed):"}]
    assert b.problems[1].messages[0]["content"] == "What is 2+2? Put it in \\boxed{}."  # already asks for a box
    assert b.problems[0].ground_truth == "2"
    assert get_field({"m": [{"c": 1}, {"c": 2}]}, "m.-1.c") == 2
    with pytest.raises(ValueError, match=r"\{problem\}"):
        load_benchmark(str(f), prompt_field="q.text", answer_field="gold.value", prompt_template="no slot")


def test_default_template_is_the_r1_wording():
    assert DEFAULT_MATH_TEMPLATE == (
        "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    )


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"problem": "x", "answer": "1"}\n{"problem": "y", "answer": \n', ": line 2 (row 1): invalid JSON"),
        ('{"problem": "x", "answer": "1"}\n\n[1, 2]\n', ": row 1: is list [1, 2] (expected a JSON object)"),
        ('{"problem": "x", "answer": "1"}\n{"problem": "y"}\n', ": row 1: no answer"),
        ('{"problem": "x", "answer": "1"}\n{"answer": "2"}\n', ": row 1: no prompt"),
        ('{"messages": [{"role": "user"}], "answer": "1"}\n', ": row 0: field 'messages[0].content' is NoneType"),
        # the one message rule (klear.data.text.check_messages) that klear rl and klear sft rows follow
        (
            '{"messages": [{"role": "bot", "content": "x"}], "answer": "1"}\n',
            ": row 0: field 'messages[0].role' is 'bot'",
        ),
        (
            '{"messages": [{"role": "system", "content": "x"}], "answer": "1"}\n',
            ": row 0: field 'messages' has no message with role 'user'",
        ),
        (
            '{"id": 1, "problem": "x", "answer": "1"}\n{"id": 1, "problem": "y", "answer": "2"}\n',
            ": row 1: duplicate problem id",
        ),
    ],
)
def test_malformed_benchmark_lines_name_file_and_line(tmp_path, content, needle):
    assert_error_names_file_and_line(lambda f: load_benchmark(str(f)), tmp_path / "bad.jsonl", content, needle)


def test_gzip_and_json_array_files(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}]
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert [p.ground_truth for p in load_benchmark(str(gz)).problems] == ["1", "2"]
    arr = tmp_path / "y.json"
    arr.write_text(json.dumps(rows + [{"problem": "c"}]))
    with pytest.raises(ValueError, match=r"y\.json: row 2: no answer"):
        load_benchmark(str(arr))
    assert [p.problem_id for p in load_benchmark(str(arr), limit=2).problems] == ["item0", "item1"]


def test_names_that_need_a_file():
    for name in ("aime24", "aime25", "hmmt25", "livecodebench", "gsm8k"):
        with pytest.raises(FileNotFoundError, match="nothing can be downloaded"):
            load_benchmark(name)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_benchmark("/nonexistent/bench.jsonl")


# ------------------------------------------------------------------------------ LiveCodeBench
def _compress(tests):
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_rows():
    stdin_public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    stdin_private = [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]
    call_tests = [
        {"input": "[1, 2, 3]\n2", "output": "5", "testtype": "functional"},
        {"input": "[]\n0", "output": "0", "testtype": "functional"},
    ]
    return [
        {
            "question_id": "abc001_a",
            "question_content": "Add two numbers.",
            "platform": "atcoder",
            "contest_date": "2024-09-01T00:00:00",
            "starter_code": "",
            "difficulty": "easy",
            "public_test_cases": json.dumps(stdin_public),
            "private_test_cases": _compress(stdin_private),
            "metadata": "{}",
        },
        {
            "question_id": "lc_42",
            "question_content": "Sum the two largest.",
            "platform": "leetcode",
            "contest_date": "2025-03-15T00:00:00",
            "difficulty": "medium",
            "starter_code": "class Solution:\n    def maxSum(self, nums: List[int], k: int) -> int:\n        ",
            "public_test_cases": json.dumps(call_tests),
            "private_test_cases": "",
            "metadata": json.dumps({"func_name": "maxSum"}),
        },
        {
            "question_id": "old_1",
            "question_content": "Old.",
            "contest_date": "2023-05-01T00:00:00",
            "starter_code": "",
            "public_test_cases": json.dumps(stdin_public),
            "private_test_cases": "[]",
            "metadata": "{}",
        },
    ]


def test_livecodebench_conversion(tmp_path):
    f = _write_jsonl(tmp_path / "lcb.jsonl", lcb_rows())
    b = load_benchmark(str(f))
    assert [p.problem_id for p in b.problems] == ["abc001_a", "lc_42", "old_1"]
    a, c = b.problems[0], b.problems[1]
    assert a.kind == "code" and a.data_source == "code_livecodebench"
    assert a.ground_truth == {"format": "stdio", "inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    assert c.ground_truth == {
        "format": "call",
        "fn_name": "maxSum",
        "inputs": [[[1, 2, 3], 2], [[], 0]],
        "outputs": [5, 0],
    }
    assert "Read the inputs from stdin" in a.messages[0]["content"]
    assert "class Solution:\n    def maxSum" in c.messages[0]["content"]
    assert c.metadata["platform"] == "leetcode"


def test_release_windows(tmp_path):
    f = _write_jsonl(tmp_path / "lcb.jsonl", lcb_rows())
    assert [p.problem_id for p in load_benchmark(str(f), release_window="v5").problems] == ["abc001_a"]
    assert [p.problem_id for p in load_benchmark(str(f), release_window="v6").problems] == ["lc_42"]
    assert len(load_benchmark(str(f), release_window="2023-01-01..2026-01-01").problems) == 3
    assert parse_release_window("v5")[0].isoformat() == "2024-08-01"
    assert parse_release_window("v6")[1].isoformat() == "2025-05-01"
    with pytest.raises(ValueError, match="no problems in release window"):
        load_benchmark(str(f), release_window="2020-01-01..2020-02-01")
    with pytest.raises(ValueError, match=r"release window \'v7\': expected v5, v6 or START\.\.END"):
        parse_release_window("v7")
    m = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "x", "answer": "1"}])
    with pytest.raises(ValueError, match="LiveCodeBench"):
        load_benchmark(str(m), release_window="v5")


def test_livecodebench_errors_name_the_line(tmp_path):
    rows = lcb_rows()
    rows[1]["metadata"] = "{}"  # functional without func_name
    f = _write_jsonl(tmp_path / "lcb.jsonl", rows)
    with pytest.raises(ValueError, match=r"lcb\.jsonl: row 1: functional tests need metadata\.func_name"):
        load_benchmark(str(f))
    rows = lcb_rows()
    rows[2]["public_test_cases"] = "[]"
    f = _write_jsonl(tmp_path / "lcb2.jsonl", rows)
    with pytest.raises(ValueError, match=r"lcb2\.jsonl: row 2: problem has no test cases"):
        load_benchmark(str(f))


def test_lcb_pickle_loader_admits_only_strings():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    blob = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(ValueError, match="refusing"):
        decode_lcb_tests(blob)
    assert decode_lcb_tests(_compress([{"input": "1", "output": "1", "testtype": "stdin"}]))[0]["input"] == "1"
