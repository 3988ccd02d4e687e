"""Binary math reward with math-verify (Klear-Reasoner, Sec. 3.2.4).

A response earns ``+1.0`` when its final answer is mathematically equivalent to the
ground truth and ``-1.0`` otherwise (Klear's code uses +1/-1, not 1/0). Everything that
is not a verified correct answer is ``-1.0``: wrong, missing, truncated, unparseable,
timed out, or scored against an unusable ground truth. A truncated response therefore
never scores better than a wrong one.

Pipeline (:func:`math_score_detailed`):

1. **Think block.** If the response contains ``</think>``, only the text after the LAST
   ``</think>`` is searched for the answer. A response that opens ``<think>`` and never
   closes it (the last ``<think>`` comes after the last ``</think>``, or there is no
   ``</think>``) was cut off while thinking: ``-1`` (reason ``"unclosed_think"``), in
   every mode. With ``require_think=True`` a response without ``</think>`` scores ``-1``
   (reason ``"missing_think"``); the opening ``<think>`` is optional because many chat
   templates put it in the prompt.
2. **Final answer** (:func:`extract_last_boxed`). The answer is the content of the LAST
   top-level ``\\boxed{...}`` / ``\\fbox{...}`` (``\\boxed 18`` also works), found with a
   brace-matching scan (escaped ``\\{``/``\\}`` do not count). Earlier boxes are ignored
   (self-correction: only the last counts). If the last box is never closed (truncated
   output) the answer is missing, even if an earlier box was complete. No box, an
   unclosed last box or an empty box all score ``-1``.
3. **Fast path.** When the ground truth is a plain number (``-?\\d+(\\.\\d+)?``) and the
   boxed content is the identical string, the answer is correct without further work.
4. **math-verify**, in a worker process with a wall-clock limit (see ``_timeout``):
   the gold is parsed as ``\\boxed{<gold>}`` and the prediction as ``\\boxed{<answer>}``,
   both with ``[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]``;
   then ``verify(gold, pred)`` is called GOLD FIRST (verify is not symmetric), with
   ``float_rounding=6`` and ``numeric_precision=100`` (see :data:`NUMERIC_PRECISION`)
   and math-verify's signal-based timeouts disabled (``parsing_timeout=None``,
   ``timeout_seconds=None``): the worker pool enforces the limit instead, so scoring
   works from any thread. A timeout, a crashed worker or any exception scores ``-1``
   and logs a warning; nothing is raised to the caller.
5. **Ground truth** that is ``None``/empty/not a string or number, or from which
   math-verify extracts no expression (only a raw-string fallback or nothing), is a
   DATA error: a warning naming it is logged once per distinct gold and the reward is
   ``-1`` for every response (never ``+1``, not even for an identical string).
"""

from __future__ import annotations

import logging
import numbers
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from klear.rewards._timeout import TaskOutcome, TimedProcessPool, limit_worker_memory

logger = logging.getLogger(__name__)

CORRECT_REWARD = 1.0
WRONG_REWARD = -1.0
#: Default wall-clock limit (seconds) for parsing + verifying one answer.
DEFAULT_TIMEOUT_S = 5.0
#: math-verify ``float_rounding``: decimals kept when a float is compared (0.333333 == 1/3).
FLOAT_ROUNDING = 6
#: math-verify ``numeric_precision``. Its default (15) compares non-atomic expressions with
#: ``(a - b).evalf(n=15, chop=True) == 0`` and ``chop`` zeroes any difference below
#: roughly 1e-17, so ``1/2^{99}`` "equals" ``1/2^{98}``. At 100 digits only differences
#: below roughly 1e-100 are chopped.
NUMERIC_PRECISION = 100

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Reason = Literal[
    "correct",  # math-verify says equivalent
    "exact_match",  # fast path: identical plain-number strings
    "wrong",  # math-verify says not equivalent
    "unparseable_answer",  # math-verify extracted nothing from the boxed answer
    "no_box",
    "unclosed_box",
    "empty_box",
    "missing_think",
    "unclosed_think",
    "invalid_response",  # the response is not a string
    "invalid_gold",  # data error, see module docstring
    "timeout",
    "error",  # worker crashed / raised / pool failure
]


