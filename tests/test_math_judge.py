"""Equality rules of the math judge (issue 14): each kind of false positive / false negative, with
several instances and the counter-cases that must stay as they were.

Golds marked "MATH-500" are answers from the MATH-500 test set (HuggingFaceH4/MATH-500, the
``answer`` field). Expected verdicts that involve a tolerance are computed here, independently,
with ``decimal`` / ``fractions`` (never with sympy or math-verify).
"""

from __future__ import annotations

import json
from decimal import Decimal, getcontext
from fractions import Fraction
from math import factorial

import pytest

from conftest import shared_file
from klear.rewards import compute_score, math_score_batch, math_score_batch_detailed, math_score_detailed
from klear.rewards.code_reward import extract_code
from klear.rewards.math_reward import NUMERIC_REL_TOL
from klear.rewards.think_format import answer_region, requires_think

getcontext().prec = 60


def boxed(x: str) -> str:
    return f"Reasoning.\nThe final answer is $\\boxed{{{x}}}$."


def scores(pairs: list[tuple[str, str]]) -> list[float]:
    """Scores of (gold, boxed answer) pairs, in one parallel batch."""
    return math_score_batch([boxed(a) for _, a in pairs], [g for g, _ in pairs])


def assert_verdicts(cases: list[tuple[str, str, float]]) -> None:
    got = scores([(g, a) for g, a, _ in cases])
    bad = [(g, a, want, s) for (g, a, want), s in zip(cases, got) if s != want]
    assert not bad, "gold, answer, expected, got: " + repr(bad)


def rel_diff(a: Decimal, b: Decimal) -> Decimal:
    return abs(a - b) / max(abs(a), abs(b))


# ------------------------------------------------------------------ relative tolerance
MATH500_DECIMALS = ["1.25", "0.15", "3.21", ".0000672", "326.5", "4.5", ".35625"]  # MATH-500


def _last_digit_changed(s: str, delta: int) -> str:
    d = Decimal(s)
    return format(d + delta * Decimal(1).scaleb(d.as_tuple().exponent), "f")


def _one_digit_fewer(s: str) -> str:
    d = Decimal(s)
    return format(d.quantize(Decimal(1).scaleb(d.as_tuple().exponent + 1)), "f")


# 9 significant digits, down to the smallest relative step (9.99999998 -> 9.99999999: 1.0e-9)
NINE_DIGITS = ["0.123456789", "1.00000001", "9.99999998", "99999999.8"]


@pytest.mark.parametrize("gold", MATH500_DECIMALS + NINE_DIGITS)
def test_a_different_last_significant_digit_is_wrong(gold):
    bumped_up, bumped_down = _last_digit_changed(gold, 1), _last_digit_changed(gold, -1)
    shorter = _one_digit_fewer(gold)  # .0000672 -> 0.000067, 1.25 -> 1.2 (half-even)
    for other in (bumped_up, bumped_down, shorter):  # independently: really a different number
        assert rel_diff(Decimal(other), Decimal(gold)) > NUMERIC_REL_TOL
    assert_verdicts(
        [
            (gold, bumped_up, -1.0),
            (gold, bumped_down, -1.0),
            (gold, shorter, -1.0),
            (gold, gold + "0", 1.0),  # the same value with a trailing zero
            (gold, format(Decimal(gold), "f"), 1.0),  # leading zero added (.0000672 -> 0.0000672)
            (gold, f"({gold}, 1)", -1.0),  # a tuple against a number: counter-check of the next one
        ]
    )


def test_relative_rule_holds_inside_tuples_intervals_and_matrices():
    assert_verdicts(
        [
            ("(0.0000672, 1)", "(0.0000673, 1)", -1.0),
            ("(0.0000672, 1)", "(0.00006720, 1)", 1.0),
            ("[0.15, 3.21)", "[0.16, 3.21)", -1.0),
            ("[0.15, 3.21)", "[0.150, 3.210)", 1.0),
            (r"\begin{pmatrix} 0.0000672 \\ 1 \end{pmatrix}", r"\begin{pmatrix} 0.0000673 \\ 1 \end{pmatrix}", -1.0),
            (r"\begin{pmatrix} 0.5 \\ 1 \end{pmatrix}", r"\begin{pmatrix} \frac12 \\ 1 \end{pmatrix}", 1.0),
        ]
    )


