"""klear's math and code rewards (paper Sec. 3.2.4) as verl custom reward functions.

Use with ``reward.custom_reward_function.path=pkg://klear.integrations.verl.rewards`` and
``reward.custom_reward_function.name=compute_score`` (any verl reward manager that calls
``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)``, e.g. ``naive`` or ``dapo``).
Scorer options go in ``reward.custom_reward_function.reward_kwargs`` (math: ``require_think``,
``timeout_s``; code: ``reward_mode`` soft/hard, ``time_limit_s``, ``timeout_s``, ...; see
:func:`klear.rewards.compute_score`).

verl's reward loop calls the function from a thread pool inside each reward worker; klear's math
verifier runs on its shared worker-process pool and the code judge in its sandbox, both of which
serve concurrent callers from threads.

Unscored responses: verl's reward managers and advantage estimators take one float per response and
have no notion of a missing reward (a NaN would turn its whole group's advantages, and the loss, into
NaN; any number would be a made-up verdict). So when klear's judge could not score a response even
after its backoff retries (``nan``, :data:`klear.rewards.correctness.UNSCORED_REWARD`), this adapter
raises ``RuntimeError`` and the step fails with that message; resume from the last checkpoint once
the reward workers are healthy.
"""

from __future__ import annotations

from typing import Any

from klear.rewards import compute_score as _klear_compute_score
from klear.rewards.correctness import is_correct, is_unscored

__all__ = ["compute_score"]


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> dict[str, float]:
    """klear's reward of one response, with its correctness, in verl's dict form.

    Args:
        data_source: dataset tag selecting the scorer by prefix (``math...``, ``code...``).
        solution_str: the decoded response.
        ground_truth: ``reward_model.ground_truth`` of the row.
        extra_info: the row's ``extra_info`` (verl adds ``num_turns`` and ``rollout_reward_scores``).
        **kwargs: scorer options (``reward_kwargs``), as :func:`klear.rewards.compute_score`; verl's
            reward-model keywords (``reward_router_address``, ``reward_model_tokenizer``) are ignored.

    Returns:
        ``{"score": reward, "acc": 1.0 if correct else 0.0}``: math 1.0 / -1.0, code the pass rate (soft) or
        +-1 (hard); correct means :func:`klear.rewards.correctness.is_correct` (reward >= 1.0).  ``acc`` is the
        metric for ``algorithm.filter_groups.metric=acc`` and verl's ``val-core`` accuracy.

    Raises:
        ValueError: no klear scorer for ``data_source`` (the message lists the registered prefixes).
        RuntimeError: the judge could not score the response (unscored, see the module docstring).
    """
    kwargs.pop("reward_router_address", None)
    kwargs.pop("reward_model_tokenizer", None)
    score = _klear_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if is_unscored(score):
        raise RuntimeError(
            f"klear reward: the judge could not score a {data_source!r} response (reward workers kept failing "
            "after the retries; see the warnings above); verl needs a float for every response, so the step stops"
        )
    return {"score": score, "acc": 1.0 if is_correct(score) else 0.0}
