"""The TRL peer arm: plain TRL ``GRPOTrainer`` as ``klear rl`` runs it with ``trainer_impl: trl_grpo``.

What users would run without klear: ``GRPOTrainer(loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
beta=0)`` (DAPO's token-mean Clip-Higher loss, no KL), on the same data, reward
(:func:`klear.rl.reward_fn.make_klear_reward`), sizes, seeds and held-out evaluation as a klear run, in
a normal ``klear rl`` run directory.

The recipe's ``trainer`` section is read as for klear, with the GPPO settings mapped or refused
(:func:`peer_trainer_section`):

* ``clip_ratio_low`` -> TRL ``epsilon``, ``clip_ratio_high`` -> ``epsilon_high``;
* ``loss_mode`` must be ``ppo_clip`` (what TRL's ``dapo`` loss is) and ``loss_agg_mode`` ``token-mean``
  (-> ``loss_type: dapo``);
* ``clip_ratio_c`` must be null (TRL's dapo loss has no dual clip), ``alpha`` 0 (no SFT term),
  ``filter_zero_adv_groups`` and ``overlong_filter`` false (TRL keeps zero-advantage groups in the loss
  and its token-mean divisor; its ``mask_truncated_completions`` is the overlong filter);
* every other GPPO-only field (``beta1``, ``beta2``, ``erc_low``, ``erc_high``, ``zero_adv_criterion``,
  ``adv_epsilon``, ``correct_reward``) must be absent or at its default.

vLLM importance-sampling correction: TRL's default (``vllm_importance_sampling_correction=True``,
``vllm_importance_sampling_mode="sequence_mask"``) weights each vLLM sample's loss by its training/sampling
sequence probability ratio and masks out the samples whose ratio exceeds 3; it acts only with ``use_vllm``. klear's
trainer has no such correction (:class:`klear.rl.trainer.GPPOConfig` refuses it), so the peer's default is
``False`` too: both arms then train on every sample, and a comparison measures the loss, not the masking.
A recipe may still set it to ``true`` for the peer alone (a deliberate, stated difference).

Advantage scale (``trainer.adv_std``): TRL divides by the SAMPLE std of the group (Bessel's correction,
``trl.trainer.utils.nanstd``) plus 1e-4; klear by the POPULATION std of Eq. 4 plus 1e-6 (paper Eq. 4,
Sec. 3.2). For G samples the TRL advantages are smaller by ``sqrt((G - 1) / G)`` (0.935 for G = 8).
``adv_std: sample`` (default) is plain TRL; ``adv_std: population`` multiplies TRL's advantages by
``sqrt(G / (G - 1))`` after TRL computed them, giving ``(r - mean) / (std_pop + 1e-4 * sqrt((G - 1) / G))``,
Eq. 4 up to the epsilon. It needs TRL's per-group scaling (``scale_rewards: group``, TRL's default).

Unscored samples (the klear reward returns ``nan`` when the judge could not score a response; see
:mod:`klear.rewards.correctness`) are handled as plain TRL 1.16 handles a reward function returning
None: the group's mean and std are over its scored members (``nanmean``/``nanstd``), the unscored
sample's advantage is 0 (a group with fewer than 2 scored members gets 0 everywhere), and it is
counted out of the logged ``reward``. Unlike :class:`klear.rl.trainer.GPPOTrainer`, TRL keeps its
tokens in the loss's token-mean divisor (they add zero to the sum), and it does not stop when a whole
batch is unscored (every advantage is then 0). ``adv_std: population`` rescales each group by
``sqrt(k / (k - 1))`` with ``k`` its number of scored members (``G`` when all are scored), since TRL's
sample std is over those ``k``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from klear.lifecycle import LifecycleMixin

ADV_STD_CHOICES = ("sample", "population")

# GPPO-only settings with the value that makes them plain TRL (None: the setting must be absent or at
# GPPOConfig's default); clip_ratio_low/high are mapped to TRL's epsilon/epsilon_high instead.
_MUST_BE = {
    "loss_mode": "ppo_clip",
    "loss_agg_mode": "token-mean",
    "clip_ratio_c": None,
    "alpha": 0,
    "filter_zero_adv_groups": False,
    "overlong_filter": False,
}
_MAPPED = {"clip_ratio_low": "epsilon", "clip_ratio_high": "epsilon_high"}


@dataclasses.dataclass
class TRLPeerConfig(GRPOConfig):
    """``GRPOConfig`` with the peer arm's defaults (``loss_type="dapo"``, ``epsilon=0.2``, ``epsilon_high=0.28``,
    ``beta=0``, ``vllm_importance_sampling_correction=False`` as klear's trainer, where TRL's default is True)
    and ``adv_std`` (see the module docstring).

    Raises:
        ValueError: ``adv_std`` not in :data:`ADV_STD_CHOICES`, or ``population`` without ``scale_rewards="group"``;
            anything ``GRPOConfig`` rejects.
    """

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = 0.28
    beta: float = 0.0
    vllm_importance_sampling_correction: bool = dataclasses.field(
        default=False,
        metadata={"help": "TRL's vLLM sequence masking (TRL's default True); False: as klear's trainer (no masking)."},
    )
    adv_std: str = dataclasses.field(
        default="sample",
        metadata={"help": "'sample': TRL's group std (ddof 1); 'population': rescaled to klear's Eq. 4 (ddof 0)."},
    )

    def __post_init__(self):
        if self.adv_std not in ADV_STD_CHOICES:
            raise ValueError(f"adv_std={self.adv_std!r} must be one of {ADV_STD_CHOICES}")
        super().__post_init__()
        if self.adv_std == "population" and self.scale_rewards != "group":
            raise ValueError(
                f"adv_std='population' rescales TRL's per-group std; scale_rewards={self.scale_rewards!r} "
                "must be 'group'"
            )


def population_std_factor(rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(N,)`` factor turning TRL's sample-std advantages into population-std ones: ``sqrt(k / (k - 1))``
    with ``k`` the number of scored members of the sample's group (TRL's groups: ``num_generations``
    consecutive rows; a row is unscored when every reward function returned None/NaN, TRL's rule). 1 where
    ``k < 2`` (TRL's advantages are 0 there).

    Args:
        rewards_per_func: ``(N, F)`` float, gathered over all processes.
        num_generations: group size ``G`` (``N`` is a multiple of it).
    """
    scored = (~torch.isnan(rewards_per_func).all(dim=1)).to(torch.float64)
    k = scored.view(-1, num_generations).sum(dim=1)
    factor = torch.where(k > 1, (k / (k - 1).clamp(min=1)).sqrt(), torch.ones_like(k))
    return factor.repeat_interleave(num_generations)