# Exact values, computed with decimal (60 digits); pi from its well-known expansion.
PI = Decimal("3.14159265358979323846264338327950288419716939937510")
EXACT = {
    r"\pi": PI,
    r"\sqrt{2}": Decimal(2).sqrt(),
    r"\frac{1}{3}": Decimal(1) / 3,
    r"\frac{1}{7}": Decimal(1) / 7,
    r"\frac{\sqrt{3}}{2}": Decimal(3).sqrt() / 2,
    "e": Decimal(1).exp(),
}


@pytest.mark.parametrize("gold", sorted(EXACT))
def test_decimal_approximations_of_exact_values(gold):
    """A k-significant-digit rounding of an exact value is correct iff it is within the relative
    tolerance of it (so about 10 digits are needed; the issue's 7 digits of pi are wrong)."""
    exact = EXACT[gold]
    cases = []
    for k in range(3, 15):
        approx = exact.quantize(Decimal(1).scaleb(exact.adjusted() - k + 1))
        want = 1.0 if rel_diff(approx, exact) <= NUMERIC_REL_TOL else -1.0
        cases.append((gold, format(approx, "f"), want))
    assert [w for *_, w in cases].count(-1.0) >= 6  # the short ones are really wrong...
    assert [w for *_, w in cases].count(1.0) >= 4  # ... and the long ones really right
    assert_verdicts(cases)


def test_exact_decimals_and_integers_keep_working():
    big = str(2**100)  # 1267650600228229401496703205376
    assert_verdicts(
        [
            ("3.141593", r"\pi", -1.0),
            (r"\pi", "3.141593", -1.0),  # the example, both ways
            (r"\frac12", "0.5", 1.0),
            (r"\frac{3}{4}", "0.75", 1.0),
            (r"\frac{1}{10}", "0.1", 1.0),  # 0.1 is not exact in binary: the tolerance absorbs that
            ("0.0625", r"\frac{1}{16}", 1.0),
            (r"\frac13", "0.3333", -1.0),  # decided: a decimal is not the exact fraction ...
            (r"\frac13", "0.333333", -1.0),
            (r"\frac13", "0.3333333333", 1.0),  # ... unless it agrees to 10 significant digits
            ("18", "18.0", 1.0),
            ("1000000", "1000000.4", -1.0),
            (r"25\%", "0.25", 1.0),
            ("-0.5", r"-\frac{1}{2}", 1.0),
            ("0", "0.0", 1.0),
            (r"1.5\times10^{9}", "1500000000", 1.0),
            (big, r"2^{100}", 1.0),
            (big, str(2**100 + 1), -1.0),  # large integers are exact
            (big, r"1.2676506002282294\times10^{30}", -1.0),  # a rounded float never matches an integer
            ("123456789012345678901", "123456789012345678902", -1.0),
        ]
    )


def test_integer_golds_are_never_matched_by_a_nearby_decimal():
    # These decimals are within the relative tolerance of the integer gold, yet different numbers.
    near = [("123456789012", "123456789013.0"), (str(2**100), str(2**100 - 10**12) + ".0")]
    for gold, answer in near:
        assert 0 < rel_diff(Decimal(gold), Decimal(answer)) < NUMERIC_REL_TOL
    assert_verdicts(
        [(g, a, -1.0) for g, a in near]
        + [
            ("123456789012", "123456789012.0", 1.0),
            (str(2**100), str(2**100) + ".0", 1.0),
        ]
    )


