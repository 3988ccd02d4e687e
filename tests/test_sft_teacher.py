"""The procedural teacher: every claimed equality is true, the answers match reasoning-gym's."""

from __future__ import annotations

import re

import pytest

from klear.sft.teacher import (
    TeacherError,
    TeacherMismatch,
    solve_expression,
    teacher_response,
    tokenize_expression,
)

DEMO_TASKS = {
    "basic_arithmetic": dict(
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=2,
        operators=["+", "-"],
        allow_parentheses=False,
        allow_negation=False,
    ),
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
    "products": dict(min_digits=1, max_digits=2),
}

_ARITH = re.compile(r"^[0-9()+\-*]+$")


def _checked_equalities(thinking: str) -> int:
    """Evaluate every 'A=B(=C...)' clause made only of integers, + - * and parentheses.

    Clauses are the pieces of a line split at ': ' and ', '. Returns how many were checked and
    fails the test on the first false one.
    """
    checked = 0
    for line in thinking.splitlines():
        for clause in re.split(r": |, ", line.rstrip(".")):
            clause = re.sub(r"^(?:So |so )", "", clause)
            sides = clause.split("=")
            if len(sides) < 2 or not all(_ARITH.match(s) for s in sides):
                continue
            values = [eval(s, {"__builtins__": {}}) for s in sides]  # digits/operators only
            assert len(set(values)) == 1, f"false claim {clause!r} in line {line!r}"
            checked += 1
    return checked


def test_worked_solution_layout_and_column_steps():
    sol = solve_expression("47 + 85")
    assert sol.answer == 132
    assert sol.thinking.splitlines() == [
        "47+85",
        "ones: 7+5=12, write 2 carry 1",
        "tens: 4+8+1=13, write 13",
        "So 47+85=132.",
    ]
    assert sol.response() == "<think>\n" + sol.thinking + "\n</think>\nThe answer is \\boxed{132}."
    borrow = solve_expression("105 - 98").thinking
    assert "ones: 5-8, borrow 1: 15-8=7, write 7" in borrow
    assert "tens: 0-9-1, borrow 1: 10-9-1=0, write 0" in borrow


@pytest.mark.parametrize(
    "expr",
    [
        "0 + 0",
        "9 * 9",
        "13 - 92",
        "98 * 93",
        "23 * 60",
        "5 * 12",
        "1000 - 1",
        "5 - 9 + 3",
        "-4 - -3",
        "3 * -4 + 2",
        "99 + 99 + 99 - 300",
        "7 * 8 * 9",
        "-12 * -12",
        "12345 * 678",
        "0 - 0 - 5",
    ],
)
def test_solve_expression_is_exact_and_every_step_true(expr):
    sol = solve_expression(expr)
    assert sol.answer == eval(expr.replace("--", "- -"), {"__builtins__": {}})
    assert _checked_equalities(sol.thinking) >= 1
    assert sol.thinking.endswith(f"={sol.answer}.")


@pytest.mark.parametrize("task", sorted(DEMO_TASKS))
def test_teacher_matches_reasoning_gym_on_demo_tasks(task):
    import reasoning_gym

    ds = reasoning_gym.create_dataset(task, size=150, seed=11, **DEMO_TASKS[task])
    for entry in ds:
        text = teacher_response(entry, dataset=ds)
        think, _, final = text.partition("</think>")
        assert think.startswith("<think>\n") and final.startswith("\nThe answer is \\boxed{")
        boxed = final[final.index("{") + 1 : final.rindex("}")]
        assert boxed == entry["answer"]
        assert ds.score_answer(boxed, entry) == 1.0
        # each line is a true arithmetic statement where it states one
        _checked_equalities(think)


def test_tokenize_and_unsupported_expressions():
    assert tokenize_expression("98 + 93 - 77") == [98, "+", 93, "-", 77]
    assert tokenize_expression("3 * -4") == [3, "*", -4]
    for bad, message in [
        ("6 / 3", "expression '6 / 3': '/' is not supported"),
        ("(1 + 2) * 3", r"expression '\(1 \+ 2\) \* 3': '\(' is not supported"),
        ("2 ^ 3", r"unsupported character '\^' in expression '2 \^ 3'"),
        ("1 +", r"expression '1 \+' ends with an operator"),
        ("", "expected a non-empty expression string, got ''"),
        ("1 2", "expression '1 2': two numbers in a row"),
    ]:
        with pytest.raises(TeacherError, match=message):
            solve_expression(bad)


