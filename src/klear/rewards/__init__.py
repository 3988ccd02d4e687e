"""Verifiable rewards for Klear-Reasoner RL (paper Sec. 3.2.4), with a verl-style entry point.

:func:`compute_score` / :func:`compute_scores` dispatch on ``data_source`` through a
small prefix registry. The longest registered prefix that ``data_source`` starts with
wins (case-sensitive). Registered here:

- ``"math"`` -> :func:`klear.rewards.math_reward.math_score` (Klear's
  ``math_longcot_math_verify``, ``math_dapo``, ``math500``, ...). For data sources whose
  name contains ``"longcot"`` the think block is required by default (Klear's
  ``is_longcot=True``); pass ``require_think=`` to override. The format rule (one closed
  think block, then the answer) is :mod:`klear.rewards.think_format`, shared with code.
  Several acceptable answers come only from a real list ground truth or
  ``extra_info["acceptable_answers"]`` (:mod:`klear.rewards.gold`), never from a string's JSON text.

**Unscored.** A reward that could not be computed is ``nan``
(:data:`~klear.rewards.correctness.UNSCORED_REWARD`; test with :func:`is_unscored`), never the
wrong-answer reward: a math or code comparison the worker pool could not run after its backoff
retries (:mod:`klear.rewards._timeout`), or an exception raised by a scorer without a batch form.
A judge timeout (the answer is too hard to compare) or an exception of the comparison itself is a
verdict on the answer and stays ``-1`` (code: failed tests).

Other rewards (e.g. code) add themselves with :func:`register_scorer`. A scorer is
``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float`` and
may come with a batch form ``batch_fn(data_sources, solution_strs, ground_truths,
extra_infos, *, max_workers=None, **kwargs) -> list[float]``.

verl: point ``custom_reward_function.path`` at this module with ``name: compute_score``
(naive/prime reward managers) or ``name: compute_scores`` (batch reward manager; the
keyword names match). Extra keyword arguments (``reward_kwargs``) are passed to the
scorer; the math scorer uses ``require_think`` and ``timeout_s`` and ignores the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from klear.rewards.correctness import CORRECT_REWARD, UNSCORED_REWARD, WRONG_REWARD, is_correct, is_unscored
from klear.rewards.gold import ACCEPTABLE_ANSWERS_FIELD, gold_alternatives
from klear.rewards.math_reward import (
    DEFAULT_TIMEOUT_S,
    BoxedAnswer,
    MathScoreResult,
    configure_math_pool,
    extract_last_boxed,
    final_answer,
    math_score,
    math_score_batch,
    math_score_batch_detailed,
    math_score_detailed,
    shutdown_math_pool,
)
from klear.rewards.think_format import requires_think

logger = logging.getLogger(__name__)

ScoreFn = Callable[..., float]
BatchScoreFn = Callable[..., list]
ExtractFn = Callable[..., "str | None"]


@dataclass(frozen=True)
class _Scorer:
    prefix: str
    fn: ScoreFn
    batch_fn: BatchScoreFn | None
    extract_fn: ExtractFn | None = None


_REGISTRY: dict[str, _Scorer] = {}
_REGISTRY_LOCK = threading.Lock()


def register_scorer(
    prefix: str,
    fn: ScoreFn,
    *,
    batch_fn: BatchScoreFn | None = None,
    extract_fn: ExtractFn | None = None,
    overwrite: bool = False,
) -> None:
    """Route every ``data_source`` starting with *prefix* to *fn*.

    Args:
        prefix: non-empty data-source prefix, e.g. ``"math"`` or ``"code"``.
        fn: ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
            returning a float reward.
        batch_fn: optional batch form used by :func:`compute_scores`:
            ``batch_fn(data_sources, solution_strs, ground_truths, extra_infos, *,
            max_workers=None, **kwargs) -> list[float]`` in input order. Without it
            :func:`compute_scores` calls *fn* from a thread pool.
        extract_fn: optional ``extract_fn(solution_str, *, require_think) -> str | None``: what *fn* reads
            from a response (the final answer, the program), for :func:`extract_answer`.
        overwrite: allow replacing an existing registration of the same prefix.

    Raises:
        ValueError: empty prefix, or prefix already registered and not ``overwrite``.
        TypeError: *fn* (or *batch_fn*) is not callable.
    """
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("prefix must be a non-empty string")
    if not callable(fn) or any(f is not None and not callable(f) for f in (batch_fn, extract_fn)):
        raise TypeError("fn, batch_fn and extract_fn must be callable")
    with _REGISTRY_LOCK:
        if prefix in _REGISTRY and not overwrite:
            raise ValueError(f"a scorer is already registered for prefix {prefix!r}")
        _REGISTRY[prefix] = _Scorer(prefix, fn, batch_fn, extract_fn)


def unregister_scorer(prefix: str) -> None:
    """Remove the scorer for *prefix* (no error if absent)."""
    with _REGISTRY_LOCK:
        _REGISTRY.pop(prefix, None)


def registered_prefixes() -> list[str]:
    """Registered data-source prefixes, sorted."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def _resolve(data_source: str) -> _Scorer:
    with _REGISTRY_LOCK:
        matches = [s for p, s in _REGISTRY.items() if isinstance(data_source, str) and data_source.startswith(p)]
        known = sorted(_REGISTRY)
    if not matches:
        raise ValueError(f"no reward scorer for data_source {data_source!r}; registered prefixes: {known}")
    return max(matches, key=lambda s: len(s.prefix))


