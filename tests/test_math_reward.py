"""Tests for the math-verify reward (paper Sec. 3.2.4) and the reward registry.

All tests share the module-level worker pool (started once, about 1-2 s with spawn).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from klear.rewards import (
    compute_score,
    compute_scores,
    extract_last_boxed,
    get_scorer,
    math_score,
    math_score_batch,
    math_score_batch_detailed,
    math_score_detailed,
    register_scorer,
    registered_prefixes,
    unregister_scorer,
)
from klear.rewards.math_reward import get_math_pool

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math"
# Unbounded, sympy spends well over 30 s comparing this with a small number (simplify tries to evaluate
# 9^(9^9) exactly). The bare integer 9^{9^9} is now decided at once (rule "exact integers"); a
# fraction of it is still beyond every rule, so it shows the time limit at work.
PATHOLOGICAL = r"\boxed{\frac{1}{9^{9^{9}}}}"


def boxed(x: str) -> str:
    return f"Some reasoning.\nThe final answer is $\\boxed{{{x}}}$."


# ------------------------------------------------------------------ box extraction
@pytest.mark.parametrize(
    "text, content, status",
    [
        (r"\boxed{18}", "18", "ok"),
        (r"a \boxed{\frac{1}{2}} b", r"\frac{1}{2}", "ok"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}", "ok"),  # escaped braces do not close the box
        (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", "ok"),
        (r"\boxed {7}", "7", "ok"),
        (r"$\boxed 18$.", "18", "ok"),
        (r"\fbox{42}", "42", "ok"),
        (r"\boxed{1} then \boxed{2}", "2", "ok"),  # last box wins
        (r"\boxed{3 + \boxed{4}}", r"3 + \boxed{4}", "ok"),  # nested box belongs to outer
        (r"\boxed{1} then \boxed{\frac{2}{3}", None, "unclosed"),  # truncated last box
        (r"answer: \boxed", None, "unclosed"),
        (r"\boxed{}", None, "empty"),
        (r"\boxed{   }", None, "empty"),
        (r"\boxed{5} and then \boxed{}", None, "empty"),
        ("no box at all", None, "no_box"),
        (r"\boxedx{5}", None, "no_box"),  # another command, not \boxed
    ],
)
def test_extract_last_boxed(text, content, status):
    got = extract_last_boxed(text)
    assert (got.content, got.status) == (content, status)


# ---------------------------------------------------------------- equivalent forms
@pytest.mark.parametrize(
    "pred, gold",
    [
        ("18", "18"),  # fast path
        ("0.5", r"\frac{1}{2}"),
        (r"\frac{1}{2}", "0.5"),
        ("3/4", r"\dfrac{3}{4}"),
        (r"\dfrac{3}{4}", "0.75"),
        ("18.0", "18"),
        ("$18$", "18"),
        (r"\text{18}", "18"),
        ("1,000", "1000"),
        ("1000", "1,000"),
        ("x=5", "5"),
        ("17.", "17"),  # trailing sentence period
        (r"18^\circ", "18"),
        (r"\sqrt{12}", r"2\sqrt{3}"),
        (r"\frac{1}{2^{99}}", "2^{-99}"),
        (r"\{2,1\}", r"\{1,2\}"),
        ("0.3333333333", r"\frac{1}{3}"),  # agrees to 10 significant digits (within NUMERIC_REL_TOL)
    ],
)
def test_equivalent_forms_score_plus_one(pred, gold):
    res = math_score_detailed(boxed(pred), gold)
    assert res.score == 1.0, res
    assert res.reason in ("correct", "exact_match")


def test_integer_gold_value_is_accepted():
    assert math_score(boxed("73"), 73) == 1.0
    assert math_score(boxed("72"), 73) == -1.0


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("19", "18"),
        (r"\frac{1}{2^{98}}", r"\frac{1}{2^{99}}"),  # math-verify's default precision says equal
        ("1/2^{98}", "1/2^{99}"),
        ("0.33", r"\frac{1}{3}"),
        ("0.333333", r"\frac{1}{3}"),  # decided: a 6-digit decimal is not the exact 1/3
        ("1000001", "1000000"),
        ("1000000.4", "1000000"),
        (r"\text{hello}", "18"),
        ("-18", "18"),
    ],
)
def test_different_values_score_minus_one(pred, gold):
    res = math_score_detailed(boxed(pred), gold)
    assert res.score == -1.0, res


@pytest.mark.parametrize(
    "response, reason",
    [
        ("The answer is 18.", "no_box"),
        ("", "no_box"),
        (r"So \boxed{}.", "empty_box"),
        (r"So \boxed{ }.", "empty_box"),
        (r"First \boxed{18}. Hmm, let me recompute: \boxed{1", "unclosed_box"),
        (r"\boxed{18} wait no \boxed{", "unclosed_box"),
        (r"\boxed{???}", "unparseable_answer"),
    ],
)
def test_missing_or_broken_answers_score_minus_one(response, reason):
    res = math_score_detailed(response, "18")
    assert (res.score, res.reason) == (-1.0, reason)


def test_non_string_response_scores_minus_one():
    assert math_score_detailed(None, "18").reason == "invalid_response"  # type: ignore[arg-type]


def test_only_last_box_counts():
    assert math_score(r"I think \boxed{18}. No wait, it is \boxed{19}.", "18") == -1.0
    assert math_score(r"I think \boxed{19}. No wait, it is \boxed{18}.", "18") == 1.0


# ----------------------------------------------------------------------- think rules
def test_only_text_after_last_think_close_counts():
    # Box only inside the think block: nothing after </think> -> no answer.
    assert math_score_detailed(r"<think>it is \boxed{18}</think> The answer is 18.", "18").reason == "no_box"
    assert math_score(r"<think>maybe \boxed{19}</think> so \boxed{18}", "18") == 1.0
    assert math_score(r"<think>maybe \boxed{18}</think> so \boxed{19}", "18") == -1.0
    # Several </think>: the last one delimits the answer.
    assert math_score(r"<think>a</think> \boxed{18} <think>b</think> \boxed{19}", "18") == -1.0


@pytest.mark.parametrize("require_think", [False, True])
def test_unclosed_think_is_truncated(require_think):
    res = math_score_detailed(r"<think>so the answer is \boxed{18}", "18", require_think=require_think)
    assert (res.score, res.reason) == (-1.0, "unclosed_think")
    # A new <think> opened after the last </think> is also a cut-off response.
    res = math_score_detailed(r"<think>a</think> \boxed{18} <think>more", "18", require_think=require_think)
    assert res.reason == "unclosed_think"


def test_require_think():
    plain = r"The answer is \boxed{18}."
    assert math_score(plain, "18", require_think=False) == 1.0
    res = math_score_detailed(plain, "18", require_think=True)
    assert (res.score, res.reason) == (-1.0, "missing_think")
    # <think> may live in the prompt: the closing tag alone is enough.
    assert math_score("reasoning...</think>" + plain, "18", require_think=True) == 1.0
    assert math_score("<think>reasoning...</think>" + plain, "18", require_think=True) == 1.0


# ------------------------------------------------------------------- bad ground truth
@pytest.mark.parametrize("gold", ["???", "[]", None, "", "   "])
def test_unparseable_gold_is_a_logged_data_error(gold, caplog):
    response = boxed("???" if gold is None else (gold.strip() or "1"))
    with caplog.at_level(logging.WARNING, logger="klear.rewards.math_reward"):
        r1 = math_score_detailed(response, gold)
        r2 = math_score_detailed(boxed("18"), gold)
    assert (r1.score, r1.reason) == (-1.0, "invalid_gold")  # never +1, not even an identical string
    assert (r2.score, r2.reason) == (-1.0, "invalid_gold")
    msgs = [r.getMessage() for r in caplog.records if "unusable ground truth" in r.getMessage()]
    assert len(msgs) == 1 and repr(gold) in msgs[0]  # once per distinct gold


# ----------------------------------------------------------------- gold-first order
def test_verify_is_called_gold_first():
    # math-verify keeps only the right-hand side of an equation in the PREDICTION when the gold
    # is not one: verify(gold="1", pred="2x+z=1") is True, verify(gold="2x+z=1", pred="1") is False.
    assert math_score(boxed("2x+z=1"), "1") == 1.0
    assert math_score(boxed("1"), "2x+z=1") == -1.0


# --------------------------------------------------------------- timeouts / threads
def test_pathological_answer_is_cut_off_from_a_worker_thread():
    results: dict[str, object] = {}

    def target():
        t0 = time.monotonic()
        results["res"] = math_score_detailed(PATHOLOGICAL, "1", timeout_s=1.0)
        results["elapsed"] = time.monotonic() - t0

    th = threading.Thread(target=target)
    th.start()
    th.join(30)
    assert not th.is_alive()
    res = results["res"]
    assert res.score == -1.0 and res.reason == "timeout", res
    # 1 s limit + pebble's kill (SIGTERM, SIGKILL after 3 s) + scheduling slack.
    assert results["elapsed"] < 1.0 + 5.0


def test_concurrent_calls_from_many_threads():
    cases = [(boxed("0.5"), r"\frac{1}{2}", 1.0), (boxed("3"), "4", -1.0), (PATHOLOGICAL, "2", -1.0)] * 3

    def one(case):
        resp, gold, _ = case
        return math_score(resp, gold, timeout_s=1.0)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as ex:
        got = list(ex.map(one, cases))
    assert got == [c[2] for c in cases]
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------------ batch API
def test_batch_preserves_order_over_mixed_inputs():
    items = [
        (boxed("18"), "18", 1.0, "exact_match"),
        (PATHOLOGICAL, "5", -1.0, "timeout"),
        (boxed(r"\frac{3}{4}"), "0.75", 1.0, "correct"),
        ("no answer", "5", -1.0, "no_box"),
        (boxed("7"), "?????", -1.0, "invalid_gold"),
        (boxed("7"), "8", -1.0, "wrong"),
        (r"\boxed{5", "5", -1.0, "unclosed_box"),
        (boxed("x=2"), "2", 1.0, "correct"),
    ]
    res = math_score_batch_detailed([i[0] for i in items], [i[1] for i in items], timeout_s=1.0)
    assert [(r.score, r.reason) for r in res] == [(i[2], i[3]) for i in items]
    assert math_score_batch([i[0] for i in items], [i[1] for i in items], timeout_s=1.0) == [i[2] for i in items]


def test_batch_rejects_length_mismatch():
    with pytest.raises(ValueError, match="got 2 responses but 1 ground truths"):
        math_score_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        math_score("x", "1", timeout_s=0)


# ------------------------------------------------------------------ pool resilience
def _abort_quietly() -> None:
    """``os.abort()`` in a pool worker without the "Fatal Python error: Aborted" dump: pytest's faulthandler,
    inherited by forked workers, would print one per deliberate crash. Only this test helper turns it off."""
    faulthandler.disable()
    os.abort()


def test_worker_crash_is_reported_and_pool_keeps_working():
    pool = get_math_pool()
    outcome = pool.run(_abort_quietly, (), timeout_s=5.0, retry_wait_s=0.5)  # one retry after 0.5 s
    assert outcome.status == "crashed" and "after 2 attempts" in outcome.detail, outcome
    assert math_score(boxed("0.5"), r"\frac{1}{2}") == 1.0


def test_pool_recovers_after_worker_killed_while_idle():
    pool = get_math_pool()
    outcome = pool.run(os.getpid, (), timeout_s=5.0)
    assert outcome.ok
    os.kill(outcome.value, signal.SIGKILL)
    time.sleep(0.5)  # let pebble notice (it may declare the whole pool broken)
    assert math_score(boxed("0.25"), r"\frac{1}{4}") == 1.0


def test_pool_recreated_after_shutdown():
    pool = get_math_pool()
    pool.shutdown()
    assert math_score(boxed("2/4"), r"\frac{1}{2}") == 1.0


# ----------------------------------------------------------------- registry / verl
def test_compute_score_dispatch():
    good = r"<think>work</think> The answer is \boxed{\frac{1}{2}}."
    assert compute_score("math_longcot_math_verify", good, "0.5") == 1.0
    assert compute_score("math_dapo", good, "0.5") == 1.0
    assert compute_score("math500", r"\boxed{0.5}", "0.5", extra_info={"split": "test"}) == 1.0
    # longcot data sources require the think block (Klear's is_longcot=True) ...
    assert compute_score("math_longcot_math_verify", r"\boxed{0.5}", "0.5") == -1.0
    # ... unless overridden; others do not.
    assert compute_score("math_longcot_math_verify", r"\boxed{0.5}", "0.5", require_think=False) == 1.0
    assert compute_score("math_dapo", r"\boxed{0.5}", "0.5") == 1.0
    assert compute_score("math_dapo", r"\boxed{0.5}", "0.5", require_think=True) == -1.0
    # unknown keyword arguments (verl reward_kwargs) are ignored by the math scorer
    assert compute_score("math_dapo", r"\boxed{0.5}", "0.5", sandbox_fusion_url=None) == 1.0


def test_unknown_data_source_raises():
    with pytest.raises(ValueError, match=r"lean4_proofs.*math"):
        compute_score("lean4_proofs", "print(1)", "1")
    with pytest.raises(ValueError, match="lean4_proofs"):
        compute_scores(["math", "lean4_proofs"], ["a", "b"], ["1", "1"])
    with pytest.raises(ValueError, match="lean4_proofs"):
        get_scorer("lean4_proofs")


def test_register_scorer_and_mixed_batch():
    calls = []

    def code_fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        calls.append((data_source, kwargs))
        if solution_str == "boom":
            raise RuntimeError("scorer bug")
        return 0.25

    register_scorer("proof", code_fn)
    try:
        assert "proof" in registered_prefixes() and "math" in registered_prefixes()
        with pytest.raises(ValueError, match="a scorer is already registered for prefix 'proof'"):
            register_scorer("proof", code_fn)
        assert compute_score("proof_contests", "x", "y") == 0.25
        scores = compute_scores(
            ["math_dapo", "proof_contests", "math_dapo", "proof_x"],
            [boxed("1"), "x", boxed("3"), "boom"],
            ["1", "tests", "2", "tests"],
            timeout_s=2.0,
        )
        # a raising scorer costs only its own item, which is unscored (nan), not wrong
        assert scores[:3] == [1.0, 0.25, -1.0] and math.isnan(scores[3])
        assert all(kw.get("timeout_s") == 2.0 for _, kw in calls[1:])
    finally:
        unregister_scorer("proof")
    assert "proof" not in registered_prefixes() and "code" in registered_prefixes()


def test_compute_scores_length_mismatch():
    with pytest.raises(ValueError, match="length mismatch: 1 data_sources, 2 solution_strs, 2 ground_truths"):
        compute_scores(["math"], ["a", "b"], ["1", "2"])


# ----------------------------------------------------------------------- real data
@pytest.mark.skipif(not (DATA / "aime24.qs.jsonl").exists(), reason="shared AIME24 data not present")
def test_aime24_golds():
    rows = [json.loads(line) for line in (DATA / "aime24.qs.jsonl").read_text().splitlines() if line.strip()]
    golds = [r["meta"]["answer"] for r in rows]
    assert len(golds) == 30
    right = [f"<think>...</think> The answer is $\\boxed{{{g}}}$." for g in golds]
    # Same value written differently, so math-verify (not the fast path) decides.
    right_verbose = [f"</think> $\\boxed{{\\dfrac{{{2 * int(g)}}}{{2}}}}$" for g in golds]
    wrong = [f"</think> $\\boxed{{{int(g) + 1}}}$" for g in golds]
    ds = ["math_longcot_math_verify"] * 30
    assert compute_scores(ds, right, golds) == [1.0] * 30
    assert compute_scores(ds, right_verbose, golds) == [1.0] * 30
    assert compute_scores(ds, wrong, golds) == [-1.0] * 30


@pytest.mark.skipif(not (DATA / "aime960_math_verify.json").exists(), reason="shared verl-format AIME data not present")
def test_verl_rows_dispatch_on_their_data_source():
    lines = (DATA / "aime960_math_verify.json").read_text().splitlines()[:64]
    rows = [json.loads(line) for line in lines if line.strip()]
    ds = [r["data_source"] for r in rows]
    golds = [r["reward_model"]["ground_truth"] for r in rows]
    responses = [f"<think>x</think>\\boxed{{{g}}}" for g in golds]
    assert compute_scores(ds, responses, golds) == [1.0] * len(rows)
    assert [compute_score(d, "no think " + r.split("</think>")[1], g) for d, r, g in zip(ds[:4], responses, golds)] == [
        -1.0
    ] * 4


def test_list_ground_truth_any_acceptable_answer_counts():
    import numpy as np

    from klear.rewards import compute_score, compute_scores

    assert compute_score("math_x", r"\boxed{0.5}", ["1/2", "0.5"]) == 1.0
    assert compute_score("math_x", r"\boxed{0.5}", ("2", "0.5")) == 1.0
    assert compute_score("math_x", r"\boxed{0.5}", np.array(["2", "0.5"], dtype=object)) == 1.0  # parquet column
    assert compute_score("math_x", r"\boxed{3}", ["1/2", "0.5"]) == -1.0
    # An interval written in LaTeX is one answer, not a JSON list.
    assert compute_score("math_x", r"\boxed{[0, 1)}", "[0, 1)") == 1.0
    responses = [r"\boxed{2}", r"\boxed{7}", r"\boxed{5}"]
    assert compute_scores(["math_x"] * 3, responses, [["1", "2"], "7", ["4", "6"]]) == [1.0, 1.0, -1.0]


# Closed intervals with plain endpoints are valid JSON arrays: they used to be decoded as the answers
# "1" and "2", so \boxed{1} scored +1 and the right \boxed{[1, 2]} -1 (issue 20).
INTERVAL_GOLDS = [("[1, 2]", "1"), ("[-2, 7]", "-2"), ("[0.5, 1]", "0.5"), ("[1,2]", "2")]


@pytest.mark.parametrize("gold, endpoint", INTERVAL_GOLDS)
def test_a_string_gold_is_never_json_decoded(gold, endpoint):
    from klear.rewards import compute_score, compute_scores

    assert compute_score("math_x", rf"\boxed{{{endpoint}}}", gold) == -1.0
    assert compute_score("math_x", rf"\boxed{{{gold}}}", gold) == 1.0
    assert compute_score("math_x", rf"\boxed{{{gold[:-1]})}}", gold) == -1.0  # half-open is another interval
    assert compute_scores(
        ["math_x"] * 3, [rf"\boxed{{{endpoint}}}", rf"\boxed{{{gold}}}", r"\boxed{[1, 2]}"], [gold] * 3
    ) == [-1.0, 1.0, 1.0 if gold.replace(" ", "") == "[1,2]" else -1.0]
    # the JSON text of a list of strings is one (odd) answer too, never a list
    assert compute_score("math_x", r"\boxed{0.5}", '["0.5", "2"]') == -1.0


def test_acceptable_answers_field_adds_answers():
    from klear.rewards import ACCEPTABLE_ANSWERS_FIELD, compute_score, compute_scores, gold_alternatives

    info = {"index": 0, ACCEPTABLE_ANSWERS_FIELD: ["1/2", "0.5"]}
    assert compute_score("math_x", r"\boxed{0.5}", "1/2", info) == 1.0
    assert compute_score("math_x", r"\boxed{0.4}", "1/2", info) == -1.0
    responses = [r"\boxed{0.5}", r"\boxed{[1, 2]}"]
    assert compute_scores(["math_x"] * 2, responses, ["1/2", "[1, 2]"], [info, None]) == [1.0, 1.0]
    assert gold_alternatives("7", {ACCEPTABLE_ANSWERS_FIELD: None}) is None  # an absent field (parquet null)
    assert gold_alternatives(["1", "2"], {ACCEPTABLE_ANSWERS_FIELD: ["2", "3"]}) == ["1", "2", "3"]
    assert gold_alternatives("[1, 2]") is None


# ------------------------------------------- a worker killed while holding a pool lock
def _hold_channel_lock_in_dead_process(pool) -> None:
    """Reproduce the wedge of issue 14: a process takes the workers' channel lock and is
    SIGKILLed before releasing it, as a pool worker killed by the OOM killer between
    receiving a task and acknowledging it (or while sending its result) would."""
    mutex = pool._pool._pool_manager.worker_manager.workers_channel.mutex
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        mutex.reader_mutex.acquire()
        mutex.writer_mutex.acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert not mutex.acquire(block=True, timeout=0.2), "lock should be held by the dead process"


def _score_in_thread(fn, limit_s: float):
    box: dict[str, object] = {}

    def target():
        t0 = time.monotonic()
        box["value"] = fn()
        box["elapsed"] = time.monotonic() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"scoring did not return within {limit_s:g} s (pool wedged)"
    return box["value"], box["elapsed"]


def test_pool_recovers_from_a_lock_held_by_a_killed_worker():
    pool = get_math_pool()
    assert math_score(boxed("0.5"), r"\frac{1}{2}") == 1.0  # pool up
    created = pool.pools_created
    _hold_channel_lock_in_dead_process(pool)
    res, elapsed = _score_in_thread(lambda: math_score_detailed(boxed("0.25"), r"\frac{1}{4}"), 30)
    assert (res.score, res.reason) == (1.0, "correct"), res
    assert elapsed < 15, elapsed
    assert pool.pools_created > created  # the wedged pool was replaced
    # the batch path recovers the same way
    _hold_channel_lock_in_dead_process(pool)
    golds = [r"\frac{1}{3}", "2^{10}", r"\sqrt{2}", "0.75"]
    answers = ["1/3", "1024", r"2^{1/2}", r"\frac{3}{4}"]
    res, elapsed = _score_in_thread(lambda: math_score_batch_detailed([boxed(a) for a in answers], golds), 30)
    assert [r.score for r in res] == [1.0] * 4, res
    assert elapsed < 15, elapsed


def test_scoring_under_random_worker_kills_stays_bounded():
    """Stress (issue 14): threads score while pool workers are SIGKILLed every 0.3 s.

    The killing lasts 8 s (as long as the scorers start new calls): on a loaded machine a
    replacement worker can take longer than 0.3 s to start, so calls may starve while it goes
    on. Every call must return in bounded time once it stops (never the 900 s queue limit),
    and correct answers then score +1 again within seconds. A correct answer never scores -1
    because of a kill (issue 20): +1 after the retries, or unscored (a judge timeout under this
    load stays a -1 by design)."""
    pool = get_math_pool()
    assert math_score(boxed("0.5"), r"\frac{1}{2}") == 1.0
    stop = threading.Event()
    durations: list[float] = []
    results: list = []

    def killer():
        import random

        rng = random.Random(0)
        kill_end = time.monotonic() + 8
        while not stop.is_set() and time.monotonic() < kill_end:
            try:
                pids = list(pool._pool._pool_manager.worker_manager.workers)
            except AttributeError:
                pids = []
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.3)

    def scorer(k: int):
        end = time.monotonic() + 8
        while time.monotonic() < end:
            t0 = time.monotonic()
            results.append(math_score_detailed(boxed(f"{k}/{k + 1}"), rf"\frac{{{k}}}{{{k + 1}}}", timeout_s=2.0))
            durations.append(time.monotonic() - t0)

    kth = threading.Thread(target=killer, daemon=True)
    kth.start()
    threads = [threading.Thread(target=scorer, args=(k,), daemon=True) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    stop.set()
    kth.join(5)
    assert not any(t.is_alive() for t in threads), "a scoring call hung under worker kills"
    assert durations and max(durations) < 60, max(durations)
    assert all(r.score == 1.0 or r.reason in ("unscored", "timeout") for r in results), [
        r for r in results if r.score != 1.0
    ]
    res, elapsed = _score_in_thread(lambda: math_score_detailed(boxed("0.2"), r"\frac{1}{5}"), 30)
    assert (res.score, elapsed < 10) == (1.0, True), (res, elapsed)


# ------------------------------------------------------- integer golds over 4,300 digits
def test_integer_golds_longer_than_python_str_limit_are_judged_in_any_order():
    """Python refuses int<->str conversion above 4,300 digits; the judge must not call such a
    gold invalid, and the verdict must not depend on which response came first."""
    gold = "7" * 4400
    wrong = "7" * 4399 + "8"
    # a wrong answer first (it reaches math-verify and, before the fix, flagged the gold invalid)
    first = math_score_detailed(boxed(wrong), gold)
    assert (first.score, first.reason) == (-1.0, "wrong"), first
    for answer, expected in [(gold, 1.0), (gold + ".0", 1.0), ("7" * 4401, -1.0), (wrong, -1.0)]:
        res = math_score_detailed(boxed(answer), gold)
        assert res.score == expected and res.reason != "invalid_gold", (answer[-4:], res)
    # a Python int gold of 5,001 digits (str(int) itself raises there)
    big = 10**5000 + 7
    ref = "1" + "0" * 4996 + "0007"
    assert math_score(boxed(ref), big) == 1.0
    assert math_score(boxed(ref[:-1] + "8"), big) == -1.0


def test_waiters_on_a_discarded_pool_resubmit_instead_of_waiting_for_the_queue_limit():
    """A task queued behind a busy worker of a pool that is then discarded (stopped) never runs there:
    its waiter must get ``pool_error`` within seconds, and ``run`` must redo it on a fresh pool."""
    from klear.rewards._timeout import STALL_CHECK_S, TimedProcessPool

    pool = TimedProcessPool(max_workers=1, name="test-discard")
    try:
        busy = pool.submit(time.sleep, (30,), timeout_s=60)
        queued = pool.submit(abs, (-3,), timeout_s=10)
        old = queued._klear_pool
        pool._discard(old)
        t0 = time.monotonic()
        outcome = pool.wait(queued, timeout_s=10, queue_limit_s=60)
        assert outcome.status == "pool_error" and time.monotonic() - t0 < STALL_CHECK_S + 5, outcome
        assert pool.run(abs, (-3,), timeout_s=10).value == 3  # a fresh pool does the work
        busy.cancel()
    finally:
        pool.shutdown(wait_s=2)


def test_tasks_orphaned_by_a_pool_that_broke_by_itself_are_resubmitted():
    """CI flake of 2026-12-05 (a scorer hung under worker kills): pebble marks a pool broken and aborts
    the tasks it has registered, but a task still in its scheduler queue is registered after the
    abort and never runs or finishes. Its waiter must get ``pool_error`` within seconds (not the
    900 s queue limit), and a running task whose result no loop will read must not wait out its
    limit either; ``run`` then redoes both on a fresh pool."""
    from pebble.pool.base_pool import PoolStatus

    from klear.rewards._timeout import STALL_CHECK_S, TimedProcessPool

    pool = TimedProcessPool(max_workers=1, name="test-orphan")
    try:
        running = pool.submit(time.sleep, (1.0,), timeout_s=30)
        queued = pool.submit(abs, (-3,), timeout_s=30)
        old = queued._klear_pool
        deadline = time.monotonic() + 10
        while not running.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.running()
        old._context.status = PoolStatus.ERROR  # what pebble's handle_broken_pool sets; its loops stop
        t0 = time.monotonic()
        outcomes = [pool.wait(f, timeout_s=30, queue_limit_s=120) for f in (running, queued)]
        assert [o.status for o in outcomes] == ["pool_error", "pool_error"], outcomes
        assert time.monotonic() - t0 < STALL_CHECK_S + 5
        assert pool.run(abs, (-3,), timeout_s=10).value == 3  # a fresh pool does the work
        assert old is not pool._pool
    finally:
        pool.shutdown(wait_s=2)


# ------------------------------------------------- pool failures: backoff, then unscored (issue 20)
def _kill_self_first(counter: str, kills: int) -> int:
    """Runs in a pool worker: SIGKILLs its own worker on the first *kills* calls (counted in a file), then
    returns the attempt number. A real worker death under the task, like the OOM killer's."""
    with open(counter, "a+") as f:
        f.seek(0)
        attempt = len(f.read())
        f.write("x")
    if attempt < kills:
        os.kill(os.getpid(), signal.SIGKILL)
    return attempt


