"""What counts as a correct response: the one rule every stage imports.

The paper's rewards (Sec. 3.2.4) give a verified correct math answer ``+1`` and anything else
``-1``; the soft code reward is the pass rate ``passed / total`` (also Sec. 3.2.4), so ``1.0``
means every test passed. A response is therefore *correct* when its reward reaches
:data:`CORRECT_REWARD`. klear's scorers never return more than ``1.0``, so for them this is
``reward == 1.0``; the threshold form lets pre-scored sample files on another scale (e.g. 0/1)
pass their own ``correct_reward``.

Used by: RL accuracy, the SFT term's mask and the ``correctness`` zero-advantage criterion
(:mod:`klear.rl.trainer`), held-out avg@n (:mod:`klear.eval.heldout`), the evaluation harness
(:mod:`klear.eval.harness`), SFT correctness filtering (:mod:`klear.sft.data`) and the data
filters (:mod:`klear.data.filters`).
"""

from __future__ import annotations

import math
from typing import overload

import torch

__all__ = ["CORRECT_REWARD", "WRONG_REWARD", "is_correct"]

#: Reward of a verified correct math answer, and the soft code reward when all tests pass.
CORRECT_REWARD = 1.0
#: Reward of every math response that is not a verified correct answer (paper Sec. 3.2.4).
WRONG_REWARD = -1.0


@overload
def is_correct(reward: torch.Tensor, correct_reward: float = CORRECT_REWARD) -> torch.Tensor: ...
@overload
def is_correct(reward: float, correct_reward: float = CORRECT_REWARD) -> bool: ...


def is_correct(reward, correct_reward: float = CORRECT_REWARD):
    """Whether a reward marks a correct response: ``reward >= correct_reward``.

    Args:
        reward: a Python number, or a float tensor of any shape (e.g. ``(B,)`` per response).
        correct_reward: the threshold (default :data:`CORRECT_REWARD`, 1.0).

    Returns:
        A bool for a number, a bool tensor of ``reward``'s shape for a tensor. NaN is never correct.

    Raises:
        TypeError: ``reward`` is a bool, a string, or another non-numeric value.
        ValueError: ``correct_reward`` is not a finite number.
    """
    if (
        isinstance(correct_reward, bool)
        or not isinstance(correct_reward, (int, float))
        or not math.isfinite(correct_reward)
    ):
        raise ValueError(f"correct_reward must be a finite number, got {correct_reward!r}")
    if isinstance(reward, torch.Tensor):
        return reward >= correct_reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise TypeError(f"reward must be a number or a tensor, got {type(reward).__name__} {reward!r}")
    return float(reward) >= correct_reward
