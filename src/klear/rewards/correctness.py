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

**Unscored.** A reward that could not be computed (the judge's worker pool kept failing after the
retries of :mod:`klear.rewards._timeout`) is :data:`UNSCORED_REWARD`, ``float("nan")``, at every API
(``compute_score``/``compute_scores``, the TRL reward function, the detailed results); never the
wrong-answer reward. NaN is never correct; test for it with :func:`is_unscored`. What each consumer
does with it: the RL trainer leaves the sample out of the loss and of its group's advantage statistics
(:mod:`klear.rl.trainer`), ``klear eval`` re-judges it and otherwise reports it apart from the
metrics (:mod:`klear.eval.harness`), the verl adapter and the data/SFT filters raise.
"""

from __future__ import annotations

import math
import numbers
from typing import overload

import torch

__all__ = ["CORRECT_REWARD", "UNSCORED_REWARD", "WRONG_REWARD", "is_correct", "is_unscored"]

#: Reward of a verified correct math answer, and the soft code reward when all tests pass.
CORRECT_REWARD = 1.0
#: Reward of every math response that is not a verified correct answer (paper Sec. 3.2.4).
WRONG_REWARD = -1.0
#: Reward of a response the judge could not score (see the module docstring): NaN.
UNSCORED_REWARD = float("nan")


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


@overload
def is_unscored(reward: torch.Tensor) -> torch.Tensor: ...
@overload
def is_unscored(reward: float | None) -> bool: ...


def is_unscored(reward):
    """Whether a reward is :data:`UNSCORED_REWARD` (NaN; ``None`` counts too, as TRL reads it).

    Args:
        reward: a number (Python or numpy) or None, or a tensor of any shape.

    Returns:
        A bool, or a bool tensor of ``reward``'s shape.
    """
    if isinstance(reward, torch.Tensor):
        return torch.isnan(reward) if reward.is_floating_point() else torch.zeros_like(reward, dtype=torch.bool)
    return reward is None or (isinstance(reward, numbers.Real) and math.isnan(reward))