def get_scorer(data_source: str) -> ScoreFn:
    """The scorer function :func:`compute_score` would use for *data_source*.

    Raises:
        ValueError: no registered prefix matches (the message lists the prefixes).
    """
    return _resolve(data_source).fn


def extract_answer(response: object, data_source: str, *, require_think: bool | None = None) -> str | None:
    """What the judge of *data_source* reads from *response*: the composed rule, the data source's think
    rule (:func:`~klear.rewards.think_format.requires_think`) then its scorer's extraction (math: the raw
    content of the last ``\\boxed{}``, :func:`~klear.rewards.math_reward.final_answer`; code: the program,
    :func:`~klear.rewards.code.extract.extract_code`). For reports and maj@n; the verdict is the scorer's.

    Returns:
        The extracted text, or ``None``: the response breaks the format, has nothing to extract, is not a
        string, or its scorer registered no ``extract_fn``.

    Raises:
        ValueError: no registered prefix matches *data_source*.
    """
    scorer = _resolve(data_source)
    if scorer.extract_fn is None or not isinstance(response, str):
        return None
    return scorer.extract_fn(response, require_think=requires_think(data_source, require_think))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> float:
    """verl-compatible reward for one response.

    Args:
        data_source: dataset tag, e.g. ``"math_longcot_math_verify"``; selects the scorer
            by prefix (see module docstring).
        solution_str: the decoded response.
        ground_truth: the reference answer (``reward_model.ground_truth``). Math: one answer, or a
            real list of acceptable answers; a string is never split (``"[1, 2]"`` is an interval),
            see :mod:`klear.rewards.gold`.
        extra_info: verl's per-row extra info, passed through to the scorer (math: its
            ``acceptable_answers`` list adds acceptable answers).
        **kwargs: scorer options (math: ``require_think``, ``timeout_s``; code: ``reward_mode``
            ``"soft"``/``"hard"``, ``require_think``, ``time_limit_s`` per test (default 6),
            ``timeout_s`` per response (default 120), ``stop_on_first_failure``). Options a
            scorer does not know are ignored (verl passes one set of options to every scorer),
            so check the spelling.

    Returns:
        The scorer's float reward; for math ``1.0`` (correct) or ``-1.0`` (anything
        else), see :func:`klear.rewards.math_reward.math_score`; ``nan`` when unscored
        (module docstring).

    Raises:
        ValueError: no registered prefix matches ``data_source``.
    """
    return float(_resolve(data_source).fn(data_source, solution_str, ground_truth, extra_info, **kwargs))


def compute_scores(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    *,
    max_workers: int | None = None,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> list[float]:
    """Batch form of :func:`compute_score` (verl ``BatchRewardManager`` signature).

    Items are grouped by scorer and scored in parallel (math: on the worker-process
    pool); results come back in input order. One failing item never affects another:
    an item the judge could not score is ``nan`` (unscored, see the module docstring),
    and so is an item whose scorer (one without a batch form) raised (logged).

    Args:
        data_sources, solution_strs, ground_truths: equal-length sequences.
        extra_infos: optional, same length.
        max_workers: parallelism (math: size of the shared worker pool).
        timeout_s: per-item time limit passed to the scorers (default: each scorer's).
        **kwargs: scorer options, as for :func:`compute_score`.

    Raises:
        ValueError: sequences of different lengths, or a data source with no scorer
            (checked for every item before any work is done).
    """
    n = len(data_sources)
    if len(solution_strs) != n or len(ground_truths) != n:
        raise ValueError(
            f"length mismatch: {n} data_sources, {len(solution_strs)} solution_strs, {len(ground_truths)} ground_truths"
        )
    if extra_infos is None:
        extra_infos = [None] * n
    elif len(extra_infos) != n:
        raise ValueError(f"length mismatch: {n} data_sources, {len(extra_infos)} extra_infos")
    if timeout_s is not None:
        kwargs["timeout_s"] = timeout_s

    groups: dict[str, tuple[_Scorer, list[int]]] = {}
    for i, ds in enumerate(data_sources):
        scorer = _resolve(ds)
        groups.setdefault(scorer.prefix, (scorer, []))[1].append(i)

    out: list[float] = [WRONG_REWARD] * n
    for scorer, idx in groups.values():
        if scorer.batch_fn is not None:
            scores = scorer.batch_fn(
                [data_sources[i] for i in idx],
                [solution_strs[i] for i in idx],
                [ground_truths[i] for i in idx],
                [extra_infos[i] for i in idx],
                max_workers=max_workers,
                **kwargs,
            )
            if len(scores) != len(idx):
                raise RuntimeError(f"scorer {scorer.prefix!r} returned {len(scores)} scores for {len(idx)} items")
            for i, s in zip(idx, scores):
                out[i] = float(s)
            continue

        def _one(i: int, scorer: _Scorer = scorer) -> float:
            try:
                return float(scorer.fn(data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i], **kwargs))
            except Exception:  # isolate items; a score that could not be computed is not a wrong answer
                logger.exception("reward scorer %r failed on item %d; unscored (nan)", scorer.prefix, i)
                return UNSCORED_REWARD

        with ThreadPoolExecutor(max_workers=max_workers or min(32, len(idx))) as ex:
            for i, s in zip(idx, ex.map(_one, idx)):
                out[i] = s
    return out


