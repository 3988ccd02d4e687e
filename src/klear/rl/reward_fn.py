"""Adapter from TRL's reward-function protocol to :func:`klear.rewards.compute_scores`.

TRL calls a reward function as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
where ``columns`` holds every dataset column (one value per rollout). Klear datasets use the verl
RL layout, so the columns we read are ``data_source``, ``reward_model`` (``{"ground_truth": ...}``)
and the optional ``extra_info``.
"""

from __future__ import annotations

from typing import Any


def _completion_text(completion: Any) -> str:
    """Text of one completion: a plain string, or the contents of the assistant messages of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    raise TypeError(f"unsupported completion type {type(completion).__name__}; expected str or list of messages")


def klear_reward(
    prompts, completions, data_source=None, reward_model=None, extra_info=None, _options: dict | None = None, **_: Any
) -> list[float]:
    """Score a batch of rollouts with :func:`klear.rewards.compute_scores` (verl-style dispatch on ``data_source``).

    Args:
        prompts: one prompt per rollout (unused; kept for TRL's protocol).
        completions: one completion per rollout (string or list of chat messages).
        data_source: dataset column, one string per rollout (e.g. ``"math_longcot_math_verify"``).
        reward_model: dataset column, one dict per rollout holding ``"ground_truth"``.
        extra_info: optional dataset column, one dict per rollout.

    Returns:
        One float per rollout (math: 1.0 correct, -1.0 wrong).

    Raises:
        ValueError: the dataset has no ``data_source`` or ``reward_model`` column, or a row has no ground truth.
    """
    from klear.rewards import compute_scores

    n = len(completions)
    if data_source is None or reward_model is None:
        raise ValueError(
            "klear_reward needs the dataset columns 'data_source' and 'reward_model' (verl RL layout); "
            f"got data_source={'present' if data_source is not None else 'missing'}, "
            f"reward_model={'present' if reward_model is not None else 'missing'}"
        )
    ground_truths = []
    for i, rm in enumerate(reward_model):
        gt = rm.get("ground_truth") if isinstance(rm, dict) else None
        if gt is None:
            raise ValueError(f"rollout {i}: field 'reward_model.ground_truth' is missing (got {rm!r})")
        ground_truths.append(gt)
    texts = [_completion_text(c) for c in completions]
    infos = list(extra_info) if extra_info is not None else [None] * n
    return [float(r) for r in compute_scores(list(data_source), texts, ground_truths, infos, **(_options or {}))]


def make_klear_reward(**reward_kwargs: Any):
    """:func:`klear_reward` with scorer options bound (the ``reward:`` section of a ``klear rl`` recipe).

    ``reward_kwargs`` go to :func:`klear.rewards.compute_scores`, e.g. ``reward_mode="hard"`` and
    ``time_limit_s=4`` for code, ``require_think=True`` for math and code. With no options this is
    :func:`klear_reward` itself.
    """
    if not reward_kwargs:
        return klear_reward

    def klear_reward_with_options(
        prompts, completions, data_source=None, reward_model=None, extra_info=None, **columns: Any
    ) -> list[float]:
        return klear_reward(prompts, completions, data_source, reward_model, extra_info, _options=reward_kwargs)

    klear_reward_with_options.__name__ = "klear_reward"
    return klear_reward_with_options