# ----------------------------------------------------------------------- tiny values
@pytest.mark.parametrize("n", [30, 200, 2004])
def test_tiny_values_are_compared_relatively(n):
    assert Fraction(1, factorial(n)) / Fraction(1, factorial(n + 2)) == (n + 1) * (n + 2)  # far apart
    assert_verdicts(
        [
            (rf"\frac{{1}}{{{n}!}}", rf"\frac{{1}}{{{n + 2}!}}", -1.0),
            (rf"\frac{{1}}{{{n}!}}", rf"\frac{{1}}{{{n + 1}!}}", -1.0),
            (rf"\frac{{1}}{{{n}!}}", rf"({n}!)^{{-1}}", 1.0),
        ]
    )


def test_tiny_powers():
    # 10^-150 vs 1.001e-150: relative difference 1e-3; vs 1.0000000001e-150: 1e-10 (within tolerance)
    assert rel_diff(Decimal("1e-150"), Decimal("1.001e-150")) > NUMERIC_REL_TOL
    assert rel_diff(Decimal("1e-150"), Decimal("1.0000000001e-150")) < NUMERIC_REL_TOL
    assert_verdicts(
        [
            ("2^{-400}", "2^{-401}", -1.0),
            ("2^{-400}", r"\frac{1}{2^{400}}", 1.0),
            ("10^{-150}", r"2\cdot 10^{-150}", -1.0),
            ("10^{-150}", r"1.001\times10^{-150}", -1.0),
            ("10^{-150}", r"1.0000000001\times10^{-150}", 1.0),
            (r"\frac{1}{2^{99}}", "2^{-99}", 1.0),
            ("1/2^{99}", "1/2^{98}", -1.0),
        ]
    )


def test_huge_exact_values_are_not_compared_loosely():
    # Relative to 9^(9^9) a difference of 1 is nothing, but these are different integers.
    assert_verdicts(
        [
            ("9^{9^{9}}", "9^{9^{9}}+1", -1.0),
            ("10^{10^{100}}", "10^{10^{100}}+1", -1.0),
            ("9^{9^{9}}", "9^{9^{9}}", 1.0),
            (r"\frac{\sqrt{6}+\sqrt{2}}{4}", r"\cos\frac{\pi}{12}", 1.0),  # equal values, different forms
            (r"\frac{\sqrt{6}-\sqrt{2}}{4}", r"\cos\frac{\pi}{12}", -1.0),
        ]
    )


# ------------------------------------------------------------------------------ bases
MATH500_BASES = ["52_8", "40_9", "2516_8", "4210_{5}", "204_5", "4343_6"]  # every MATH-500 gold in a base


def _split_base(gold: str) -> tuple[str, int]:
    digits, base = gold.split("_")
    return digits, int(base.strip("{}"))


@pytest.mark.parametrize("gold", MATH500_BASES)
def test_base_subscripts_count(gold):
    digits, base = _split_base(gold)
    value = int(digits, base)  # the same number in base ten
    last = int(digits[-1], base)
    other_digit = digits[:-1] + str((last + 1) % base)
    assert int(other_digit, base) != value and str(value) != digits
    assert_verdicts(
        [
            (gold, f"{digits}_{{{base}}}", 1.0),
            (gold, f"{digits}_{base}", 1.0),
            (gold, digits, 1.0),  # the digits in the base that was asked for
            (gold, f"0{digits}_{base}", 1.0),
            (gold, rf"\text{{{digits}}}_{{{base}}}", 1.0),
            (gold, f"{digits}_{base + 1}", -1.0),  # the 52_9 for 52_8
            (gold, f"{digits}_{{{base + 2}}}", -1.0),
            (gold, f"{other_digit}_{base}", -1.0),
            (gold, f"{value}_{{10}}", -1.0),  # the right value, but not in the base asked for
            (gold, str(value), -1.0),
        ]
    )


def test_subscripts_that_are_not_bases_are_left_alone():
    assert_verdicts(
        [
            ("a_1", "a_2", -1.0),
            ("x_1", "x_1", 1.0),
            ("52", "52", 1.0),
            ("52", "53", -1.0),
            ("10001_2", "10001_{2}", 1.0),
            ("A1_{16}", "a1_{16}", 1.0),  # hexadecimal digits, any case
            ("A1_{16}", "A2_{16}", -1.0),
        ]
    )


