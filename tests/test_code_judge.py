"""Code judge fidelity (issue 14): third-party packages a judge provides, and outputs accepted in
any letter case when a problem says so."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import shared_file
from klear.rewards.code_reward import (
    code_score_batch_detailed,
    leetcode_ground_truth,
    outputs_match,
    parse_ground_truth,
    run_tests,
    values_match,
)
from klear.rewards.sandbox import DEFAULT_ALLOWED_PACKAGES, Sandbox, SandboxConfig

CFG = SandboxConfig(time_limit_s=3.0, program_time_limit_s=30.0)
MODES = ["native"] + (["bwrap"] if shutil.which("bwrap") else [])


@pytest.fixture(scope="module", params=MODES)
def box(request):
    b = Sandbox(dataclasses.replace(CFG, isolation=request.param))
    yield b
    b.close()


def py(code: str) -> str:
    return f"```python\n{code}\n```"


# ---------------------------------------------------------------------------- packages
# LeetCode 480 "Sliding Window Median", solved the way LeetCode solutions usually are, with
# sortedcontainers (which LeetCode's Python judge provides). No reference solution in the shared
# rllm LeetCode data imports it, so this one is hand-written.
SLIDING_MEDIAN = """\
from sortedcontainers import SortedList


class Solution:
    def medianSlidingWindow(self, nums: List[int], k: int) -> List[float]:
        window = SortedList(nums[:k])
        out = [(window[k // 2] + window[(k - 1) // 2]) / 2]
        for i in range(k, len(nums)):
            window.remove(nums[i - k])
            window.add(nums[i])
            out.append((window[k // 2] + window[(k - 1) // 2]) / 2)
        return out
"""


def _median_windows(nums: list[int], k: int) -> list[float]:  # independent brute force
    out = []
    for i in range(len(nums) - k + 1):
        w = sorted(nums[i : i + k])
        out.append((w[k // 2] + w[(k - 1) // 2]) / 2)
    return out


def _sliding_median_test() -> str:
    cases = [([1, 3, -1, -3, 5, 3, 6, 7], 3), ([1, 2, 3, 4, 2, 3, 1, 4, 2], 3), ([5, 2, 2, 7, 3, 7, 9, 0, 2, 3], 4)]
    assert _median_windows(*cases[0]) == [1.0, -1.0, -1.0, 3.0, 5.0, 6.0]  # LeetCode's example 1
    asserts = "".join(f"    assert candidate(nums={n}, k={k}) == {_median_windows(n, k)}\n" for n, k in cases)
    return f"def check(candidate):\n{asserts}\n\ncheck(Solution().medianSlidingWindow)"


def test_default_packages_are_documented_and_installed():
    assert {"numpy", "sortedcontainers"} <= set(DEFAULT_ALLOWED_PACKAGES)
    assert SandboxConfig().allowed_packages == DEFAULT_ALLOWED_PACKAGES
    import numpy  # noqa: F401 - the judge's interpreter must have them
    import sortedcontainers  # noqa: F401


def test_leetcode_solution_using_sortedcontainers_scores_one():
    gt = leetcode_ground_truth(_sliding_median_test())
    res = code_score_batch_detailed([py(SLIDING_MEDIAN), py(SLIDING_MEDIAN.replace("/ 2", "// 2"))], [gt, gt])
    assert (res[0].reward, res[0].test_status) == (1.0, ["pass"]), res[0].detail
    assert res[1].reward == 0.0  # integer division: wrong medians (counter-check)
    # Without sortedcontainers in the allowed set the same solution cannot load (as on a judge without it).
    no_sc = code_score_batch_detailed(
        [py(SLIDING_MEDIAN)], [gt], sandbox_config=SandboxConfig(allowed_packages=("numpy",))
    )[0]
    assert no_sc.reward == 0.0 and "sortedcontainers" in no_sc.detail


NUMPY_PROG = "import sys\nimport numpy as np\nprint(int(np.array(sys.stdin.read().split(), dtype=np.int64).sum()))\n"
SC_PROG = "import sys\nfrom sortedcontainers import SortedList\nprint(*SortedList(map(int, sys.stdin.read().split())))"
OTHER_PROG = "import pebble\nprint(6)\n"  # installed here (a klear dependency), but no judge has it
FALLBACK_PROG = "try:\n    import pebble\nexcept ImportError as e:\n    print(type(e).__name__)\n"


def test_only_allowed_packages_import(box):
    stdio = lambda out: parse_ground_truth({"inputs": ["3 1 2\n"], "outputs": [out]})  # noqa: E731
    assert run_tests(NUMPY_PROG, stdio("6"), sandbox=box)[0] == ["pass"]
    assert run_tests(SC_PROG, stdio("1 2 3"), sandbox=box)[0] == ["pass"]
    assert run_tests("import heapq, fractions, decimal\nprint(6)\n", stdio("6"), sandbox=box)[0] == ["pass"]
    statuses, detail = run_tests(OTHER_PROG, stdio("6"), sandbox=box)
    assert statuses == ["runtime_error"] and "No module named 'pebble'" in detail
    # a missing package looks like any missing package: ImportError fallbacks work
    assert run_tests(FALLBACK_PROG, stdio("ModuleNotFoundError"), sandbox=box)[0] == ["pass"]


def test_allowed_packages_are_configurable():
    stdio = {"inputs": ["3 1 2\n"], "outputs": ["6"]}
    progs = [py(NUMPY_PROG), py(OTHER_PROG)]

    def rewards(pkgs):
        cfg = dataclasses.replace(CFG, allowed_packages=pkgs)
        return [r.reward for r in code_score_batch_detailed(progs, [stdio] * 2, sandbox_config=cfg)]

    assert rewards(()) == [0.0, 0.0]
    assert rewards(["pebble"]) == [0.0, 1.0]
    assert rewards(None) == [1.0, 1.0]
    assert SandboxConfig(allowed_packages=["numpy"]).allowed_packages == ("numpy",)  # hashable: one sandbox per config
    for bad in ("numpy", ["numpy-stubs"], [1]):
        with pytest.raises(ValueError, match="allowed_packages"):
            SandboxConfig(allowed_packages=bad)


# ------------------------------------------------------------------------ letter case
def test_case_insensitive_comparison_is_opt_in():
    assert not outputs_match("yes\nNo\n", "YES\nNO\n")
    assert outputs_match("yes\nNo\n", "YES\nNO\n", case_insensitive=True)
    assert outputs_match("yEs 3\n", "YES 3", case_insensitive=True)
    assert not outputs_match("yes\nyes\n", "YES\nNO\n", case_insensitive=True)  # still the right answers
    assert not outputs_match("YES 4", "YES 3", case_insensitive=True)
    assert values_match(["Yes", {"k": "NO"}], ["YES", {"k": "no"}], case_insensitive=True)
    assert not values_match(["Yes"], ["YES"])
    assert not values_match({"A": 1}, {"a": 1}, case_insensitive=True)  # keys are not answers
    assert parse_ground_truth({"inputs": ["1"], "outputs": ["YES"]}).case_insensitive is False
    assert parse_ground_truth({"inputs": ["1"], "outputs": ["YES"], "case_insensitive": True}).case_insensitive
    with pytest.raises(ValueError, match="case_insensitive"):
        parse_ground_truth({"inputs": ["1"], "outputs": ["YES"], "case_insensitive": "yes"})
    with pytest.raises(ValueError, match="case_insensitive"):
        parse_ground_truth({"format": "assert", "tests": ["assert f()"], "case_insensitive": True})


def _any_case_problems() -> list[dict]:
    """Real Codeforces problems (rllm / CodeElo) whose statement accepts YES/NO in any case and whose
    sample outputs are only YES/NO words."""
    rows = json.loads(shared_file("code", "rllm_codeforces_test_part1.json").read_text())
    out = []
    for r in rows:
        words = [w for t in r["tests"] for w in t["output"].split()]
        if "in any case" in r["problem"] and words and {w.upper() for w in words} <= {"YES", "NO"}:
            out.append(r)
    return out


def test_codeforces_any_case_answers():
    problems = _any_case_problems()
    assert len(problems) >= 3
    responses, gts, want = [], [], []
    for r in problems:
        t = r["tests"][0]
        lower = t["output"].lower()
        mixed = "\n".join({"yes": "yEs", "no": "nO"}[w.lower()] for w in t["output"].split())
        words = t["output"].split()
        wrong = "\n".join(["NO" if words[0].upper() == "YES" else "YES"] + words[1:])  # first answer flipped
        base = {"inputs": [t["input"]], "outputs": [t["output"]]}
        for printed, caseless, expected in [
            (lower, False, 0.0),
            (lower, True, 1.0),
            (mixed, True, 1.0),
            (t["output"], False, 1.0),
            (wrong.lower(), True, 0.0),
        ]:
            # the program prints a fixed answer for this sample (it never sees the expected output)
            responses.append(py(f"import sys\nsys.stdin.read()\nsys.stdout.write({printed!r})\n"))
            gts.append({**base, "case_insensitive": caseless} if caseless else base)
            want.append(expected)
    got = [r.reward for r in code_score_batch_detailed(responses, gts)]
    assert got == want