# ---------------------------------------------------------------------------- results
@dataclass(frozen=True)
class MathScoreResult:
    """Outcome of scoring one response.

    Attributes:
        score: ``1.0`` (correct) or ``-1.0`` (anything else).
        reason: why, one of :data:`Reason`.
        extracted: the final boxed answer taken from the response (``None`` if none).
        detail: extra diagnostic text (exception, timeout), may be empty.
    """

    score: float
    reason: str
    extracted: str | None = None
    detail: str = ""

    @property
    def correct(self) -> bool:
        return self.score > 0

    def __float__(self) -> float:
        return float(self.score)


def _wrong(reason: str, extracted: str | None = None, detail: str = "") -> MathScoreResult:
    return MathScoreResult(WRONG_REWARD, reason, extracted, detail)


# ------------------------------------------------------------------------ extraction
@dataclass(frozen=True)
class BoxedAnswer:
    """The last top-level box of a text: ``content`` (stripped) and ``status``.

    ``status`` is ``"ok"``, ``"no_box"``, ``"unclosed"`` (the last box runs to the end of
    the text without its closing brace) or ``"empty"``; ``content`` is set only for ``"ok"``.
    """

    content: str | None
    status: Literal["ok", "no_box", "unclosed", "empty"]


_BOX_CMD_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _matching_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at *open_idx*, or None. Skips ``\\x`` escapes."""
    depth = 0
    i, n = open_idx, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_last_boxed(text: str) -> BoxedAnswer:
    """Return the content of the last top-level ``\\boxed``/``\\fbox`` in *text*.

    Boxes are scanned left to right with brace matching, so a box nested inside another
    belongs to the outer one. ``\\boxed{...}`` and ``\\fbox{...}`` take a braced group;
    ``\\boxed 18`` (no brace) takes the text up to the next ``$`` or newline. A box whose
    closing brace never comes (truncated output) is the last box and makes the result
    ``"unclosed"``, whatever came before it.

    Examples:
        >>> extract_last_boxed(r"\\boxed{1} then \\boxed{\\frac{1}{2}}").content
        '\\\\frac{1}{2}'
        >>> extract_last_boxed(r"\\boxed{1} then \\boxed{\\frac{1}").status
        'unclosed'
    """
    last = BoxedAnswer(None, "no_box")
    pos, n = 0, len(text)
    while True:
        m = _BOX_CMD_RE.search(text, pos)
        if m is None:
            return last
        i = m.end()
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return BoxedAnswer(None, "unclosed")
        if text[i] == "{":
            end = _matching_brace(text, i)
            if end is None:
                return BoxedAnswer(None, "unclosed")
            content = text[i + 1 : end]
            pos = end + 1
        else:  # "\boxed 18": one token, up to the end of the math span / line
            j = i
            while j < n and text[j] not in "$\n":
                j += 1
            content = text[i:j]
            pos = max(j, i + 1)
        content = content.strip()
        last = BoxedAnswer(content, "ok") if content else BoxedAnswer(None, "empty")


def answer_region(response: str, *, require_think: bool = False) -> tuple[str | None, str | None]:
    """Split off the part of *response* that may hold the final answer.

    Returns ``(region, None)`` or ``(None, reason)`` with reason ``"unclosed_think"`` or
    ``"missing_think"`` (see the module docstring, step 1).
    """
    close_idx = response.rfind(THINK_CLOSE)
    open_idx = response.rfind(THINK_OPEN)
    if close_idx == -1:
        if open_idx != -1:
            return None, "unclosed_think"
        if require_think:
            return None, "missing_think"
        return response, None
    if open_idx > close_idx:
        return None, "unclosed_think"
    return response[close_idx + len(THINK_CLOSE) :], None


def _clean(answer: str) -> str:
    """Strip whitespace and one trailing sentence period (``17.`` -> ``17``)."""
    s = answer.strip()
    if s.endswith(".") and not s.endswith("\\.") and len(s) > 1:
        s = s[:-1].rstrip()
    return s


_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


# ------------------------------------------------------------------ worker-side code
_WORKER_CONFIG = None


def _worker_init(cap_memory: bool = False) -> None:
    """Runs once in each pool worker: import math-verify, silence its warnings about the
    signal timeouts we disable on purpose (the pool enforces the limit) and, in pool
    workers, cap the address space (see ``_timeout.limit_worker_memory``)."""
    global _WORKER_CONFIG
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    _WORKER_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    if cap_memory:
        limit_worker_memory()


def _has_expression(parsed: list) -> bool:
    return any(not isinstance(x, str) for x in parsed)


def verify_answer(gold: str, answer: str, float_rounding: int, numeric_precision: int) -> str:
    """Parse and compare in the CURRENT process, without any timeout.

    Returns ``"correct"``, ``"wrong"``, ``"unparseable_answer"`` or ``"invalid_gold"``.
    Used inside pool workers; call it directly only on trusted input (it can hang).
    """
    from math_verify import parse, verify

    if _WORKER_CONFIG is None:
        _worker_init()
    gold_parsed = parse("\\boxed{" + gold + "}", _WORKER_CONFIG, parsing_timeout=None)
    if not _has_expression(gold_parsed):
        return "invalid_gold"
    pred_parsed = parse("\\boxed{" + answer + "}", _WORKER_CONFIG, parsing_timeout=None)
    if not pred_parsed:
        return "unparseable_answer"
    ok = verify(  # GOLD FIRST: verify is not symmetric
        gold_parsed,
        pred_parsed,
        float_rounding=float_rounding,
        numeric_precision=numeric_precision,
        timeout_seconds=None,
    )
    if ok:
        return "correct"
    return "wrong" if _has_expression(pred_parsed) else "unparseable_answer"


# ------------------------------------------------------------------ parent-side code
_POOL = TimedProcessPool(initializer=_worker_init, initargs=(True,), name="klear-math-reward")

_invalid_golds: set[str] = set()  # cleaned string golds math-verify cannot parse
_warned_golds: set[str] = set()  # keys already warned about (strings and non-strings)
_invalid_lock = threading.Lock()


def _reset_lock_after_fork() -> None:  # pragma: no cover - runs in forked children
    global _invalid_lock
    _invalid_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def get_math_pool() -> TimedProcessPool:
    """The shared worker pool used by the math scorer."""
    return _POOL


def configure_math_pool(*, max_workers: int | None = None) -> None:
    """Set the number of math-verify worker processes (default ``min(8, cpu_count)`` or
    ``KLEAR_REWARD_WORKERS``). Queued work on a resized pool still completes."""
    if max_workers is not None:
        _POOL.resize(max_workers)


def shutdown_math_pool() -> None:
    """Stop the math-verify workers now; the next call starts a new pool."""
    _POOL.shutdown()


def _short(s: object, limit: int = 200) -> str:
    r = repr(s)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _flag_invalid_gold(gold: object, why: str) -> None:
    """Record a bad ground truth and log a data-error warning once per distinct gold."""
    key = ("s:" + gold) if isinstance(gold, str) else ("o:" + repr(gold))
    with _invalid_lock:
        if isinstance(gold, str):
            _invalid_golds.add(gold)
        if key in _warned_golds:
            return
        _warned_golds.add(key)
    logger.warning(
        "math reward: unusable ground truth %s (%s); every response to it scores -1. "
        "This is a data error: fix or drop the example.",
        _short(gold),
        why,
    )


def _gold_string(ground_truth: object) -> str | None:
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Number) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    return None


@dataclass(frozen=True)
class _Job:
    gold: str
    answer: str  # cleaned boxed content sent to math-verify
    extracted: str  # raw boxed content, for the result


def _prepare(solution_str: object, ground_truth: object, require_think: bool) -> MathScoreResult | _Job:
    """All the cheap, in-process checks. Returns a final result or a job for the pool."""
    gold = _gold_string(ground_truth)
    if gold is None or not gold.strip():
        _flag_invalid_gold(ground_truth, "empty, or not a string or number")
        return _wrong("invalid_gold")
    gold_clean = _clean(gold)
    if gold_clean in _invalid_golds:  # already known bad: skip the worker
        return _wrong("invalid_gold")
    if not isinstance(solution_str, str):
        return _wrong("invalid_response")
    region, reason = answer_region(solution_str, require_think=require_think)
    if region is None:
        return _wrong(reason or "missing_think")
    boxed = extract_last_boxed(region)
    if boxed.status != "ok" or boxed.content is None:
        return _wrong({"no_box": "no_box", "unclosed": "unclosed_box"}.get(boxed.status, "empty_box"))
    answer = _clean(boxed.content)
    if not answer:
        return _wrong("empty_box", boxed.content)
    if answer == gold_clean and _PLAIN_NUMBER_RE.fullmatch(gold_clean):
        return MathScoreResult(CORRECT_REWARD, "exact_match", boxed.content)
    return _Job(gold_clean, answer, boxed.content)


def _finish(job: _Job, outcome: TaskOutcome) -> MathScoreResult:
    if outcome.ok:
        verdict = outcome.value
        if verdict == "correct":
            return MathScoreResult(CORRECT_REWARD, "correct", job.extracted)
        if verdict == "invalid_gold":
            _flag_invalid_gold(job.gold, "math-verify extracts no expression from it")
            return _wrong("invalid_gold", job.extracted)
        if verdict in ("wrong", "unparseable_answer"):
            return _wrong(verdict, job.extracted)
        return _wrong("error", job.extracted, f"unexpected verdict {verdict!r}")
    reason = "timeout" if outcome.status == "timeout" else "error"
    logger.warning(
        "math reward: %s (%s) while verifying answer %s against gold %s; scoring -1",
        outcome.status,
        outcome.detail,
        _short(job.answer),
        _short(job.gold),
    )
    return _wrong(reason, job.extracted, f"{outcome.status}: {outcome.detail}")


def _check_timeout(timeout_s: float) -> float:
    if timeout_s is None or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def math_score_detailed(
    solution_str: str,
    ground_truth: str,
    *,
    require_think: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> MathScoreResult:
    """Score one response and say why (see :func:`math_score` for the rules).

    Returns:
        :class:`MathScoreResult` with ``score`` 1.0 or -1.0, ``reason``, the extracted
        boxed answer and diagnostics.

    Raises:
        ValueError: ``timeout_s`` is not positive. Nothing else: every failure of the
        verification (timeout, crash, exception) becomes ``-1`` with a logged warning.
    """
    timeout_s = _check_timeout(timeout_s)
    try:
        prepared = _prepare(solution_str, ground_truth, require_think)
    except Exception as exc:  # noqa: BLE001 - never crash the trainer
        logger.warning("math reward: unexpected error %r; scoring -1", exc)
        return _wrong("error", detail=repr(exc))
    if isinstance(prepared, MathScoreResult):
        return prepared
    outcome = _POOL.run(
        verify_answer,
        (prepared.gold, prepared.answer, FLOAT_ROUNDING, NUMERIC_PRECISION),
        timeout_s=timeout_s,
    )
    return _finish(prepared, outcome)


def math_score(
    solution_str: str,
    ground_truth: str,
    *,
    require_think: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """Klear-Reasoner's binary math reward (paper Sec. 3.2.4, via math-verify).

    Args:
        solution_str: the model's response (decoded text, prompt excluded).
        ground_truth: the reference answer, e.g. ``"18"`` or ``"\\frac{1}{2}"`` (a number
            is accepted too). It is wrapped as ``\\boxed{...}`` before parsing.
        require_think: if True, a response without a closing ``</think>`` scores -1
            (the paper penalises answers not preceded by a think block).
        timeout_s: wall-clock limit for math-verify (parsing + comparison), enforced in a
            worker process, so it works from any thread.

    Returns:
        ``1.0`` if the last ``\\boxed{}`` answer (after the last ``</think>``) is
        equivalent to ``ground_truth`` according to ``math_verify.verify(gold, pred)``;
        ``-1.0`` otherwise: wrong, no/empty/unclosed box, unclosed or (when required)
        missing think block, unparseable answer, unusable ground truth (logged once as a
        data error), timeout or worker failure (logged).

    Raises:
        ValueError: ``timeout_s`` is not positive. Scoring failures never raise.

    Thread-safe; the first call starts the worker pool (about a second with ``spawn``).
    """
    return math_score_detailed(
        solution_str, ground_truth, require_think=require_think, timeout_s=timeout_s
    ).score


def math_score_batch_detailed(
    solution_strs: Sequence[str],
    ground_truths: Sequence[str],
    *,
    require_think: bool | Sequence[bool] = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_workers: int | None = None,
) -> list[MathScoreResult]:
    """Score many responses in parallel on the worker pool, preserving order.

    Each item is independent: its own time limit, its own failure handling; one
    pathological answer never changes another item's result. ``require_think`` may be a
    single bool or one per item. ``max_workers`` resizes the shared pool (see
    :func:`configure_math_pool`).

    Raises:
        ValueError: the sequences differ in length, or ``timeout_s`` is not positive.
    """
    timeout_s = _check_timeout(timeout_s)
    n = len(solution_strs)
    if len(ground_truths) != n:
        raise ValueError(f"got {n} responses but {len(ground_truths)} ground truths")
    if isinstance(require_think, bool):
        think_flags: Sequence[bool] = [require_think] * n
    else:
        think_flags = list(require_think)
        if len(think_flags) != n:
            raise ValueError(f"got {n} responses but {len(think_flags)} require_think flags")
    if max_workers is not None:
        configure_math_pool(max_workers=max_workers)

    results: list[MathScoreResult | None] = [None] * n
    pending: list[tuple[int, _Job, object]] = []
    for i in range(n):
        try:
            prepared = _prepare(solution_strs[i], ground_truths[i], bool(think_flags[i]))
        except Exception as exc:  # noqa: BLE001
            logger.warning("math reward: unexpected error %r on item %d; scoring -1", exc, i)
            prepared = _wrong("error", detail=repr(exc))
        if isinstance(prepared, MathScoreResult):
            results[i] = prepared
            continue
        args = (prepared.gold, prepared.answer, FLOAT_ROUNDING, NUMERIC_PRECISION)
        try:
            future = _POOL.submit(verify_answer, args, timeout_s=timeout_s)
        except RuntimeError:
            future = None  # retried below with run()
        pending.append((i, prepared, future))

    for i, job, future in pending:
        outcome = (
            _POOL.wait(future, timeout_s=timeout_s)
            if future is not None
            else TaskOutcome("pool_error", detail="could not schedule")
        )
        if outcome.status == "pool_error":
            outcome = _POOL.run(
                verify_answer,
                (job.gold, job.answer, FLOAT_ROUNDING, NUMERIC_PRECISION),
                timeout_s=timeout_s,
            )
        results[i] = _finish(job, outcome)
    return [r if r is not None else _wrong("error") for r in results]


def math_score_batch(
    solution_strs: Sequence[str],
    ground_truths: Sequence[str],
    *,
    require_think: bool | Sequence[bool] = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_workers: int | None = None,
) -> list[float]:
    """Batch form of :func:`math_score`: a list of 1.0 / -1.0 in input order.

    See :func:`math_score_batch_detailed` for parallelism and errors.
    """
    return [
        r.score
        for r in math_score_batch_detailed(
            solution_strs,
            ground_truths,
            require_think=require_think,
            timeout_s=timeout_s,
            max_workers=max_workers,
        )
    ]