def require_scored(rewards: Sequence[float], what: Callable[[int], str] = lambda i: f"item {i}") -> None:
    """For callers that need a verdict for every item (data and SFT filters, held-out evaluation):
    raise when the judge could not score one.

    Args:
        rewards: scores from :func:`compute_scores`.
        what: names item ``i`` in the message (e.g. its file and row).

    Raises:
        RuntimeError: one line naming the first unscored item and how many there are.
    """
    bad = [i for i, r in enumerate(rewards) if is_unscored(r)]
    if bad:
        raise RuntimeError(
            f"{what(bad[0])}: the reward judge could not score this response ({len(bad)} of {len(rewards)} "
            "unscored: its worker processes kept failing after the retries; see the warnings above); "
            "rerun when the machine is healthy"
        )


# ------------------------------------------------------------------ math registration


def _math_entry(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **options: Any
) -> float:
    """Registry adapter for :func:`math_score`: ``options`` are ``require_think`` (default: the data source's
    rule, :func:`~klear.rewards.think_format.requires_think`) and ``timeout_s``; other keywords are ignored.
    Several acceptable answers (a real list, or ``extra_info["acceptable_answers"]``:
    :func:`klear.rewards.gold.gold_alternatives`; never a string's JSON text) score +1 when any of them matches."""
    if gold_alternatives(ground_truth, extra_info) is not None:
        return _math_batch_entry([data_source], [solution_str], [ground_truth], [extra_info], **options)[0]
    think = requires_think(data_source, options.get("require_think"))
    return math_score(
        solution_str, ground_truth, require_think=think, timeout_s=options.get("timeout_s", DEFAULT_TIMEOUT_S)
    )


def _math_batch_entry(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None],
    *,
    max_workers: int | None = None,
    require_think: bool | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **_ignored: Any,
) -> list[float]:
    """Registry batch adapter for :func:`math_score_batch`; an item with several acceptable answers
    (:func:`klear.rewards.gold.gold_alternatives`) is expanded into one check per answer and scores the
    best of them: correct if any check is, else unscored (nan) if any check is, else wrong."""
    owner, sols, golds, thinks = [], [], [], []
    for i, (ds, sol, gt, info) in enumerate(zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)):
        for gold in gold_alternatives(gt, info) or [gt]:
            owner.append(i)
            sols.append(sol)
            golds.append(gold)
            thinks.append(requires_think(ds, require_think))
    flat = math_score_batch(sols, golds, require_think=thinks, timeout_s=timeout_s, max_workers=max_workers)
    out = [WRONG_REWARD] * len(solution_strs)
    for i, score in zip(owner, flat):
        if is_unscored(score):
            if not is_correct(out[i]):
                out[i] = UNSCORED_REWARD
        elif is_unscored(out[i]):
            out[i] = score if is_correct(score) else out[i]
        else:
            out[i] = max(out[i], score)
    return out


register_scorer(
    "math", _math_entry, batch_fn=_math_batch_entry, extract_fn=lambda response, **kw: final_answer(response, **kw)[0]
)

__all__ = [
    "ACCEPTABLE_ANSWERS_FIELD",
    "CORRECT_REWARD",
    "UNSCORED_REWARD",
    "is_correct",
    "is_unscored",
    "WRONG_REWARD",
    "BoxedAnswer",
    "MathScoreResult",
    "compute_score",
    "compute_scores",
    "configure_math_pool",
    "extract_answer",
    "extract_last_boxed",
    "final_answer",
    "get_scorer",
    "gold_alternatives",
    "math_score",
    "math_score_batch",
    "math_score_batch_detailed",
    "math_score_detailed",
    "register_scorer",
    "registered_prefixes",
    "require_scored",
    "shutdown_math_pool",
    "unregister_scorer",
]

# ------------------------------------------------------------------ code registration
from klear.rewards import code_reward as _code_reward  # noqa: E402

register_scorer(
    "code", _code_reward.code_score, batch_fn=_code_reward.code_score_batch, extract_fn=_code_reward.extract_code
)
__all__ += ["code_score", "code_score_batch", "code_score_detailed", "code_score_batch_detailed"]
code_score = _code_reward.code_score
code_score_batch = _code_reward.code_score_batch
code_score_detailed = _code_reward.code_score_detailed
code_score_batch_detailed = _code_reward.code_score_batch_detailed