# ----------------------------------------------------------------------- text answers
def test_text_answers_compare_without_formatting():
    assert_verdicts(
        [
            (r"\text{4:30 p.m.}", r"4:30 \text{ p.m.}", 1.0),  # the example
            (r"\text{4:30 p.m.}", r"4:30\text{ p.m.}", 1.0),
            (r"\text{4:30 p.m.}", "4:30 p.m.", 1.0),
            (r"\text{4:30 p.m.}", r"\mathrm{4:30~p.m.}", 1.0),
            (r"\text{4:30 p.m.}", r"5:30 \text{ p.m.}", -1.0),
            (r"\text{4:30 p.m.}", r"4:30 \text{ a.m.}", -1.0),
            (r"\text{June 20}", "June 20", 1.0),
            (r"\text{June 20}", r"\text{June 21}", -1.0),
            # MATH-500 text golds
            (r"\text{Evelyn}", r"\text{ Evelyn }", 1.0),
            (r"\text{Evelyn}", r"\text{Briana}", -1.0),
            (r"\text{(C)}", "(C)", 1.0),
            (r"\text{(C)}", r"\text{(B)}", -1.0),
            (r"\text{ellipse}", r"\text{Ellipse}", 1.0),
            (r"\text{ellipse}", r"\text{circle}", -1.0),
            (r"5.4 \text{ cents}", "5.4", 1.0),  # units are still stripped
            (r"5.4 \text{ cents}", r"5.5 \text{ cents}", -1.0),
            (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}", 1.0),
        ]
    )


# ------------------------------------------------------------------------ clock times
@pytest.mark.parametrize("gold", [r"\text{4:30 p.m.}", "4:30 p.m.", r"4:30 \text{ p.m.}", r"\text{4:30 PM}"])
def test_am_pm_forms_are_the_same_time(gold):
    assert_verdicts(
        [
            (gold, "4:30 pm", 1.0),  # the examples
            (gold, r"\text{4:30 PM}", 1.0),
            (gold, r"4:30\,\text{P.M.}", 1.0),
            (gold, r"\mathrm{4:30\ pm}", 1.0),
            (gold, "4:30 am", -1.0),  # must stay wrong
            (gold, r"\text{4:30 A.M.}", -1.0),
            (gold, "5:30 pm", -1.0),
            (gold, "4:31 PM", -1.0),
        ]
    )


def test_am_pm_rule_edge_cases():
    assert_verdicts(
        [
            (r"\text{4 p.m.}", "4:00 PM", 1.0),
            (r"\text{12:15 a.m.}", "12:15 AM", 1.0),
            (r"\text{12:15 a.m.}", "12:15 PM", -1.0),  # midnight is not noon
            (r"\text{9:05 a.m.}", "9:05 a.m.", 1.0),
            (r"\text{9:05 a.m.}", "9:50 a.m.", -1.0),
            ("2am", "2AM", -1.0),  # a bare "2am" may be the product 2*a*m: no clock rule
            ("2am", "2am", 1.0),
        ]
    )


# ---------------------------------------------------------------- delimiter sizing commands
@pytest.mark.parametrize("size", ["big", "Big", "bigg", "Bigg"])
def test_sizing_commands_are_layout(size):
    left, right = rf"\{size}l", rf"\{size}r"
    assert_verdicts(
        [
            ("(3,-1)", rf"{left}(3,\,-1{right})", 1.0),  # the issue's \bigl(3,\,-1\bigr)
            ("(3,-1)", rf"{left}(3,\,-2{right})", -1.0),
            ("[0, 1)", rf"{left}[0, 1{right})", 1.0),
            ("[0, 1)", rf"{left}[0, 1{right}]", -1.0),
            ("[0, 1)", rf"\{size}[0, 1\{size})", 1.0),  # without the l/r suffix
            (r"\{1, 2\}", rf"{left}\{{1, 2{right}\}}", 1.0),
            (r"A \cup B", r"A \bigcup B", -1.0),  # \bigcup is not a sizing command (left to math-verify)
        ]
    )


