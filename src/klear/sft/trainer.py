"""Long-CoT SFT trainer: TRL's ``SFTTrainer`` with Klear's loss averaging and LR schedule.

What it adds to ``trl.SFTTrainer`` (TRL 1.16):

* **Loss on the response tokens only, averaged per token over the whole optimizer batch.** The
  data is in TRL's conversational prompt-completion layout (see :mod:`klear.sft.data`), so TRL
  labels every prompt token ``-100`` (``completion_only_loss``). The loss of one optimizer step is

      L = - sum_{i, t in response_i} log p_theta(y_{i,t} | x_i, y_{i,<t}) / N,

  N = the number of response tokens in ALL micro-batches of the step (all gradient-accumulation
  micro-batches, all ranks): token-level averaging, so a long response weighs in proportion to
  its length, exactly as if the step were one batch. TRL divides each micro-batch's summed NLL by
  ``num_items_in_batch``, which ``transformers.Trainer`` counts over the step's micro-batches only
  when it believes the model "accepts loss kwargs"; this trainer forces that counting for every
  model, which also tells ``Trainer.training_step`` the loss is already scaled for gradient
  accumulation (the same rule on transformers before and after 5.19, see the class body).
* **Cosine-to-floor schedule** (paper Sec. 4.1: max LR 8e-5, cosine decay to a floor of 4e-5), set
  by ``lr_floor``; see :func:`cosine_to_floor_lr`. The LR is EXACTLY ``learning_rate`` at the last
  warm-up step and EXACTLY ``lr_floor`` at the last optimizer step (``transformers``'
  ``cosine_with_min_lr`` only reaches the floor one step after the end of training). The logged
  ``learning_rate`` is the LR the logged step used (``Trainer`` logs the next step's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.optim.lr_scheduler import LambdaLR
from trl import SFTConfig, SFTTrainer

from klear.lifecycle import LifecycleMixin

__all__ = ["KlearSFTConfig", "KlearSFTTrainer", "cosine_to_floor_lr"]


def cosine_to_floor_lr(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate used by optimizer step ``step`` (1-based) of the warm-up + cosine-to-floor schedule.

    * warm-up, ``1 <= step <= W``: ``max_lr * step / W`` (linear from 0; step W uses ``max_lr``);
    * decay, ``W <= step <= T``: ``min_lr + (max_lr - min_lr) * (1 + cos(pi * (step - W) / (T - W))) / 2``,
      so step T uses exactly ``min_lr``; steps after T stay at ``min_lr``.

    ``step = 0`` (before any update) gives 0 with a warm-up and ``max_lr`` without one.

    Args:
        step: optimizer step, >= 0.
        max_lr: peak LR (> 0), e.g. 8e-5.
        min_lr: floor, ``0 <= min_lr <= max_lr``, e.g. 4e-5.
        warmup_steps: W, ``0 <= W <= T``.
        total_steps: T, the number of optimizer steps of the run (>= 1).

    Returns:
        The LR (a Python float).

    Raises:
        ValueError: an argument outside the ranges above.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not max_lr > 0:
        raise ValueError(f"max_lr must be > 0, got {max_lr}")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"min_lr must be in [0, max_lr={max_lr}], got {min_lr}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if step >= total_steps:
        return float(min_lr)
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class KlearSFTConfig(SFTConfig):
    """``trl.SFTConfig`` plus ``lr_floor``.

    Args:
        lr_floor: when set, the schedule is :func:`cosine_to_floor_lr` from ``learning_rate`` down to
            ``lr_floor`` after ``warmup_steps`` (an int, or a fraction of the steps when < 1), and
            ``lr_scheduler_type`` is ignored. ``None``: the usual ``lr_scheduler_type``.
    """

    lr_floor: float | None = field(
        default=None,
        metadata={
            "help": "Cosine decay from learning_rate to this floor (reached exactly at the last step); "
            "overrides lr_scheduler_type. None: use lr_scheduler_type."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.lr_floor is not None:
            if isinstance(self.lr_floor, bool) or not isinstance(self.lr_floor, (int, float)):
                raise ValueError(f"lr_floor must be a number, got {self.lr_floor!r}")
            if not 0 <= self.lr_floor <= self.learning_rate:
                raise ValueError(f"lr_floor={self.lr_floor} must be in [0, learning_rate={self.learning_rate}]")


class KlearSFTTrainer(LifecycleMixin, SFTTrainer):
    """``trl.SFTTrainer`` with token-level loss averaging over the optimizer batch and the cosine-to-floor LR.

    Use with a :class:`KlearSFTConfig` and a prompt-completion dataset (:mod:`klear.sft.data`).
    See the module docstring for the loss (response tokens only) and the schedule.
    """

    args: KlearSFTConfig

    # No loss_is_scaled_for_ga here (it stays None): transformers < 5.19 does not read it, and TRL 1.16 then
    # emulates True by setting compute_loss_func to a string, which SFTTrainer.compute_loss calls (TypeError).
    # With it None, every transformers version applies the same rule: the loss counts as scaled for gradient
    # accumulation iff model_accepts_loss_kwargs and num_items_in_batch is not None, which is exactly when TRL's
    # SFT loss divides by num_items_in_batch (the whole step's tokens) instead of the micro-batch's own count.

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # transformers counts num_items_in_batch (over all micro-batches of a step) only for models whose
        # forward takes **kwargs; TRL's loss uses it whatever the model, so always count it.
        self.model_accepts_loss_kwargs = True

    def _schedule_total_steps(self) -> int | None:
        return getattr(self, "_klear_total_steps", None)

    def lr_at_step(self, step: int) -> float:
        """The LR that optimizer step ``step`` (1-based) uses under the cosine-to-floor schedule.

        Raises:
            RuntimeError: ``lr_floor`` is not set, or the scheduler was not created yet.
        """
        total = self._schedule_total_steps()
        if self.args.lr_floor is None or total is None:
            raise RuntimeError("lr_at_step needs lr_floor and a created scheduler")
        return cosine_to_floor_lr(
            step,
            max_lr=self.args.learning_rate,
            min_lr=self.args.lr_floor,
            warmup_steps=self.args.get_warmup_steps(total),
            total_steps=total,
        )

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The cosine-to-floor scheduler when ``args.lr_floor`` is set, else ``Trainer``'s.

        ``LambdaLR`` multiplies the optimizer's LR by ``lambda(c)`` where ``c`` counts the scheduler
        steps taken, and optimizer step ``c + 1`` runs with it; so ``lambda(c) =
        cosine_to_floor_lr(c + 1) / learning_rate``.
        """
        if self.args.lr_floor is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            self._klear_total_steps = int(num_training_steps)
            max_lr = self.args.learning_rate
            self.lr_scheduler = LambdaLR(optimizer, lambda c: self.lr_at_step(c + 1) / max_lr)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if (
            self.args.lr_floor is not None
            and "learning_rate" in logs
            and self._schedule_total_steps()
            and self.state.global_step > 0
        ):
            logs["learning_rate"] = self.lr_at_step(self.state.global_step)
        super().log(logs, start_time)
