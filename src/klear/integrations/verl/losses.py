"""klear's policy losses registered in verl's policy-loss registry, and the SFT term on correct rollouts.

One copy of the math: every function here translates verl's arguments into klear's
:class:`~klear.rl.losses.LossInputs` / :class:`~klear.rl.losses.LossSettings` and calls
:func:`klear.rl.losses.compute_policy_loss` / :func:`klear.rl.losses.sft_loss`.

Registered names (``actor_rollout_ref.actor.policy_loss.loss_mode=...``):

* ``gppo``: GPPO (paper Eq. 11, 12; with ``beta1``/``beta2`` Eq. 17, 18).
* ``gppo_only_high``: only the high-side clipped gradient kept (Appendix A.2).

verl's own ``cispo`` already is Eq. 15 (``-sg(clip(r)) * A * log_prob``, no dual clip), checked against
klear's ``cispo`` by ``tests/test_verl.py``, so it is not registered again.

Normaliser.  verl's ``agg_loss`` divides the micro-batch's token sum by ``batch_num_tokens`` (the
mini-batch's unmasked token count summed over data-parallel ranks) and multiplies by ``dp_size``
(DDP/FSDP average gradients over ranks).  klear's ``num_tokens`` is therefore
``batch_num_tokens / dp_size``, and ``num_seqs`` is ``global_batch_size / dp_size``.  Without
``global_batch_info`` (a single process calling the loss directly) klear's own counts are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.workers.config import PolicyLossConfig

from klear.rl.losses import LossInputs, LossSettings, compute_policy_loss, sft_loss

__all__ = [
    "GPPOLossConfig",
    "KLEAR_VERL_LOSS_MODES",
    "SFT_NORMS",
    "compute_policy_loss_gppo",
    "compute_policy_loss_gppo_only_high",
    "klear_settings",
    "sft_term",
    "verl_divisors",
]

#: The policy-loss names this module registers with verl (each is the klear ``loss_mode`` of the same name).
KLEAR_VERL_LOSS_MODES: tuple[str, ...] = ("gppo", "gppo_only_high")
#: Normalisations of the SFT term: ``mini_batch`` (Eq. 13: the mini-batch's correct-response token count
#: across data-parallel ranks) or ``micro_batch`` (the authors' scripts: each micro-batch's own count).
SFT_NORMS: tuple[str, ...] = ("mini_batch", "micro_batch")


@dataclass
class GPPOLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus GPPO's gradient scales and the SFT term (Eq. 13, 14).

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=klear.integrations.verl.GPPOLossConfig``
    and set the new keys with Hydra's ``+`` prefix (``+actor_rollout_ref.actor.policy_loss.beta1=0.5``).

    Attributes:
        beta1: low-side clipped gradient scale (Eq. 17), ``>= 0``; only ``gppo`` may move it off 1.0.
        beta2: high-side clipped gradient scale (Eq. 17), ``>= 0``; ``gppo`` and ``gppo_only_high``.
        sft_alpha: weight alpha of the SFT term on correct rollouts (Eq. 14), ``>= 0``; the paper uses 0.1.
            Used by the klear trainer (``trainer.v1.trainer_mode=klear_sync``); 0 turns the term off.
        sft_norm: one of ``SFT_NORMS``.

    Raises:
        ValueError: a value out of range, ``beta1``/``beta2`` != 1 for a loss mode that does not use them,
            or an unknown ``sft_norm`` (from :class:`klear.rl.losses.LossSettings`' checks).
    """

    beta1: float = 1.0
    beta2: float = 1.0
    sft_alpha: float = 0.0
    sft_norm: str = "mini_batch"

    def __post_init__(self) -> None:
        if self.sft_norm not in SFT_NORMS:
            raise ValueError(f"policy_loss.sft_norm must be one of {', '.join(SFT_NORMS)}; got {self.sft_norm!r}")
        mode = self.loss_mode if self.loss_mode in KLEAR_VERL_LOSS_MODES else "ppo_clip"
        try:
            LossSettings(loss_mode=mode, beta1=self.beta1, beta2=self.beta2, alpha=self.sft_alpha)
        except (TypeError, ValueError) as e:
            raise ValueError(f"actor_rollout_ref.actor.policy_loss: {e}") from None