# ----------------------------------------------------------------- exact integer powers
def test_equal_power_towers_score_plus_one():
    assert_verdicts(
        [
            ("2^{65536}", "2^{2^{2^{2^2}}}", 1.0),  # the issue: was -1
            ("2^{65536}", "2^{2^{16}}", 1.0),  # the issue: timed out
            ("2^{65536}", "4^{32768}", 1.0),
            ("2^{65536}", "2^{65537}", -1.0),
            ("2^{65536}", "2^{65536}+1", -1.0),
            ("2^{65536}", "2^{2^{2^{2^3}}}", -1.0),
            (r"(2^{65536}, 3)", r"(2^{2^{16}}, 3)", 1.0),  # inside a tuple too
            ("2^{2^{100}}", "4^{2^{99}}", 1.0),  # too large to evaluate: compared as exponents
            ("2^{2^{100}}", "2^{2^{100}+1}", -1.0),
            ("2^{2^{100}}", "3^{2^{100}}", -1.0),
            ("2^{2^{100}}", "5", -1.0),
            ("(-2)^{3}", "-8", 1.0),
            ("9^{9^{9}}", r"3^{2 \cdot 9^{9}}", 1.0),
        ]
    )


def test_towers_with_huge_exponents_compare_by_their_exponents():
    """Towers whose exponent is itself too large to evaluate (7^7^7^7 has a 695,975-digit exponent)."""
    assert_verdicts(
        [
            ("7^{7^{7^7}}", "7^{7^{823543}}", 1.0),  # was a timeout
            ("7^{7^{823543}}", "7^{7^{7^{7}}}", 1.0),
            ("7^{7^{7^7}}", "7^{7^{823544}}", -1.0),
            ("7^{7^{7^7}}", "7^{7^{7^7}}+7", -1.0),
            ("2^{2^{2^{2^{2^{2^2}}}}}", "2^{2^{2^{65536}}}", 1.0),
            ("2^{2^{2^{2^{2^{2^2}}}}}", "4^{2^{2^{65536}-1}}", 1.0),
            ("2^{2^{2^{2^{2^{2^2}}}}}", "2^{2^{2^{65535}}}", -1.0),
            ("2^{2^{2^{2^{2^{2^2}}}}}", "123456789", -1.0),
            # signs and factors of the root
            ("(-2)^{3^{2^{100}}}", "-2^{3^{2^{100}}}", 1.0),
            ("(-2)^{3^{2^{100}}}", "2^{3^{2^{100}}}", -1.0),
            ("(-2)^{2^{2^{100}}}", "2^{2^{2^{100}}}", 1.0),
            (r"2 \cdot 2^{2^{100}}", "2^{2^{100}+1}", 1.0),
            (r"3 \cdot 2^{2^{100}}", "2^{2^{100}+1}", -1.0),
            ("(2^{2^{100}})^{2}", "2^{2^{101}}", 1.0),
            ("(2^{2^{100}})^{3}", "2^{2^{101}}", -1.0),
        ]
    )


# ------------------------------------------------------------- units and interval brackets
def test_an_exponent_on_a_unit_is_part_of_the_answer():
    assert_verdicts(
        [
            (r"15\mbox{ cm}^2", r"15\mbox{ cm}^3", -1.0),  # the issue: was +1
            (r"15\mbox{ cm}^2", r"15\text{ cm}", -1.0),
            (r"15\mbox{ cm}^3", r"15\mbox{ cm}^{2}", -1.0),
            (r"15\text{ m}", r"15\text{ m}^2", -1.0),
            (r"15\mbox{ cm}^2", r"15 \mathrm{~cm}^3", -1.0),  # spacing inside the unit's braces
            (r"15\mbox{ cm}^2", r"15 \text{\,cm}^3", -1.0),
            (r"15\mbox{ cm}^2", r"15 \mathrm{~cm}^2", 1.0),
            # kept as they were: same unit and exponent, a bare number against a unit either way
            (r"15\mbox{ cm}^2", r"15\mbox{ cm}^2", 1.0),
            (r"15\mbox{ cm}^2", r"15\text{ cm}^{2}", 1.0),
            (r"15\mbox{ cm}^2", r"15 \mathrm{cm}^2", 1.0),
            (r"15\mbox{ cm}^2", "15", 1.0),
            ("15", r"15 \text{ cm}^2", 1.0),
            (r"15\text{ cm}^2", r"15\text{ square cm}", 1.0),
            (r"15\mbox{ cm}^2", r"16\mbox{ cm}^2", -1.0),
        ]
    )


