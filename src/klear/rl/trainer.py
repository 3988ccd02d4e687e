"""``GPPOTrainer``: Klear-Reasoner's RL stage as a thin subclass of TRL's ``GRPOTrainer``.

TRL gives us rollout generation (transformers or vLLM), accelerate/DeepSpeed/FSDP, gradient
accumulation, checkpointing and logging. This module overrides these ``GRPOTrainer`` methods:

* ``_calculate_rewards``: keeps the rollout's group ids (prompt ids) next to the rewards;
* ``_generate_and_score_completions``: after TRL has generated and scored a rollout batch, we
  recompute the advantages with Eq. 4 keyed by PROMPT ID (:func:`rollout_rewards`), mark
  zero-advantage groups, unscored, correct and truncated responses, and log the rollout metrics
  the paper plots (Sec. 5).
* ``_get_per_token_logps_and_entropies``: during a training rollout, TRL's old-log-prob pass over the
  whole rollout batch returns nothing; ``_prepare_inputs`` runs it later on the kept samples only.
* ``_prepare_inputs``: after TRL has split one rollout batch into ``steps_per_generation``
  micro-batches, we drop the filtered samples, annotate each micro-batch with the exact loss-token counts
  of its optimizer step's window (all micro-batches of that step, all processes) and compute the old
  log-probs (and, for a loss mode that needs them, the old entropies).
* ``_compute_loss``: per-token log-probs come from TRL's fused LM head (temperature-scaled, the same function
  that produced ``old_log_prob``; on a CPU with one process each distinct prompt's forward is shared by its rows,
  :mod:`klear.rl.shared_prompt`); the loss is :func:`klear.rl.losses.total_loss`
  (Eq. 14: ``L = L_pg + alpha * L_LM``) of the configured loss mode.
* ``_generate_single_turn``: on the transformers path, each prompt is prefilled once per group
  (:func:`klear.generation.prefill.grouped_prefill_generate`; on a CPU, with one process, decoded by klear's loop,
  :mod:`klear.generation.decode`); the sampling distribution is unchanged. With ``old_log_prob_source="rollout"``
  it also returns that loop's sampling log-probs, which then serve as ``old_log_prob`` (no log-prob pass).
* ``_generate`` and ``training_step``: timers only (``timing/<phase>_s``), which change nothing (on CUDA they
  synchronise the device at each phase boundary, :func:`phase_clock`).

All the math lives in ``klear.rl.losses`` and ``klear.rl.advantages``; this file only moves
tensors and counts.

Deliberate deviations
---------------------
From the paper (arXiv 2508.07629):

1. Zero-advantage groups (and, with ``overlong_filter``, truncated responses) are dropped from
   the rollout batch before it is cut into micro-batches (:func:`drop_filtered_samples`), as in
   the paper, but the number of optimizer steps per rollout batch stays
   ``steps_per_generation / gradient_accumulation_steps``: the kept samples are spread over them.
   (The authors' mini-batches have a fixed size, so a heavily filtered batch gets fewer steps.)
2. "All rewards equal" is decided on the raw rewards (exact float equality), so soft code rewards
   (e.g. eight rewards of 0.7) are filtered too. The paper does not say how soft-reward groups
   are decided.
3. Truncation ("overlong filter") is decided by the finish reason: a response is truncated when
   it reached ``max_completion_length`` without ending in one of the generation stop tokens
   (``generation_config.eos_token_id``, which for Qwen-style chat models is ``<|im_end|>``, not
   ``tokenizer.eos_token_id``). A stop-token at exactly the limit counts as finished, as vLLM's
   ``finish_reason`` does.
4. The SFT term uses the same temperature-scaled log-probs as the policy loss (the paper's
   rollout temperature is 1.0, where this is no difference).
5. Off-policy mini-batches: TRL shuffles the samples of a rollout batch before splitting it
   into micro-batches, so an optimizer step sees a random subset of SAMPLES, not of whole
   prompt groups. Advantages are computed on whole groups before the split, so this changes
   only which samples share a step.

From the authors' released code (verl fork, ``Kwai-Klear/KlearReasoner``):

6. The authors filter groups on exact correctness (all correct or all wrong); our default is
   the raw-reward rule (2). ``zero_adv_criterion="correctness"`` reproduces theirs.
7. Token-mean is exact per optimizer step: the divisor is the number of loss tokens of the
   whole step (all gradient-accumulation micro-batches, all processes), computed once per rollout
   batch; the SFT term is divided by the correct-response tokens of the same step (Eq. 13).
   verl normalises per micro-batch and rescales by the accumulation count, which is exact only
   when every micro-batch holds the same number of tokens. TRL's own ``dapo`` normaliser is the
   rollout batch's token count rescaled by ``gradient_accumulation_steps / steps_per_generation``,
   which is also only an estimate when ``steps_per_generation`` exceeds the accumulation.
8. The loss modes are small functions in one registry (``klear.rl.losses.LOSS_REGISTRY``) sharing
   the ratio, dual-clip, aggregation and metric code, rather than the authors' per-mode code paths;
   the forward values and gradients match their equations (tested against hand-computed float64
   gradients).

Unscored samples (a reward function returned None/NaN: the judge could not compute the score, see
:mod:`klear.rewards.correctness`) are left out of the loss (``klear_keep`` False, so none of their tokens
enters any divisor) and of their group's advantage statistics (:func:`rollout_rewards`); ``klear/accuracy``
is over the scored samples and ``klear/unscored_frac`` logs their share. A rollout batch in which NO sample
could be scored stops training with a ``RuntimeError``: the judge is down, and training on nothing would
only hide it.

Not supported (rejected with a ``ValueError`` rather than silently ignored): a KL term
(``beta != 0``; Klear uses none), entropy bonus, TRL's entropy-quantile / off-policy masks,
sequence-level importance sampling, TRL's vLLM importance-sampling correction, sampling with
``top_p < 1``, ``top_k``, ``min_p`` or a repetition penalty (the recomputed log-probs would not be
those of the sampling distribution, so the first update's ratio would not be 1), and
``steps_per_generation`` that is not a multiple of ``gradient_accumulation_steps``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch
from transformers import PreTrainedModel, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from klear.lifecycle import LifecycleMixin
from klear.rewards.correctness import UNSCORED_REWARD
from klear.rewards.correctness import is_correct as correct_mask
from klear.rl.advantages import all_equal_groups, compute_group_advantages
from klear.rl.losses import LOSS_AGG_MODES, LOSS_MODES, METRIC_REDUCTIONS, LossInputs, LossSettings, total_loss
from klear.rl.shared_prompt import shared_prompt_log_probs
from klear.rl.trl_surface import TRL_FORWARD_KEYS

logger = logging.getLogger(__name__)

ZERO_ADV_CRITERIA = ("reward", "correctness")
OLD_LOG_PROB_SOURCES = ("recompute", "rollout")


@dataclass
class GPPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the Klear-Reasoner RL settings (paper Sec. 3.2 and 4.1).

    The paper's math-stage values: ``clip_ratio_low=0.2``, ``clip_ratio_high=0.28``,
    ``clip_ratio_c=10``, ``alpha=0.1``, ``loss_agg_mode="token-mean"``, zero-advantage filter on,
    no KL (``beta=0``), temperature 1.0, top-p 1.0. ``clip_ratio_low``/``clip_ratio_high`` are
    copied into TRL's ``epsilon``/``epsilon_high`` so TRL-side code sees the same values.

    The loss settings (every :class:`klear.rl.losses.LossSettings` field, forwarded by name) are checked by
    ``LossSettings`` itself when the config is created, so a setting the loss would reject fails here, before
    any model loads.

    Raises:
        ValueError: any loss setting ``LossSettings`` rejects (unknown ``loss_mode``/``loss_agg_mode``, an
            out-of-range ``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``/``alpha``/``beta1``/
            ``beta2``/``erc_low``/``erc_high``, a mode-specific setting away from its default for a mode that
            does not use it), an unknown ``zero_adv_criterion``, an unknown ``old_log_prob_source`` or ``'rollout'``
            with settings it cannot serve (``use_vllm``, a loss mode needing old entropies,
            ``generation_kwargs`` overriding ``temperature``/``eos_token_id``), or a TRL option this trainer does not
            support (see the module docstring).
    """

    loss_mode: str = field(default="gppo", metadata={"help": f"Policy loss: one of {LOSS_MODES}."})
    clip_ratio_low: float = field(default=0.2, metadata={"help": "eps_low (Eq. 5)."})
    clip_ratio_high: float = field(default=0.28, metadata={"help": "eps_high (Clip-Higher, Eq. 6)."})
    clip_ratio_c: float | None = field(default=10.0, metadata={"help": "Dual-clip bound c (> 1) for A < 0; None: off."})
    beta1: float = field(default=1.0, metadata={"help": "General GPPO low-side gradient scale (Eq. 17); gppo only."})
    beta2: float = field(
        default=1.0, metadata={"help": "General GPPO high-side gradient scale (Eq. 17); gppo, gppo_only_high."}
    )
    erc_low: float = field(
        default=0.05,
        metadata={"help": "ERC (arXiv 2512.05591): no gradient where H/H_old <= 1 - erc_low; ppo_erc, gppo_erc."},
    )
    erc_high: float = field(
        default=0.05, metadata={"help": "ERC: no gradient where H/H_old >= 1 + erc_high; ppo_erc, gppo_erc."}
    )
    loss_agg_mode: str = field(default="token-mean", metadata={"help": f"One of {LOSS_AGG_MODES}."})
    alpha: float = field(default=0.1, metadata={"help": "Weight of the SFT loss on correct rollouts (Eq. 14)."})
    correct_reward: float = field(default=1.0, metadata={"help": "A response is correct when its reward reaches this."})
    filter_zero_adv_groups: bool = field(default=True, metadata={"help": "Remove zero-advantage groups from the loss."})
    zero_adv_criterion: str = field(
        default="reward",
        metadata={"help": "'reward': all raw rewards equal; 'correctness': all correct or all wrong (authors' code)."},
    )
    overlong_filter: bool = field(default=False, metadata={"help": "Mask truncated responses out of the loss."})
    adv_epsilon: float = field(default=1e-6, metadata={"help": "Epsilon in the std of Eq. 4."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Not supported by GPPOTrainer (TRL's default is True); must stay False."}
    )
    old_log_prob_source: str = field(
        default="recompute",
        metadata={
            "help": "Where old_log_prob comes from: 'recompute' (a log-prob pass over each fresh rollout batch, as TRL "
            "and verl) or 'rollout' (the sampling log-probs of klear's CPU decode loop, from the forward that sampled "
            "the token; no extra pass; recomputed where that loop does not decode in float32)."
        },
    )
    share_prompt_forward: bool | None = field(
        default=None,
        metadata={
            "help": "Log-prob passes compute each distinct prompt of a micro-batch once (klear.rl.shared_prompt; "
            "same log-probs and gradients to float rounding). None: on a CPU with one process, off elsewhere."
        },
    )

    def __post_init__(self):
        self.loss_settings()  # raises on any setting the loss would reject
        if self.zero_adv_criterion not in ZERO_ADV_CRITERIA:
            raise ValueError(
                f"zero_adv_criterion={self.zero_adv_criterion!r} is unknown; expected one of {ZERO_ADV_CRITERIA}"
            )
        unsupported = {
            "beta": (self.beta, 0.0, "Klear-Reasoner uses no KL term"),
            "top_p": (self.top_p, 1.0, "log-probs are recomputed over the full vocabulary"),
            "repetition_penalty": (self.repetition_penalty, 1.0, "log-probs would not match the sampler"),
            "entropy_coef": (self.entropy_coef, 0.0, "Klear-Reasoner uses no entropy bonus"),
            "top_entropy_quantile": (self.top_entropy_quantile, 1.0, "not part of the recipe"),
            "importance_sampling_level": (self.importance_sampling_level, "token", "GPPO is token-level"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold, None, "not part of the recipe"),
            "mask_truncated_completions": (
                self.mask_truncated_completions,
                False,
                "use overlong_filter=True (decided by finish reason)",
            ),
            "use_adaptive_entropy": (self.use_adaptive_entropy, False, "not part of the recipe"),
        }
        for name, (value, expected, why) in unsupported.items():
            if value != expected:
                raise ValueError(f"GPPOConfig.{name}={value!r} is not supported (expected {expected!r}): {why}.")
        full_vocab = "rollouts must sample the full vocabulary"
        if self.top_k not in (None, 0, -1):
            raise ValueError(f"GPPOConfig.top_k={self.top_k!r} is not supported: {full_vocab}.")
        if self.min_p is not None:
            raise ValueError(f"GPPOConfig.min_p={self.min_p!r} is not supported: {full_vocab}.")
        if self.vllm_importance_sampling_correction:
            # TRL's correction multiplies the per-token loss by a ratio our losses have no slot for.
            raise ValueError("GPPOConfig.vllm_importance_sampling_correction=True is not supported.")
        if self.old_log_prob_source not in OLD_LOG_PROB_SOURCES:
            raise ValueError(
                f"GPPOConfig.old_log_prob_source={self.old_log_prob_source!r} is unknown; expected one of "
                f"{OLD_LOG_PROB_SOURCES}"
            )
        if self.old_log_prob_source == "rollout":
            if self.use_vllm:  # vLLM's log-probs come from other kernels (and after its logits processing)
                raise ValueError(
                    "GPPOConfig.old_log_prob_source='rollout' takes klear's CPU decode loop's log-probs; with "
                    "use_vllm=True use 'recompute'"
                )
            if self.loss_settings().mode.needs_old_entropies:
                raise ValueError(
                    f"GPPOConfig.old_log_prob_source='rollout' gives no old entropies, which loss_mode="
                    f"{self.loss_mode!r} needs; use 'recompute'"
                )
            overridden = sorted(set(self.generation_kwargs or {}) & {"temperature", "eos_token_id"})
            if overridden:  # the loop would sample (and stop) by other settings than the loss reads
                raise ValueError(
                    f"GPPOConfig.old_log_prob_source='rollout' with generation_kwargs overriding {overridden}: the "
                    "sampling log-probs would not be the loss's; use 'recompute' or drop the override"
                )
        self.epsilon = self.clip_ratio_low
        self.epsilon_high = self.clip_ratio_high
        self.loss_type = "dapo"  # only TRL-side bookkeeping; the loss is ours
        super().__post_init__()
        if isinstance(self.gradient_checkpointing_kwargs, str):  # JSON object text was parsed by TrainingArguments
            raise ValueError(
                f"GPPOConfig.gradient_checkpointing_kwargs must be a dict or JSON object text, "
                f"got {self.gradient_checkpointing_kwargs!r}"
            )
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}): each optimizer step must draw all its micro-batches from one "
                "rollout batch so its token-mean divisor is exact."
            )

    def loss_settings(self) -> LossSettings:
        """The validated loss settings of this config (raises ``ValueError`` as :class:`LossSettings`)."""
        return LossSettings(**{f.name: getattr(self, f.name) for f in fields(LossSettings)})

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps taken on one rollout batch (the paper's off-policy mini-batches; 8 for math)."""
        assert self.steps_per_generation is not None, "GRPOConfig.__post_init__ always sets it"
        return self.steps_per_generation // self.gradient_accumulation_steps


# Per-optimizer-step seconds logged as ``timing/<phase>_s`` (see GPPOTrainer's docstring).
TIMING_PHASES = ("rollout", "generate", "reward", "old_log_prob", "forward_backward", "optimizer")


def phase_clock(device: torch.device) -> float:
    """``time.perf_counter()`` (seconds) read after the work queued on ``device`` has finished.

    On CUDA, kernels run asynchronously: a clock read right after a phase's Python code returns would charge the
    phase's still-running kernels to the next phase, so the stream is synchronised first
    (``torch.cuda.synchronize(device)``). On any other device nothing is synchronised (no cost).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _PhaseTimer(TrainerCallback):
    """Closes each optimizer step's timing window: ``optimizer`` is the time from the end of the step's last
    micro-batch to ``on_step_end`` (gradient clipping, ``optimizer.step``, LR scheduler, ``zero_grad``)."""

    def __init__(self, trainer: GPPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        t._klear_time["optimizer"] += t._clock() - t._klear_window_end
        m = t._metrics["train"]
        for phase in TIMING_PHASES:
            m[f"timing/{phase}_s"].append(t._klear_time[phase])
        t._klear_time = dict.fromkeys(TIMING_PHASES, 0.0)


@dataclass(frozen=True)
class RolloutRewards:
    """Per-sample results of scoring one rollout batch (all processes), see :func:`rollout_rewards`.

    Attributes (each ``(N,)``): ``rewards`` float (NaN: unscored), ``scored`` bool, ``advantages``
    float (0 for unscored samples), ``zero_adv`` bool (the sample's group carries no gradient),
    ``is_correct`` bool (False for unscored samples).
    """

    rewards: torch.Tensor
    scored: torch.Tensor
    advantages: torch.Tensor
    zero_adv: torch.Tensor
    is_correct: torch.Tensor


def rollout_rewards(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    group_ids: list,
    *,
    adv_epsilon: float,
    correct_reward: float,
    zero_adv_criterion: str,
) -> RolloutRewards:
    """Rewards, advantages (Eq. 4, by prompt id) and flags of one rollout batch.

    A sample is UNSCORED when any reward function returned None/NaN for it (its weighted sum would be
    missing a term; TRL's own rule, "all functions None", would score it with the other functions):
    its reward is NaN, its advantage 0, and its group's mean and std are those of the scored members
    (:func:`klear.rl.advantages.compute_group_advantages`).

    Args:
        rewards_per_func: ``(N, F)`` float, one column per reward function (NaN where it returned None).
        reward_weights: ``(F,)`` float.
        group_ids: N prompt ids.
        adv_epsilon: epsilon of Eq. 4.
        correct_reward: a response is correct when its reward reaches this.
        zero_adv_criterion: ``"reward"`` or ``"correctness"`` (:class:`GPPOConfig`); both over scored members.

    Raises:
        RuntimeError: no sample of the batch could be scored.
    """
    scored = ~torch.isnan(rewards_per_func).any(dim=1)
    if not bool(scored.any()):
        raise RuntimeError(
            f"no sample of the rollout batch could be scored (all {len(scored)} rewards are None/NaN): "
            "the reward judge is failing (see the reward warnings above); stopping rather than training on nothing"
        )
    weighted = torch.nan_to_num(rewards_per_func) * reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = torch.where(scored, weighted.sum(dim=1), UNSCORED_REWARD)
    advantages, zero_adv = compute_group_advantages(rewards, group_ids, epsilon=adv_epsilon)
    is_correct = correct_mask(rewards, correct_reward)  # NaN is never correct
    if zero_adv_criterion == "correctness":
        zero_adv = all_equal_groups(is_correct, group_ids, scored=scored)
    return RolloutRewards(rewards, scored, advantages, zero_adv, is_correct)


def _prompt_key(example: dict[str, Any], prompt: Any) -> str:
    """Group id of one rollout: the dataset's ``prompt_id`` if present, else a hash of the prompt."""
    pid = example.get("prompt_id")
    if pid is not None:
        return str(pid)
    return "sha1:" + hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()


def truncated_mask(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, max_completion_length: int, stop_token_ids: list[int]
) -> torch.Tensor:
    """Which responses were cut by the length limit (finish reason ``"length"``), as a ``(B,)`` bool tensor.

    A response is truncated when it holds ``max_completion_length`` tokens and its last token is not one of
    the generation's stop tokens. This is the finish reason, not "last token != tokenizer.eos_token_id":
    Qwen-style chat models stop on ``<|im_end|>``, which is not their ``eos_token_id``, and a response that
    stops (on a stop token or a stop string) before the limit is never truncated.

    Args:
        completion_ids: ``(B, T)`` int, right-padded responses.
        completion_mask: ``(B, T)`` 0/1, 1 on response tokens (before any loss masking).
        max_completion_length: the generation limit in tokens.
        stop_token_ids: every token id that ends a generation (``generation_config.eos_token_id`` and the
            tokenizer's eos).
    """
    lengths = completion_mask.sum(dim=1)
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    ends_with_stop = torch.isin(last, last.new_tensor(list(stop_token_ids)))
    return (lengths >= max_completion_length) & ~ends_with_stop


# Multimodal / token-type inputs TRL's log-prob function takes from a micro-batch (None for text models).
_FORWARD_KEYS = TRL_FORWARD_KEYS

# Per-response tensors whose second dimension is the completion length (trimmed together).
_COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
    "importance_sampling_ratio",
)


def drop_filtered_samples(micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Physically remove the samples with ``klear_keep == False`` from one rollout batch's micro-batches.

    The kept samples (in their current, already shuffled order) are spread over the same number of
    micro-batches as evenly as possible, and each micro-batch's completion tensors are trimmed to its
    longest response, so filtered groups cost no forward/backward compute. If fewer samples are kept than
    there are micro-batches, filtered samples fill the gap (they stay masked out: ``klear_keep`` False), so no
    micro-batch is empty; such a filler-only micro-batch is cut to one completion token and (text models) its
    prompt's last token, so its forward, backward and old-log-prob passes cost next to nothing. The loss and
    its gradient are unchanged: filtered samples contributed neither terms nor tokens.

    Args:
        micro_batches: dicts of per-sample tensors ``(B_i, ...)``/lists plus shared scalars, with a
            ``klear_keep`` ``(B_i,)`` bool tensor.

    Returns:
        A list of the same length.
    """
    n = len(micro_batches)
    full: dict[str, Any] = {}
    for key, first in micro_batches[0].items():
        values = [mb[key] for mb in micro_batches]
        if isinstance(first, torch.Tensor) and first.ndim > 0:
            full[key] = torch.cat(values)
        elif isinstance(first, list):
            full[key] = [x for v in values for x in v]
        else:
            full[key] = first  # 0-dim tensors and None are shared by every micro-batch
    keep = full["klear_keep"]
    kept, dropped = keep.nonzero().flatten(), (~keep).nonzero().flatten()
    if kept.numel() < n:
        kept = torch.cat([kept, dropped[: n - kept.numel()]])
    out = []
    for idx in torch.tensor_split(kept, n):
        mb: dict[str, Any] = {}
        for key, value in full.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                mb[key] = value[idx.to(value.device)]
            elif isinstance(value, list):
                mb[key] = [value[i] for i in idx.tolist()]
            else:
                mb[key] = value
        filler = not bool(mb["klear_keep"].any())
        # a filler's tokens enter no loss term and no divisor: one token of it is as good as all of them
        length = 1 if filler else max(int(mb["completion_mask"].sum(dim=1).max()), 1)
        for key in _COMPLETION_KEYS:
            value = mb.get(key)
            if isinstance(value, torch.Tensor) and value.ndim == 2 and value.size(1) == full["completion_ids"].size(1):
                mb[key] = value[:, :length]
        prompt = isinstance(mb.get("prompt_ids"), torch.Tensor) and isinstance(mb.get("prompt_mask"), torch.Tensor)
        if filler and prompt and all(mb.get(key) is None for key in _FORWARD_KEYS):  # text: no per-token extras
            mb["prompt_ids"] = mb["prompt_ids"][:, -1:]  # left-padded: the last column is a prompt token
            mb["prompt_mask"] = torch.ones_like(mb["prompt_mask"][:, -1:])
        out.append(mb)
    return out


def rollout_keep_mask(
    scored: torch.Tensor,
    zero_adv: torch.Tensor,
    is_truncated: torch.Tensor,
    *,
    filter_zero_adv_groups: bool,
    overlong_filter: bool,
    training: bool,
) -> torch.Tensor:
    """Which samples of a rollout batch enter the loss (``klear_keep``), as a new ``(B,)`` bool tensor.

    A sample is kept when it was scored (an unscored sample never enters the loss, :func:`rollout_rewards`)
    and, with ``filter_zero_adv_groups`` and ``training``, its group is not a zero-advantage group (the paper's
    zero-advantage group filter, Sec. 5.2.5 and Fig. 5: such a group carries no policy gradient but would
    dilute the token-mean; ``GPPOConfig.zero_adv_criterion`` decides which groups; evaluation batches keep
    them) and, with ``overlong_filter``, the response was not truncated (the overlong filter of the authors'
    scripts, Sec. 4.1: mask out responses cut by the length limit when training shorter than 32K; see
    :func:`truncated_mask`).

    Args:
        scored: ``(B,)`` bool, the sample has a reward.
        zero_adv: ``(B,)`` bool, the sample's group is a zero-advantage group (:class:`RolloutRewards`).
        is_truncated: ``(B,)`` bool, the response was cut by the length limit.
        filter_zero_adv_groups: apply the zero-advantage group filter (training only).
        overlong_filter: apply the overlong filter.
        training: a training batch (False: evaluation).

    Returns:
        ``(B,)`` bool on the inputs' device; the inputs are not modified.
    """
    keep = scored.clone()
    if filter_zero_adv_groups and training:
        keep &= ~zero_adv
    if overlong_filter:
        keep &= ~is_truncated
    return keep


def optimizer_window_counts(
    loss_masks: Sequence[torch.Tensor], is_correct: Sequence[torch.Tensor], gradient_accumulation_steps: int
) -> torch.Tensor:
    """This process's exact loss-token, SFT-token and sequence counts of each optimizer step of a rollout batch.

    Micro-batch ``i`` belongs to optimizer step (window) ``i // gradient_accumulation_steps``. Per window:
    column 0 counts the loss tokens (the divisor of the token-mean, Eq. 7: every token of every response of
    the optimizer step, not of one micro-batch), column 1 the loss tokens of correct responses (the divisor of
    the SFT term over the correct set Phi, Eq. 13), column 2 the responses with at least one loss token (the
    divisor of the seq-mean aggregations, Eq. 3). The caller sums the counts over processes.

    Args:
        loss_masks: one ``(B_i, T_i)`` float 0/1 mask of the loss tokens per micro-batch
            (``GPPOTrainer._loss_mask``: completion mask x tool mask x keep flag).
        is_correct: one ``(B_i,)`` bool per micro-batch, which responses are correct.
        gradient_accumulation_steps: micro-batches per optimizer step, ``>= 1``.

    Returns:
        ``(len(loss_masks) // gradient_accumulation_steps, 3)`` float64 on the first mask's device.

    Raises:
        ValueError: the two lists differ in length, are empty, or their length is not a multiple of
            ``gradient_accumulation_steps`` (or that is < 1).
    """
    n, ga = len(loss_masks), gradient_accumulation_steps
    if len(is_correct) != n or n == 0 or ga < 1 or n % ga:
        raise ValueError(
            f"optimizer_window_counts: {n} loss masks, {len(is_correct)} is_correct flags and "
            f"gradient_accumulation_steps={ga}: expected one flag tensor per mask and a positive multiple of "
            "gradient_accumulation_steps >= 1 micro-batches"
        )
    counts = torch.zeros(n // ga, 3, dtype=torch.float64, device=loss_masks[0].device)
    for i, mask in enumerate(loss_masks):
        correct = is_correct[i].unsqueeze(1)  # bool/0-1 flags: the product has the mask's dtype
        counts[i // ga, 0] += mask.sum()
        counts[i // ga, 1] += (mask * correct).sum()
        counts[i // ga, 2] += (mask.sum(dim=1) > 0).sum()
    return counts


class GPPOTrainer(LifecycleMixin, GRPOTrainer):
    """GRPO trainer with Klear-Reasoner's GPPO loss, SFT-on-correct term and batch filters.

    Construct it like TRL's ``GRPOTrainer`` (``model``, ``reward_funcs``, ``args``, ``train_dataset``,
    ``processing_class``, ...), with ``args`` a :class:`GPPOConfig`. ``reward_funcs`` defaults to
    :func:`klear.rl.reward_fn.klear_reward` (dispatch on the ``data_source`` column).

    Dataset columns used besides ``prompt``: ``prompt_id`` (group key; a hash of the prompt when
    absent) and whatever the reward function needs (``data_source``, ``reward_model``).

    Metrics added to TRL's (prefix ``klear/``): ``accuracy`` (over scored samples), ``unscored_frac`` (share of
    the rollout batch the judge could not score; those samples are out of the loss), ``zero_adv_group_frac``,
    ``filtered_sample_frac``, ``truncated_frac``, ``num_loss_tokens``, ``num_sft_tokens``, and every metric of
    :func:`klear.rl.losses.total_loss` (``policy_loss``, ``sft_loss``, ``clip_frac``, ``clip_frac_high``,
    ``clip_frac_low``, ``dual_clip_frac``, ``ppo_kl``, ``ratio_mean``, ``ratio_max``, ``ratio_min``,
    ``entropy_mean``, ``entropy_share_clip_high``, ``entropy_share_clip_low``; the ERC modes add ``erc_frac``,
    ``erc_frac_high``, ``erc_frac_low``, ``entropy_ratio_mean``, ``entropy_ratio_max``, ``entropy_ratio_min``);
    ``entropy`` (mean over completion tokens) is logged under TRL's name; TRL logs ``reward``, ``grad_norm``,
    ``completions/mean_length``, ``step_time``.

    Where the time goes, seconds per optimizer step (``timing/<phase>_s``; 0 for a phase the step did not
    run, e.g. the rollout on the second off-policy step of a rollout batch): ``rollout`` (all of TRL's
    ``_generate_and_score_completions``: tokenisation, ``generate``, ``reward``, advantages), within it
    ``generate`` (sampling) and ``reward`` (scoring); ``old_log_prob`` (the no-grad log-prob pass of the
    rollout policy, :meth:`_old_log_probs`); ``forward_backward`` (loss forward and backward of every
    micro-batch) and ``optimizer`` (gradient clipping, ``optimizer.step``, scheduler, ``zero_grad``).
    ``rollout + old_log_prob + forward_backward + optimizer`` is the step's wall clock up to logging and
    checkpointing. On CUDA every phase boundary synchronises the device before reading the clock
    (:func:`phase_clock`), so each phase is charged with its own asynchronous kernels.
    """

    _tag_names = ["trl", "grpo", "gppo", "klear"]
    _name = "GPPO"
    args: GPPOConfig  # __init__ refuses any other args

    def __init__(self, model, reward_funcs=None, args: GPPOConfig | None = None, **kwargs):
        if args is None:
            raise ValueError("GPPOTrainer needs args=GPPOConfig(...)")
        if not isinstance(args, GPPOConfig):
            raise TypeError(f"args must be a GPPOConfig, got {type(args).__name__}")
        if reward_funcs is None:
            from klear.rl.reward_fn import klear_reward

            reward_funcs = klear_reward
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        if args.old_log_prob_source == "rollout" and (self.tools or self.rollout_func is not None):
            raise ValueError(
                "GPPOConfig.old_log_prob_source='rollout' takes klear's decode loop's log-probs, which tool calls and "
                "a rollout_func bypass; use 'recompute'"
            )
        self._klear_rollout: dict[str, Any] | None = None
        self._klear_in_rollout = False
        self._klear_time = dict.fromkeys(TIMING_PHASES, 0.0)  # seconds in the current optimizer step
        self._klear_window_end = self._clock()
        self.add_callback(_PhaseTimer(self))

    # ------------------------------------------------------------------ where the time goes
    def _clock(self) -> float:
        """Seconds at a phase boundary, after this process's queued device work (:func:`phase_clock`)."""
        return phase_clock(self.accelerator.device)

    def _timed(self, phase: str, fn, *args, **kwargs):
        start = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self._klear_time[phase] += self._clock() - start

    def _generate(self, prompts):
        return self._timed("generate", super()._generate, prompts)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, with each prompt prefilled once per group on the transformers path
        (:func:`klear.generation.prefill.grouped_prefill_generate`); vLLM, continuous batching and multimodal inputs are
        TRL's unchanged."""
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if (
            self.use_vllm
            or self.use_transformers_continuous_batching
            or images is not None
            or multimodal_fields
            or num_generations < 2
        ):
            return super()._generate_single_turn(*args)
        import functools

        from klear.generation.prefill import grouped_prefill_generate

        model = self.accelerator.unwrap_model(self.model_wrapped)
        rollout = self.args.old_log_prob_source == "rollout"
        # only float32 sampling log-probs are the training forward's (bf16: off by up to 0.31, docs/rl.md)
        sink: list[torch.Tensor] | None = [] if rollout and self.accelerator.mixed_precision == "no" else None
        model.generate = functools.partial(
            grouped_prefill_generate,
            model,
            model.generate,
            group_size=num_generations,
            agree=self._prefill_agreement(),
            log_probs=sink,
        )
        # on a CPU the rollout runs in one autocast region (bf16 mixed precision: klear's decode loop, each weight cast
        # once per rollout); the GPU path keeps the model's own per-forward autocast
        region = self.accelerator.autocast() if self.accelerator.device.type == "cpu" else contextlib.nullcontext()
        try:
            with region:
                completion_ids, logprobs = super()._generate_single_turn(*args)
        finally:
            del model.generate  # the class's generate again
        if sink:  # klear's loop decoded: its (N, T) log-probs, cut as TRL cut each row (after its first stop token)
            rows = sink[0].tolist()
            logprobs = [row[: len(ids)] for row, ids in zip(rows, completion_ids, strict=True)]
        elif rollout and self.model.training and not getattr(self, "_klear_warned_recompute", False):
            self._klear_warned_recompute = True
            logger.warning(
                "old_log_prob_source='rollout': klear's CPU decode loop did not sample this rollout in float32 (it "
                "does on a CPU, in one process, without mixed precision; bf16 sampling log-probs are not the training "
                "forward's), so old_log_prob is recomputed"
            )
        return completion_ids, logprobs

    def _prefill_agreement(self):
        """With several processes, the decision of :func:`klear.generation.prefill.grouped_prefill_generate`:
        a function taking this process's "can group" and returning whether every process can (one all-reduce of a 0/1
        flag and one host sync per rollout batch). Under sharded parameters (ZeRO-3, FSDP) each forward is a collective,
        so a grouped prefill on some processes only would hang the others; the flag costs next to nothing, so it is
        agreed whatever the sharding. None with one process."""
        accelerator = self.accelerator
        if accelerator.num_processes < 2:
            return None

        def agree(local: bool) -> bool:
            flag = torch.tensor([1.0 if local else 0.0], device=accelerator.device)
            return bool(accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes)

        return agree

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the training forward (counted in forward_backward)
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._klear_in_rollout and self.model.training:
            # TRL's old-log-prob pass over the whole rollout batch: deferred to _prepare_inputs, which runs it on
            # the kept samples only, in the micro-batches the loss will see (see _old_log_probs).
            return None, None, None
        return self._timed("old_log_prob", super()._get_per_token_logps_and_entropies, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = self._clock()
        before = self._klear_time["rollout"] + self._klear_time["old_log_prob"]
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._klear_window_end = self._clock()
            inside = self._klear_time["rollout"] + self._klear_time["old_log_prob"] - before
            self._klear_time["forward_backward"] += self._klear_window_end - start - inside

    # ------------------------------------------------------------------ rollout side
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = self._timed(
            "reward", super()._calculate_rewards, inputs, prompts, completions, completion_ids_list
        )
        from accelerate.utils import gather_object

        group_ids = gather_object([_prompt_key(x, p) for x, p in zip(inputs, prompts, strict=True)])
        self._klear_rollout = {"rewards_per_func": rewards_per_func, "group_ids": group_ids}
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._klear_in_rollout = True
        try:
            output = self._timed("rollout", super()._generate_and_score_completions, inputs)
        finally:
            self._klear_in_rollout = False
        rollout, self._klear_rollout = self._klear_rollout, None
        if rollout is None:  # pragma: no cover - TRL always scores through _calculate_rewards
            raise RuntimeError("TRL did not call _calculate_rewards; GPPOTrainer cannot compute advantages")
        args = self.args
        device = output["completion_ids"].device
        mode = "train" if self.model.training else "eval"

        group_ids = rollout["group_ids"]
        scores = rollout_rewards(
            rollout["rewards_per_func"],
            self.reward_weights,
            group_ids,
            adv_epsilon=args.adv_epsilon,
            correct_reward=args.correct_reward,
            zero_adv_criterion=args.zero_adv_criterion,
        )
        advantages, zero_adv, is_correct, scored = scores.advantages, scores.zero_adv, scores.is_correct, scores.scored

        # This process's slice (TRL gathers rewards across processes for group statistics).
        n_local = output["completion_ids"].size(0)
        start = self.accelerator.process_index * n_local
        local = slice(start, start + n_local)

        is_truncated = truncated_mask(
            output["completion_ids"], output["completion_mask"], self.max_completion_length, self.eos_token_ids
        )

        keep = rollout_keep_mask(
            scored[local].to(device),
            zero_adv[local].to(device),
            is_truncated,
            filter_zero_adv_groups=args.filter_zero_adv_groups,
            overlong_filter=args.overlong_filter,
            training=mode == "train",
        )

        output["advantages"] = advantages[local].to(device=device, dtype=torch.float32)
        output["klear_keep"] = keep
        output["klear_is_correct"] = is_correct[local].to(device)

        # Rollout metrics, over all processes.
        n_groups = len(set(group_ids))
        zero_groups = len({g for g, z in zip(group_ids, zero_adv.tolist()) if z})
        truncated_all = self.accelerator.gather(is_truncated)
        keep_all = self.accelerator.gather(keep)
        m = self._metrics[mode]
        m["klear/accuracy"].append((is_correct & scored).sum().item() / max(int(scored.sum()), 1))
        m["klear/unscored_frac"].append(1.0 - scored.float().mean().item())
        m["klear/zero_adv_group_frac"].append(zero_groups / max(n_groups, 1))
        m["klear/truncated_frac"].append(truncated_all.float().mean().item())
        m["klear/filtered_sample_frac"].append(1.0 - keep_all.float().mean().item())
        return output

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self._buffered_inputs is not before:
            self._buffered_inputs = drop_filtered_samples(self._buffered_inputs)
            self._annotate_optimizer_windows(self._buffered_inputs)
            self._old_log_probs(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _old_log_probs(self, micro_batches: list[dict[str, Any]]) -> None:
        """Set ``old_per_token_logps`` ``(B_i, T_i)`` of every micro-batch of a fresh rollout batch, before any update
        (and ``klear_old_entropies`` ``(B_i, T_i)`` when the loss mode ``needs_old_entropies``).

        TRL computes them for the WHOLE rollout batch inside ``_generate_and_score_completions``, filtered
        samples included; here the same log-prob function runs on each micro-batch after
        :func:`drop_filtered_samples`, i.e. on the kept samples only and on the exact tensors the loss forward
        will see, so the first optimizer step's ratio is 1 up to float32 rounding. As in TRL, nothing is
        computed when each rollout batch feeds exactly one optimizer step (on-policy: ``_compute_loss`` then
        uses ``log_prob.detach()`` and its entropies).

        With ``old_log_prob_source="rollout"`` a micro-batch whose rollout came with the decode loop's sampling
        log-probs (``sampling_per_token_logps``, see :meth:`_generate_single_turn`) takes those instead: the same
        policy's log-probs from the forward that sampled each token (float32 rounding aside), without the pass.
        """
        assert self.args.steps_per_generation is not None, "GRPOConfig.__post_init__ always sets it"
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.gradient_accumulation_steps % generate_every == 0:
            return
        with_entropy = self.args.loss_settings().mode.needs_old_entropies
        ckpt_kwargs = self.args.gradient_checkpointing_kwargs
        assert not isinstance(ckpt_kwargs, str), "GPPOConfig.__post_init__ refuses text kwargs"
        # the policy is a PreTrainedModel (a PeftModel forwards the checkpointing methods it needs)
        policy = cast(PreTrainedModel, self.model)
        rollout = self.args.old_log_prob_source == "rollout"
        with torch.no_grad(), disable_gradient_checkpointing(policy, ckpt_kwargs):
            for mb in micro_batches:
                if rollout and mb.get("old_per_token_logps") is None:
                    mb["old_per_token_logps"] = mb.get("sampling_per_token_logps")  # the sampler's, same shape
                if mb.get("old_per_token_logps") is None:
                    log_prob, entropies = self._timed(
                        "old_log_prob", self._policy_log_probs, self.model, mb, compute_entropy=with_entropy
                    )
                    mb["old_per_token_logps"] = log_prob
                    if with_entropy:
                        mb["klear_old_entropies"] = entropies

    def _annotate_optimizer_windows(self, micro_batches: list[dict[str, Any]]) -> None:
        """Store in each micro-batch the exact token/sequence counts of its optimizer step.

        Micro-batch ``i`` of a rollout batch belongs to optimizer step ``i // gradient_accumulation_steps``.
        Counts are summed over the window's micro-batches (:func:`optimizer_window_counts`) and all processes,
        then divided by the number of processes because DDP/FSDP/DeepSpeed AVERAGE gradients over processes.
        """
        ga = self.args.gradient_accumulation_steps
        counts = optimizer_window_counts(
            [self._loss_mask(mb) for mb in micro_batches], [mb["klear_is_correct"] for mb in micro_batches], ga
        )
        counts = self.accelerator.reduce(counts, reduction="sum") / self.accelerator.num_processes
        # python floats (float32 values): one host sync per rollout batch, none in the micro-batches' losses
        window = counts.float().tolist()
        for i, mb in enumerate(micro_batches):
            mb["klear_num_tokens"], mb["klear_num_sft_tokens"], mb["klear_num_seqs"] = window[i // ga][:3]

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
        """(B, T) float mask of the tokens that enter the loss: completion (and tool) mask times the keep flag."""
        mask = inputs["completion_mask"].float()
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"].float()
        keep = inputs.get("klear_keep")
        if keep is not None:
            mask = mask * keep.to(mask.dtype).unsqueeze(1)
        return mask

    # ------------------------------------------------------------------ loss side
    def _shares_prompt_forward(self, model, inputs: dict[str, Any]) -> bool:
        """Whether this micro-batch's log-prob pass runs through :func:`klear.rl.shared_prompt.shared_prompt_log_probs`:
        ``share_prompt_forward`` (None: a CPU with one process), a model no wrapper holds (DDP, e.g. under a
        colocated vLLM engine's process group, would see two forwards per backward), no gradient checkpointing, no
        per-token model extras (images, token types), prompts of at least 2 tokens."""
        share = self.args.share_prompt_forward
        if share is None:
            share = self.accelerator.device.type == "cpu" and self.accelerator.num_processes == 1
        return bool(
            share
            and self.accelerator.unwrap_model(model) is model
            and not getattr(model, "is_gradient_checkpointing", False)
            and all(inputs.get(key) is None for key in _FORWARD_KEYS)
            and inputs["prompt_ids"].size(1) >= 2
        )

    def _policy_log_probs(self, model, inputs: dict[str, Any], compute_entropy: bool = False):
        """``(log_prob (B, T), entropies (B, T) or None)`` of a micro-batch's completion tokens under ``model``,
        from TRL's ``_get_per_token_logps_and_entropies`` (temperature-scaled), as the loss uses them; with
        :meth:`_shares_prompt_forward`, each distinct prompt's forward is computed once
        (:mod:`klear.rl.shared_prompt`, the same numbers to float rounding)."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        if self._shares_prompt_forward(model, inputs):
            return shared_prompt_log_probs(
                model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                completion_mask,
                compute_entropy=compute_entropy,
                autocast=self.accelerator.autocast,
            )
        log_prob, entropies, _ = super()._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=compute_entropy,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        return log_prob, entropies

    def _compute_loss(self, model, inputs):
        settings = self.args.loss_settings()
        mode = "train" if self.model.training else "eval"
        windowed = mode == "train" and "klear_num_tokens" in inputs
        if not windowed and mode == "train":  # pragma: no cover - every training micro-batch is annotated
            raise RuntimeError("training micro-batch without optimizer-window token counts")
        # TRL's logged entropy needs the current entropies anyway; the loss gets them only if its mode reads them.
        log_prob, entropies = self._policy_log_probs(model, inputs, compute_entropy=True)
        old_log_prob = inputs.get("old_per_token_logps")
        old_entropies = inputs.get("klear_old_entropies")
        if old_log_prob is None:  # on-policy step: TRL skips the recomputation, the ratio is exactly 1
            old_log_prob = log_prob.detach()
            old_entropies = entropies.detach()
        batch = LossInputs(
            log_prob=log_prob,
            old_log_prob=old_log_prob,
            advantages=inputs["advantages"],
            response_mask=self._loss_mask(inputs) != 0,  # bool: the loss then checks its values without a sync
            entropies=entropies,  # read by the modes that need them; the entropy metrics for every mode
            old_entropies=old_entropies if settings.mode.needs_old_entropies else None,
            is_correct=inputs["klear_is_correct"],
            # The exact counts of this optimizer step (all micro-batches, all processes); None: this micro-batch's.
            num_tokens=inputs["klear_num_tokens"] if windowed else None,
            num_seqs=inputs["klear_num_seqs"] if windowed else None,
            num_sft_tokens=inputs["klear_num_sft_tokens"] if windowed else None,
        )
        loss, loss_metrics = total_loss(batch, settings)
        self._micro_batch_metrics(mode, inputs, entropies, windowed, loss_metrics)
        return loss

    # ------------------------------------------------------------------ metrics
    def _micro_batch_metrics(
        self,
        mode: str,
        inputs: dict[str, Any],
        entropies: torch.Tensor,
        windowed: bool,
        loss_metrics: dict[str, torch.Tensor],
    ) -> None:
        """Queue one micro-batch's metrics, combined over processes, with ONE collective and no host sync.

        The entropy sums (``(2,)``: entropy x completion mask, mask) and every loss metric (``(K,)``, float32) are
        stacked into one vector and gathered once (``(num_processes, 2 + K)``); per column the entropies are summed
        and each loss metric reduced by its :data:`klear.rl.losses.METRIC_REDUCTIONS` rule (mean, max, min) in its
        own dtype, so the values are those of one reduce/gather per metric. They stay on the device until
        :meth:`log` reads all the queued values with one host sync (:meth:`_flush_metrics`).
        """
        token_mask = inputs["completion_mask"].float()
        ent = torch.stack([(entropies.detach() * token_mask).sum(), token_mask.sum()])
        names = list(loss_metrics)
        values = [v.to(dtype=torch.float32, device=ent.device).reshape(1) for v in loss_metrics.values()]
        local = torch.cat([ent, *values]).to(torch.promote_types(ent.dtype, torch.float32))  # widening: exact
        gathered = self.accelerator.gather(local).view(self.accelerator.num_processes, -1)
        ent_sum = gathered[:, :2].to(ent.dtype).sum(dim=0)
        reduce: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "mean": torch.mean,
            "max": torch.amax,
            "min": torch.amin,
        }
        row = [(ent_sum[0] / ent_sum[1].clamp(min=1.0)).reshape(1)]
        for i, key in enumerate(names):
            row.append(reduce[METRIC_REDUCTIONS.get(key, "mean")](gathered[:, 2 + i].to(torch.float32)).reshape(1))
        keys: list[tuple[str, int]] = [("entropy", 1)] + [(f"klear/{key}", 1) for key in names]
        if windowed:  # the exact divisors of this optimizer step (all processes)
            n_proc = self.accelerator.num_processes
            keys += [("klear/num_loss_tokens", n_proc), ("klear/num_sft_tokens", n_proc)]
            counts = [inputs["klear_num_tokens"], inputs["klear_num_sft_tokens"]]
            row.append(torch.tensor(counts, dtype=torch.float32, device=row[0].device))
        if not hasattr(self, "_klear_pending_metrics"):
            self._klear_pending_metrics = []
        self._klear_pending_metrics.append((mode, keys, torch.cat(row)))

    def _flush_metrics(self) -> None:
        """Append the queued micro-batch metrics to ``self._metrics`` (where TRL's ``log`` averages them), reading
        them from the device with one host sync; a count metric is multiplied by the number of processes
        (``klear_num_tokens`` is the per-process share of the step's count)."""
        pending = getattr(self, "_klear_pending_metrics", None)
        if not pending:
            return
        values = iter(torch.cat([row for _, _, row in pending]).tolist())
        for mode, keys, _ in pending:
            m = self._metrics[mode]
            for key, scale in keys:
                value = next(values)
                m[key].append(value * scale if scale != 1 else value)
        pending.clear()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._flush_metrics()
        super().log(logs, start_time)