def test_teacher_refuses_a_wrong_gold_and_entries_without_expression():
    with pytest.raises(TeacherMismatch, match=r"teacher answer 4 != reasoning-gym answer \'5\' for \'2 \+ 2\'"):
        teacher_response({"question": "Calculate 2 + 2.", "answer": "5", "metadata": {"expression": "2 + 2"}})
    with pytest.raises(TeacherError, match="expression"):
        teacher_response({"question": "What is the capital of France?", "answer": "Paris", "metadata": {}})


# --------------------------------------------------------------------------- a flawed teacher (slips)

_COLUMN = re.compile(
    r"^(?:ones|tens|hundreds|thousands|ten-thousands): ([0-9+*]+)=(\d+), write (\d+)(?: carry (\d+))?$"
)


def _column_lines(thinking: str) -> list[tuple[int, int, int, int]]:
    """``(true value of the fact, value stated, digit written, carry written)`` of each column line."""
    out = []
    for line in thinking.splitlines():
        if m := _COLUMN.match(line):
            stated = int(m.group(2))
            out.append((eval(m.group(1), {"__builtins__": {}}), stated, int(m.group(3)), int(m.group(4) or 0)))
    return out


def test_slip_rate_zero_is_the_exact_teacher_and_bad_settings_fail():
    import random

    for expr in ("47+85", "98*93", "5-9+3"):
        assert solve_expression(expr, slip_rate=0.0, rng=random.Random(1)) == solve_expression(expr)
    with pytest.raises(TeacherError, match=r"slip_rate must be a number in \[0, 1\), got 1"):
        solve_expression("1+2", slip_rate=1, rng=random.Random(0))
    with pytest.raises(TeacherError, match="slip_rate=0.1 needs rng"):
        solve_expression("1+2", slip_rate=0.1)
    entry = {"question": "2+2?", "answer": "4", "metadata": {"expression": "2+2"}}
    with pytest.raises(TeacherError, match="slip_rate must be"):
        teacher_response(entry, slip_rate=-0.1, rng=random.Random(0))
    with pytest.raises(TeacherError, match="metadata must be a dict, got 'abc'"):
        teacher_response(dict(entry, metadata="abc"))