def test_interval_brackets_at_infinity_count():
    assert_verdicts(
        [
            (r"(-\infty, 0]", r"[-\infty, 0]", -1.0),  # the issue: was +1
            (r"(-\infty, 0]", r"\left[-\infty, 0\right]", -1.0),
            (r"[-\infty, 0]", r"(-\infty, 0]", -1.0),  # a closed infinite end in the gold too
            (r"[2, \infty)", r"[2, \infty]", -1.0),
            (r"(-\infty, 0] \cup [1, \infty)", r"(-\infty, 0] \cup [1, \infty]", -1.0),
            (r"(-\infty, 0]", r"(-\infty, 0]", 1.0),
            (r"(-\infty, 0]", r"\left(-\infty, 0\right]", 1.0),
            (r"(-\infty, 0]", r"x \leq 0", 1.0),
            (r"(-\infty, 0]", r"(-\infty, 0)", -1.0),  # finite ends: math-verify's test, as before
            (r"[-\infty, 0]", r"[-\infty, 0]", 1.0),
        ]
    )


def test_upright_e_and_i_are_the_constants():
    assert_verdicts(
        [
            (r"\mathrm{e}", r"\mathrm{e}", 1.0),
            (r"\frac{1}{\mathrm{e}}", r"\frac{1}{\mathrm{e}}", 1.0),  # was an unusable gold
            (r"\frac{1}{\mathrm{e}}", "e^{-1}", 1.0),
            (r"\frac{1}{\mathrm{e}}", r"\frac{1}{\pi}", -1.0),
            (r"\sqrt{\mathrm{e}}", r"\sqrt{e}", 1.0),
            (r"\mathrm{e}^{2}", "e^2", 1.0),
            (r"2\mathrm{e}", "2e", 1.0),
            (r"2\mathrm{e}", "2", -1.0),  # math-verify dropped "\mathrm{e}" as a unit: 2e "was" 2
            (r"2\mathrm{e}", "3e", -1.0),
            (r"2+3\mathrm{i}", "2+3i", 1.0),
            (r"2+3\mathrm{i}", "5", -1.0),  # likewise 2+3i "was" 5
            (r"2+3\mathrm{i}", "2+4i", -1.0),
        ]
    )


# ------------------------------------------------------------------ inequality vs interval
def test_inequalities_equal_the_intervals_they_describe():
    assert_verdicts(
        [
            (r"[\sqrt{2}, \infty)", r"x \geq \sqrt{2}", 1.0),  # the example
            (r"[\sqrt{2}, \infty)", r"x > \sqrt{2}", -1.0),
            (r"[\sqrt{2}, \infty)", r"x \geq 2", -1.0),
            (r"x \geq \sqrt{2}", r"[\sqrt{2}, \infty)", 1.0),  # the other way round (as before)
            # MATH-500 interval golds
            (r"(2,\infty)", "x>2", 1.0),
            (r"(2,\infty)", r"x \ge 2", -1.0),
            (r"(-\infty, 0]", r"x \le 0", 1.0),
            (r"(-\infty, 0]", "x<0", -1.0),
            (r"\left(\frac{3}{5},\frac{8}{3}\right]", r"\frac35 < x \le \frac83", 1.0),
            (r"\left(\frac{3}{5},\frac{8}{3}\right]", r"\frac35 \le x \le \frac83", -1.0),
            (r"(-\infty, 2) \cup (3, \infty)", r"x<2 \text{ or } x>3", 1.0),
            (r"(-\infty, 2) \cup (3, \infty)", r"x<2 \text{ and } x>3", -1.0),
            (r"(-\infty, 2) \cup (3, \infty)", r"x \le 2 \text{ or } x>3", -1.0),
            (r"(-\infty, 2) \cup (3, \infty)", r"(-\infty, 2] \cup (3, \infty)", -1.0),
        ]
    )