def _get(config: Any, key: str, default: Any = None) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def klear_settings(loss_mode: str, loss_agg_mode: str, config: Any) -> LossSettings:
    """The klear :class:`LossSettings` of a verl actor config.

    Args:
        loss_mode: a klear loss mode (``"gppo"``, ``"gppo_only_high"``, ``"ppo_clip"``, ``"cispo"``).
        loss_agg_mode: verl's ``loss_agg_mode``; klear supports ``token-mean``, ``seq-mean-token-mean``
            and ``seq-mean-token-sum``.
        config: verl's ``ActorConfig`` (or a mapping with its keys): ``clip_ratio``, ``clip_ratio_low``,
            ``clip_ratio_high`` (None falls back to ``clip_ratio``, as verl does), ``clip_ratio_c`` (verl
            always applies dual clip; default 3.0, the paper's scripts use 10) and ``policy_loss``
            (``beta1``/``beta2`` when it is a :class:`GPPOLossConfig`, else 1.0).

    Returns:
        The validated settings (``alpha`` 0: the SFT term is added by :func:`sft_term`, not here).

    Raises:
        ValueError: an out-of-range value or an aggregation klear does not implement (named).
    """
    clip = _get(config, "clip_ratio", 0.2)
    low, high = _get(config, "clip_ratio_low"), _get(config, "clip_ratio_high")
    policy_cfg = _get(config, "policy_loss") or {}
    try:
        return LossSettings(
            loss_mode=loss_mode,
            clip_ratio_low=clip if low is None else low,
            clip_ratio_high=clip if high is None else high,
            clip_ratio_c=_get(config, "clip_ratio_c", 3.0),
            beta1=_get(policy_cfg, "beta1", 1.0),
            beta2=_get(policy_cfg, "beta2", 1.0),
            loss_agg_mode=loss_agg_mode,
            alpha=0.0,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"klear loss {loss_mode!r} under verl (actor_rollout_ref.actor): {e}") from None


def verl_divisors(config: Any) -> tuple[float | None, float | None]:
    """klear's ``(num_tokens, num_seqs)`` from verl's ``config.global_batch_info``.

    ``num_tokens = batch_num_tokens / dp_size`` and ``num_seqs = global_batch_size / dp_size`` (see the
    module docstring); each is None when verl gave no global count (then klear uses the batch's own).

    Raises:
        ValueError: ``dp_size > 1`` without the global count (verl's ``agg_loss`` refuses it too).
    """
    info = _get(config, "global_batch_info") or {}
    dp_size = int(info.get("dp_size", 1) or 1)
    out: list[float | None] = []
    for key in ("batch_num_tokens", "global_batch_size"):
        value = info.get(key)
        if value is None:
            if dp_size > 1:
                raise ValueError(f"global_batch_info[{key!r}] is required when dp_size={dp_size} > 1")
            out.append(None)
        else:
            out.append(float(value) / dp_size)
    return out[0], out[1]


def _verl_policy_loss(loss_mode: str, doc: str):
    """verl's policy-loss function for klear's ``loss_mode`` (signature: verl's protocol), registered."""

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise ValueError(f"verl policy loss {loss_mode!r} needs the actor config (config=None)")
        if rollout_is_weights is not None:
            raise ValueError(
                f"verl policy loss {loss_mode!r} does not support rollout correction weights; "
                "unset actor_rollout_ref.actor.policy_loss.rollout_correction"
            )
        settings = klear_settings(loss_mode, loss_agg_mode, config)
        num_tokens, num_seqs = verl_divisors(config)
        inputs = LossInputs(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            num_tokens=num_tokens if settings.loss_agg_mode == "token-mean" else None,
            num_seqs=None if settings.loss_agg_mode == "token-mean" else num_seqs,
        )
        loss, m = compute_policy_loss(inputs, settings)
        metrics = {
            "actor/pg_clipfrac": m["clip_frac"].item(),
            "actor/ppo_kl": m["ppo_kl"].item(),
            # verl's name for the fraction of tokens taking the dual-clip cap.
            "actor/pg_clipfrac_lower": m["dual_clip_frac"].item(),
            "actor/pg_clipfrac_high": m["clip_frac_high"].item(),
            "actor/pg_clipfrac_low": m["clip_frac_low"].item(),
            "actor/ratio_mean": m["ratio_mean"].item(),
        }
        return loss, metrics

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{loss_mode}"
    policy_loss.__doc__ = doc
    return register_policy_loss(loss_mode)(policy_loss)


