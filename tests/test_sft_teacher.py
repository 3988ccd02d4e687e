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
