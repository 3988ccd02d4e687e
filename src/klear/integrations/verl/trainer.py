"""The SFT term on correct rollouts (paper Eq. 13, 14) inside verl's actor update.

A registered verl policy loss never sees rewards, so the term ``alpha * L_LM`` is added by replacing the
actor's loss function.  Three pieces, selected with ``trainer.v1.trainer_mode=klear_sync``:

* :class:`KlearPPOTrainer` (registered as ``klear_sync``): verl's synchronous PPO trainer whose actor
  workers are :class:`KlearActorRolloutRefWorker`.
* :class:`KlearActorRolloutRefWorker`: wraps the loss function verl builds (``ppo_loss``) with
  :func:`klear_ppo_loss` and trains with :class:`KlearTrainingWorker`.
* :class:`KlearTrainingWorker`: before the update marks each response correct
  (:func:`klear.rewards.correctness.is_correct` of its sequence reward, the sum of the token-level
  reward field ``rm_scores`` / ``token_level_scores``) and, per mini-batch, sums the correct-response
  token count over data-parallel ranks: Eq. 13's divisor.

The settings live in :class:`~klear.integrations.verl.losses.GPPOLossConfig` (``sft_alpha``, ``sft_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import ray
import torch
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from klear.integrations.verl.losses import sft_term
from klear.rewards.correctness import is_correct
from klear.rl.losses import add_sft_term

__all__ = [
    "IS_CORRECT_KEY",
    "NUM_SFT_TOKENS_KEY",
    "KlearActorRolloutRefWorker",
    "KlearPPOTrainer",
    "KlearTrainingWorker",
    "correct_flags",
    "klear_ppo_loss",
    "sft_token_count",
]

#: Batch field: ``(B,)`` float 0/1, the response is correct (in Phi, Eq. 13).
IS_CORRECT_KEY = "klear_is_correct"
#: Non-tensor batch entry: the mini-batch's correct-response token count summed over data-parallel ranks.
NUM_SFT_TOKENS_KEY = "klear_num_sft_tokens"
#: Non-tensor batch entry: the number of micro-batches of the mini-batch on this rank (``sft_norm=micro_batch``).
NUM_MICRO_BATCHES_KEY = "klear_num_micro_batches"
#: Token-level reward fields, in the order they are looked for (verl's v1 trainer, then v0).
_REWARD_KEYS = ("rm_scores", "token_level_scores")


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """``(B,)`` sums over the last dim of a padded ``(B, T)`` or nested jagged tensor."""
    if t.is_nested:
        return torch.stack([row.sum() for row in t.unbind()])
    return t.sum(dim=-1)


def correct_flags(data: Any) -> torch.Tensor:
    """``(B,)`` float 0/1 correctness of each response of a verl batch (TensorDict).

    Correct means ``is_correct(sequence reward)`` with the sequence reward the sum of the token-level reward
    field (klear's rule: reward >= 1.0, a verified math answer or a code response passing every test).

    Raises:
        KeyError: the batch has none of the reward fields ``rm_scores`` / ``token_level_scores``.
    """
    for key in _REWARD_KEYS:
        if key in data.keys():
            return is_correct(_row_sums(data[key].float())).float()
    raise KeyError(
        f"the SFT term needs the token-level rewards in the actor batch: none of {_REWARD_KEYS} "
        f"among its fields {sorted(data.keys())}"
    )


def sft_token_count(response_mask: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Number of unmasked tokens of correct responses: ``sum_b correct[b] * sum_t response_mask[b, t]`` (0-dim)."""
    return (_row_sums(response_mask.float()) * correct.float()).sum()


def klear_ppo_loss(
    config: Any,
    model_output: dict[str, Any],
    data: Any,
    dp_group: Any = None,
    *,
    base_loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[torch.Tensor, dict]:
    """verl's actor loss plus ``alpha * L_LM`` on the correct responses (Eq. 14), for one micro-batch.

    Args:
        config: verl's ``ActorConfig``; ``config.policy_loss`` is a ``GPPOLossConfig`` (``sft_alpha``,
            ``sft_norm``; a plain ``PolicyLossConfig`` means alpha = 0).
        model_output: the engine's output; ``log_probs`` nested ``(B, j)`` over prompt + response tokens.
        data: the micro-batch TensorDict; ``IS_CORRECT_KEY`` and, for ``sft_norm=mini_batch``,
            ``NUM_SFT_TOKENS_KEY`` (set by :class:`KlearTrainingWorker`).
        dp_group: data-parallel group (passed on to ``base_loss_fn``).
        base_loss_fn: verl's loss function (``partial(ppo_loss, config=config)``).

    Returns:
        ``(loss, metrics)``: ``base_loss + alpha * L_LM``; metrics gain ``actor/sft_loss`` (this micro-batch's
        contribution) and ``actor/sft_correct_frac``.

    Raises:
        KeyError: ``IS_CORRECT_KEY`` missing while alpha > 0 (the worker is not :class:`KlearTrainingWorker`).
    """
    loss, metrics = base_loss_fn(model_output=model_output, data=data, dp_group=dp_group)
    policy_cfg = config.policy_loss
    alpha = float(policy_cfg.get("sft_alpha", 0.0))
    if alpha == 0.0:
        return loss, metrics
    if IS_CORRECT_KEY not in data.keys():
        raise KeyError(
            f"sft_alpha={alpha} needs the batch field {IS_CORRECT_KEY!r}; run verl with "
            "trainer.v1.trainer_mode=klear_sync"
        )
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("response_mask", IS_CORRECT_KEY).to_padded_tensor()
    correct = padded[IS_CORRECT_KEY]
    lm = sft_term(
        log_prob,
        padded["response_mask"],
        correct,
        policy_cfg.get("sft_norm", "mini_batch"),
        num_sft_tokens=tu.get_non_tensor_data(data=data, key=NUM_SFT_TOKENS_KEY, default=None),
        dp_size=int(data["dp_size"]),
        num_micro_batches=int(tu.get_non_tensor_data(data=data, key=NUM_MICRO_BATCHES_KEY, default=1)),
    )
    metrics["actor/sft_loss"] = lm.detach().item()
    metrics["actor/sft_correct_frac"] = correct.float().mean().item()
    return add_sft_term(loss, lm, alpha), metrics


class KlearTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` that adds the correctness flags and Eq. 13's divisor to the actor batch."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_mini_batch(self, data):
        """Mark each response correct (``IS_CORRECT_KEY``), then verl's ``train_mini_batch``."""
        if IS_CORRECT_KEY not in data.keys():
            data[IS_CORRECT_KEY] = correct_flags(data)
        return super().train_mini_batch(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
    def train_batch(self, data):
        """Add the mini-batch's correct-response token count over all ranks, then verl's ``train_batch``."""
        if IS_CORRECT_KEY in data.keys():
            count = sft_token_count(data["response_mask"], data[IS_CORRECT_KEY]).to(torch.float64)
            group = self.engine.get_data_parallel_group()
            if torch.distributed.is_initialized():
                count = count.to(get_device_id())
                torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM, group=group)
            tu.assign_non_tensor(data, **{NUM_SFT_TOKENS_KEY: float(count.item())})
            micro = self.engine_config.micro_batch_size_per_gpu
            if not self.engine_config.use_dynamic_bsz and micro:
                tu.assign_non_tensor(data, **{NUM_MICRO_BATCHES_KEY: -(-data.shape[0] // int(micro))})
        return super().train_batch(data)


class KlearActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` training with :class:`KlearTrainingWorker` and :func:`klear_ppo_loss`."""

    actor_worker_cls = KlearTrainingWorker

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """verl's ``init_model``, then wrap the actor's loss function with :func:`klear_ppo_loss`."""
        super().init_model()
        if "actor" in self.role:
            base = self.loss_fn
            self.loss_fn = partial(klear_ppo_loss, base.keywords["config"], base_loss_fn=base)
            self.actor.set_loss_fn(self.loss_fn)


@register_trainer("klear_sync")
class KlearPPOTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer (``sync``) with klear's actor workers (the SFT term, Eq. 13, 14)."""

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role, cls in list(self.role_worker_mapping.items()):
            if getattr(cls, "__ray_actor_class__", None) is ActorRolloutRefWorker:
                self.role_worker_mapping[role] = ray.remote(KlearActorRolloutRefWorker)