# ----------------------------------------------------------------------- think format
@pytest.mark.parametrize(
    "response, reason",
    [
        (r"<think>a</think><think>b</think>\boxed{9}", "multiple_think"),  # the example
        (r"<think>a</think>b</think>\boxed{9}", "multiple_think"),
        (r"a</think><think>b</think>\boxed{9}", "multiple_think"),
        (r"<think>a<think>b</think>\boxed{9}", "multiple_think"),
        (r"<think>a</think>\boxed{9}<think>", "unclosed_think"),
        (r"<think>a \boxed{9}", "unclosed_think"),
    ],
)
@pytest.mark.parametrize("data_source", ["math_longcot_math_verify", "math"])
def test_think_format_is_one_closed_block(response, reason, data_source):
    assert compute_score(data_source, response, "9") == -1.0
    assert math_score_detailed(response, "9", require_think=requires_think(data_source)).reason == reason
    program = response.replace(r"\boxed{9}", "\n```python\nprint(9)\n```\n")
    assert extract_code(program) is None  # the code reward applies the same rule
    assert extract_code(program.replace("<think>", "").replace("</think>", "")) == "print(9)\n"


@pytest.mark.parametrize(
    "response", [r"<think>a</think>\boxed{9}", r"a</think>\boxed{9}", "<think>\na\n</think>\n\n\\boxed{9}"]
)
def test_one_closed_think_block_passes(response):
    assert compute_score("math_longcot_math_verify", response, "9") == 1.0
    code = extract_code(response.replace(r"\boxed{9}", "\n```python\nprint(9)\n```\n"), require_think=True)
    assert code == "print(9)\n"


def test_think_rule_lives_in_one_place():
    assert requires_think("math_longcot_math_verify") and requires_think("coder1_longcot")
    assert not requires_think("math") and requires_think("math", True) and not requires_think("x_longcot", False)
    assert answer_region("no tags", require_think=True) == (None, "missing_think")
    assert answer_region("no tags") == ("no tags", None)
    assert compute_score("math_longcot_math_verify", r"\boxed{9}", "9") == -1.0
    assert compute_score("math", r"\boxed{9}", "9") == 1.0


# ------------------------------------------------------------------------- real data
def _golds(name: str) -> list[str]:
    path = shared_file("math", name)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if name.startswith("gsm8k"):
        return [r["answer"].split("####")[-1].strip() for r in rows]
    if name.startswith("aime960"):
        return [r["reward_model"]["ground_truth"] for r in rows]
    return [str(r["meta"].get("answer", r["meta"]["solution"])) for r in rows]


@pytest.mark.parametrize(
    "name", ["aime24.qs.jsonl", "aime25.qs.jsonl", "aime960_math_verify.json", "gsm8k_test_500.jsonl"]
)
def test_every_shared_gold_scores_plus_one_against_itself(name):
    golds = _golds(name)
    assert len(golds) in (30, 960, 500)
    res = math_score_batch_detailed(
        [f"<think>x</think> So $\\boxed{{{g}}}$." for g in golds], golds, require_think=True
    )
    assert [r.score for r in res] == [1.0] * len(golds), [(g, r.reason) for g, r in zip(golds, res) if r.score < 1]
    values = [int(g.replace(",", "")) for g in golds]  # GSM8K writes thousands separators: "2,125"
    # The same value written another way (not the same text, so math-verify decides) ...
    again = math_score_batch([f"\\boxed{{\\dfrac{{{2 * v}}}{{2}}}}" for v in values], golds)
    assert again == [1.0] * len(golds)
    # ... and a neighbouring integer, with a decimal point so the relative rule decides.
    off = math_score_batch([f"\\boxed{{{v + 1}.0}}" for v in values], golds)
    assert off == [-1.0] * len(golds)