@pytest.fixture()
def sleeps(monkeypatch):
    """The backoff waits of the reward pools, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr("klear.rewards._timeout._backoff_sleep", waits.append)
    return waits


def _failing_waits(monkeypatch, pool, fail: int, status: str = "crashed"):
    """Make the first *fail* waits on *pool* report *status* (a pool-level failure) after the task really ran;
    alternates ``crashed`` and ``pool_error`` when *status* is ``"mixed"``."""
    from klear.rewards._timeout import TaskOutcome

    real_wait = pool.wait
    calls = {"n": 0}

    def wait(future, **kw):
        outcome = real_wait(future, **kw)
        calls["n"] += 1
        if calls["n"] <= fail:
            st = status if status != "mixed" else ("crashed", "pool_error")[calls["n"] % 2]
            return TaskOutcome(st, detail=f"injected failure {calls['n']}")
        return outcome

    monkeypatch.setattr(pool, "wait", wait)
    return calls


def test_a_worker_killed_under_a_task_is_retried_with_backoff(tmp_path, sleeps):
    from klear.rewards._timeout import TimedProcessPool, retry_waits

    pool = TimedProcessPool(max_workers=1, name="test-kills")
    try:
        outcome = pool.run(_kill_self_first, (str(tmp_path / "n"), 3), timeout_s=10)
        assert (outcome.status, outcome.value) == ("ok", 3), outcome  # 3 real kills, then done
        assert sleeps == retry_waits()[:3] == [0.5, 1.0, 2.0]  # exponential backoff
        sleeps.clear()
        outcome = pool.run(_kill_self_first, (str(tmp_path / "m"), 100), timeout_s=10)
        assert outcome.status == "crashed" and f"after {len(retry_waits()) + 1} attempts" in outcome.detail
        assert sleeps == retry_waits() and sum(sleeps) <= 30.0  # bounded total wait
    finally:
        pool.shutdown(wait_s=2)


def test_retry_waits_schedule(monkeypatch):
    from klear.rewards import _timeout

    assert _timeout.retry_waits() == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert _timeout.retry_waits(0) == [] and _timeout.retry_waits(3.5) == [0.5, 1.0, 2.0]
    monkeypatch.setattr(_timeout, "RETRY_TOTAL_WAIT_S", 2.0)
    assert _timeout.retry_waits() == [0.5, 1.0]


def test_pool_failures_never_score_a_correct_answer_wrong(monkeypatch, sleeps):
    """Fault injection: the first attempts of every comparison die (worker killed / pool broken); correct answers
    still score +1 after the backoff, and what fails on every attempt is unscored (nan), never -1."""
    from klear.rewards._timeout import retry_waits

    pool = get_math_pool()
    assert math_score(boxed("0.5"), r"\frac{1}{2}") == 1.0  # pool up
    # single call: 3 failed attempts, then the verdict
    _failing_waits(monkeypatch, pool, fail=3, status="mixed")
    res = math_score_detailed(boxed("0.5"), r"\frac{1}{2}")
    assert (res.score, res.reason) == (1.0, "correct"), res
    assert sleeps == [0.5, 1.0, 2.0]
    # a wrong answer is still wrong after the retries
    sleeps.clear()
    _failing_waits(monkeypatch, pool, fail=2)
    assert math_score_detailed(boxed("0.4"), r"\frac{1}{2}").reason == "wrong"
    # batch: 6 comparisons, the first 8 attempts fail -> two retry rounds for the whole batch, not one per item
    sleeps.clear()
    golds = [r"\frac{1}{2}", r"\frac{1}{3}", "2^{10}", r"\sqrt{2}", "0.75", r"\frac{2}{5}"]
    answers = ["0.5", "1/3", "1024", r"2^{1/2}", r"\frac{3}{4}", "0.4"]
    _failing_waits(monkeypatch, pool, fail=8, status="mixed")
    res = math_score_batch_detailed([boxed(a) for a in answers], golds)
    assert [r.score for r in res] == [1.0] * 6, res
    assert sleeps == [0.5, 1.0]
    # every attempt fails: unscored (nan, reason "unscored"), after the whole schedule, for single and batch calls
    # ("crashed" only from here: each injected pool_error really rebuilds the pool, which costs seconds)
    sleeps.clear()
    _failing_waits(monkeypatch, pool, fail=10**6)
    res1 = math_score_detailed(boxed("0.5"), r"\frac{1}{2}")
    assert math.isnan(res1.score) and res1.reason == "unscored" and not res1.correct, res1
    assert f"after {len(retry_waits()) + 1} attempts" in res1.detail
    assert sleeps == retry_waits()
    sleeps.clear()
    res = math_score_batch_detailed([boxed(a) for a in answers] + [boxed("7")], golds + ["7"])
    assert all(math.isnan(r.score) and r.reason == "unscored" for r in res[:6]), res
    assert (res[6].score, res[6].reason) == (1.0, "exact_match")  # decided without the pool
    assert sleeps == retry_waits()  # one schedule for the whole batch
    # the registry and its list-of-answers adapter pass nan through; no -1 anywhere
    sleeps.clear()
    scores = compute_scores(["math_x"] * 3, [boxed("0.5"), boxed("2"), boxed("3")], ["1/2", ["x+1", "2"], ["1", "x+3"]])
    assert scores[1] == 1.0 and math.isnan(scores[0]) and math.isnan(scores[2]), scores  # "2": exact match
    assert math.isnan(compute_score("math_dapo", boxed("0.5"), "1/2"))


def test_a_judge_timeout_is_not_retried_and_stays_wrong(monkeypatch, sleeps):
    """A timeout is the answer's (too hard to compare): -1 as before, no retry."""
    pool = get_math_pool()
    _failing_waits(monkeypatch, pool, fail=1, status="timeout")
    res = math_score_detailed(boxed("0.5"), r"\frac{1}{2}")
    assert (res.score, res.reason) == (-1.0, "timeout") and sleeps == []


def _use_the_math_pool() -> None:
    """A spawned child's work: one task on the math scorer's worker pool, then return (the process must exit)."""
    assert get_math_pool().run(abs, (-1,), timeout_s=30).value == 1


def test_a_multiprocessing_child_that_used_the_pool_exits():
    """atexit never runs in a multiprocessing child, which joins its non-daemon children (pebble's workers) before
    exiting: without the pool's exit hook it waited for them forever (klear experiment's run processes hung)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_use_the_math_pool)
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    child.kill()
    child.join()
    assert not alive, "the child never exited: the reward pool's workers kept it waiting"
    assert child.exitcode == 0