def test_slipped_additions_are_wrong_exactly_when_slipped_and_consistent_after_the_slip():
    """Each slip is one false column fact, off by one; every later column is computed from what was written (its
    carry), so the answer is the written digits, and an addition is wrong exactly when it has a slip."""
    import random

    rng = random.Random(7)
    pairs = random.Random(3)
    seen_slipped = 0
    for _ in range(400):
        a, b = pairs.randrange(100, 1000), pairs.randrange(100, 1000)
        sol = solve_expression(f"{a}+{b}", slip_rate=0.3, rng=rng)
        cols = _column_lines(sol.thinking)
        assert len(cols) == 3
        false_facts = [(true, stated) for true, stated, _, _ in cols if true != stated]
        assert len(false_facts) == sol.slips and all(abs(t - s) == 1 for t, s in false_facts)
        # the stated column sums chain: the next column's fact includes the carry written before it
        carry = 0
        digits = []
        for k, (true, stated, written, carried) in enumerate(cols):
            ad, bd = (a // 10**k) % 10, (b // 10**k) % 10
            assert true == ad + bd + carry
            if k < 2:
                assert (written, carried) == (stated % 10, stated // 10)
                digits.append(str(written))
            else:
                assert written == stated
                digits.append(str(stated))
            carry = carried
        assert sol.answer == int("".join(reversed(digits)))
        assert (sol.answer != a + b) == (sol.slips > 0)
        assert sol.response().endswith(f"\\boxed{{{sol.answer}}}.")
        seen_slipped += sol.slips > 0
    assert seen_slipped > 0


def test_share_of_flawed_solutions_is_one_minus_the_chance_of_no_slip_in_any_column():
    """A solution with c column facts is flawed with probability 1-(1-p)^c: 3-digit sums 0.386, 2-digit 0.278 at
    p = 0.15 (4,000 draws each: standard error < 0.008, tolerance 0.03)."""
    import random

    rng = random.Random(11)
    pairs = random.Random(5)
    for digits, expected in ((3, 1 - 0.85**3), (2, 1 - 0.85**2)):
        lo, hi = 10 ** (digits - 1), 10**digits
        wrong = 0
        for _ in range(4000):
            a, b = pairs.randrange(lo, hi), pairs.randrange(lo, hi)
            wrong += solve_expression(f"{a}+{b}", slip_rate=0.15, rng=rng).answer != a + b
        assert wrong / 4000 == pytest.approx(expected, abs=0.03)


def test_teacher_set_with_slips_is_deterministic_and_the_correct_filter_removes_exactly_the_wrong_rows():
    from klear.sft.data import filter_sft_dataset, make_teacher_sft_dataset

    task = [
        {
            "name": "basic_arithmetic",
            "config": dict(DEMO_TASKS["basic_arithmetic"], min_digits=3, max_digits=3, operators=["+"]),
        }
    ]
    kwargs = dict(train_size=300, heldout_size=4, seed=3, data_source="math_longcot_reasoning_gym")
    exact, _ = make_teacher_sft_dataset(task, **kwargs)
    flawed, _ = make_teacher_sft_dataset(task, slip_rate=0.15, **kwargs)
    again, _ = make_teacher_sft_dataset(task, slip_rate=0.15, **kwargs)
    assert flawed.to_list() == again.to_list()
    assert [r["prompt"] for r in flawed] == [r["prompt"] for r in exact]

    def boxed(row):
        text = row["completion"][-1]["content"]
        return text[text.rindex("{") + 1 : text.rindex("}")]

    assert all(boxed(r) == r["ground_truth"] for r in exact)
    wrong = sum(boxed(r) != r["ground_truth"] for r in flawed)
    assert 0.25 * 300 < wrong < 0.55 * 300  # 1-(0.85)^3 = 0.386
    kept, stats = filter_sft_dataset(flawed, "correct")
    assert (stats["n_in"], stats["removed_wrong"], stats["n_out"]) == (300, wrong, 300 - wrong)
    assert all(boxed(r) == r["ground_truth"] for r in kept)


def test_one_slip_rate_per_task_makes_each_task_a_source_of_its_own_quality():
    """Two sources told apart by their problems: sums from an exact teacher, products from one that slips
    (p = 0.4 in each column fact: most products come out wrong)."""
    from klear.sft.data import make_teacher_sft_dataset

    addition = {"name": "basic_arithmetic", "config": dict(DEMO_TASKS["basic_arithmetic"], operators=["+"])}
    tasks = [addition, {"name": "products", "config": DEMO_TASKS["products"]}]
    kwargs = dict(train_size=200, heldout_size=4, seed=1, data_source="math_longcot_reasoning_gym")
    rows, _ = make_teacher_sft_dataset(tasks, slip_rate=[0.0, 0.4], **kwargs)
    wrong = {"+": 0, "*": 0}
    count = {"+": 0, "*": 0}
    for row in rows:
        op = "*" if "*" in row["prompt"][-1]["content"] else "+"
        text = row["completion"][-1]["content"]
        count[op] += 1
        wrong[op] += text[text.rindex("{") + 1 : text.rindex("}")] != row["ground_truth"]
    assert count == {"+": 100, "*": 100}
    assert wrong["+"] == 0 and wrong["*"] >= 30
    with pytest.raises(ValueError, match="slip_rate: 1 rates for 2 tasks"):
        make_teacher_sft_dataset(tasks, slip_rate=[0.1], **kwargs)
    # every rate is checked before any work, also one whose task draws no row
    for bad in ([0.1, float("nan")], [0.1, "x"], None, "0.1"):
        with pytest.raises(TeacherError, match="slip_rate must be a number in"):
            make_teacher_sft_dataset(tasks, slip_rate=bad, **dict(kwargs, train_size=1))