compute_policy_loss_gppo = _verl_policy_loss(
    "gppo",
    """verl policy loss ``gppo``: :func:`klear.rl.losses.compute_policy_loss` with ``loss_mode="gppo"``.

Args (verl's policy-loss protocol, called by keyword):
    old_log_prob, log_prob: ``(B, T)`` float; ``log_prob`` requires grad.
    advantages: ``(B, T)`` float (verl broadcasts the GRPO advantage, Eq. 4, over the tokens).
    response_mask: ``(B, T)`` bool/0-1.
    loss_agg_mode: ``token-mean`` (Eq. 7, the paper's), ``seq-mean-token-mean`` or ``seq-mean-token-sum``.
    config: verl's ``ActorConfig``; see :func:`klear_settings` and :func:`verl_divisors`.
    rollout_is_weights: must be None.

Returns:
    ``(loss, metrics)``: the 0-dim loss (value equal to PPO's clipped surrogate, gradient Eq. 12 / 18)
    normalised as verl's ``agg_loss``; metrics as python floats (``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` = dual-clip fraction, ``actor/pg_clipfrac_high``, ``actor/pg_clipfrac_low``,
    ``actor/ratio_mean``).

Raises:
    ValueError: no config, rollout correction weights, a bad setting or shape (from klear's checks).
""",
)
compute_policy_loss_gppo_only_high = _verl_policy_loss(
    "gppo_only_high",
    "verl policy loss ``gppo_only_high`` (klear's, Appendix A.2); as :func:`compute_policy_loss_gppo`.",
)


def sft_term(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    is_correct: torch.Tensor,
    sft_norm: str,
    *,
    num_sft_tokens: float | None = None,
    dp_size: int = 1,
    num_micro_batches: int = 1,
) -> torch.Tensor:
    """The SFT loss on correct rollouts of one micro-batch (Eq. 13), normalised for verl's gradient sums.

    verl sums the micro-batch losses of a mini-batch and averages gradients over data-parallel ranks.

    * ``sft_norm="mini_batch"`` (Eq. 13): the divisor is ``num_sft_tokens / dp_size`` where
      ``num_sft_tokens`` is the mini-batch's correct-response token count summed over ranks, so the sum over
      micro-batches and the average over ranks is exactly the token mean over the whole mini-batch.
    * ``sft_norm="micro_batch"`` (the authors' scripts): the micro-batch's own token mean divided by
      ``num_micro_batches`` (their gradient-accumulation scaling); ranks are averaged as they come.

    Args:
        log_prob: ``(B, T)`` float, requires grad.
        response_mask: ``(B, T)`` 0/1.
        is_correct: ``(B,)`` 0/1, the responses in Phi (Eq. 13).
        sft_norm: one of ``SFT_NORMS``.
        num_sft_tokens: required for ``mini_batch``.
        dp_size: data-parallel world size.
        num_micro_batches: micro-batches per mini-batch on this rank, for ``micro_batch``.

    Returns:
        0-dim loss, ``promote(log_prob.dtype, float32)``; exactly 0 (still differentiable) when nothing is correct.

    Raises:
        ValueError: unknown ``sft_norm``, missing ``num_sft_tokens``, ``num_micro_batches < 1``, or klear's
            :func:`~klear.rl.losses.sft_loss` checks.
    """
    if sft_norm == "mini_batch":
        if num_sft_tokens is None:
            raise ValueError("sft_norm='mini_batch' needs num_sft_tokens (the mini-batch's correct-token count)")
        return sft_loss(log_prob, response_mask, is_correct, num_tokens=float(num_sft_tokens) / dp_size)
    if sft_norm == "micro_batch":
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        return sft_loss(log_prob, response_mask, is_correct) / num_micro_batches
    raise ValueError(f"sft_norm must be one of {', '.join(SFT_NORMS)}; got {sft_norm!r}")