class TRLPeerTrainer(LifecycleMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer``, unchanged except for the optional population-std rescale (``args.adv_std``)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._peer_rewards_per_func = rewards_per_func  # gathered over processes; read just below
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, self._peer_rewards_per_func = getattr(self, "_peer_rewards_per_func", None), None
        if self.args.adv_std == "population" and rewards_per_func is not None:
            mode = "train" if self.model.training else "eval"
            g = self.num_generations if mode == "train" else self.num_generations_eval
            factor = population_std_factor(rewards_per_func, g)
            n_local = output["advantages"].size(0)
            start = self.accelerator.process_index * n_local
            local = factor[start : start + n_local].to(output["advantages"].device, output["advantages"].dtype)
            output["advantages"] = output["advantages"] * local
        return output


def peer_trainer_section(trainer: dict[str, Any], source: str) -> dict[str, Any]:
    """Map a recipe's ``trainer`` section (klear's field names) to :class:`TRLPeerConfig` fields.

    Args:
        trainer: the section (GPPOConfig or GRPOConfig field names, plus ``adv_std``).
        source: where the recipe came from, for error messages.

    Returns:
        A new mapping without the GPPO-only keys, with ``epsilon``/``epsilon_high`` from
        ``clip_ratio_low``/``clip_ratio_high``.

    Raises:
        ValueError: one line naming ``source``, the field and what the TRL peer expects (module docstring),
            or a ``clip_ratio_*`` given together with a different ``epsilon*``.
    """
    from klear.rl.trainer import GPPOConfig

    gppo_defaults = {f.name: f.default for f in dataclasses.fields(GPPOConfig)}
    trl_fields = {f.name for f in dataclasses.fields(TRLPeerConfig)}
    out: dict[str, Any] = {}
    for key, value in trainer.items():
        if key in _MAPPED:
            target = _MAPPED[key]
            if target in trainer and trainer[target] != value:
                raise ValueError(
                    f"{source}: trainer.{key}={value!r} and trainer.{target}={trainer[target]!r} "
                    f"disagree (trainer_impl trl_grpo maps {key} to TRL's {target}); set one"
                )
            out[target] = value
        elif key in _MUST_BE:
            if value != _MUST_BE[key] or isinstance(value, bool) != isinstance(_MUST_BE[key], bool):
                raise ValueError(
                    f"{source}: trainer.{key}={value!r} is a GPPO setting plain TRL GRPO does not have; "
                    f"with trainer_impl trl_grpo set it to {_MUST_BE[key]!r} or remove it"
                )
        elif key not in trl_fields:
            if key in gppo_defaults and value == gppo_defaults[key]:
                continue
            if key in gppo_defaults:
                raise ValueError(
                    f"{source}: trainer.{key}={value!r} is a GPPO setting plain TRL GRPO does not have; "
                    f"with trainer_impl trl_grpo remove it (default {gppo_defaults[key]!r})"
                )
            out[key] = value  # an unknown key: check_trainer_section names it
        elif key not in out:
            out[key] = value
    return out
