"""Policy-gradient and SFT losses of the Klear-Reasoner RL stage (pure torch), as a registry of loss modes.

Source: Su et al., "Klear-Reasoner: Advancing Reasoning Capability via
Gradient-Preserving Clipping Policy Optimization" (arXiv 2508.07629). Equation and
section numbers are the paper's.

Every loss here is *minimised*: loss = -objective.  Notation per token:
``r = exp(log_prob - old_log_prob)`` (the importance ratio, delta in the paper),
``A`` the advantage, ``lo = 1 - clip_ratio_low``, ``hi = 1 + clip_ratio_high``,
``c = clip_ratio_c`` (dual clip), ``phi = grad log pi_theta(a_t | s_t)``.

Gradient table
--------------
The gradient of one token's loss is ``-F * A * phi`` (then scaled by the
aggregation weight, e.g. ``1 / N`` for token-mean).  ``F`` per mode (Eq. 10, 12,
16, 18):

=====================================  ========  ===========  ==============  =========
case                                   ppo_clip  gppo         gppo_only_high  cispo
=====================================  ========  ===========  ==============  =========
lo <= r <= hi (inside the band)        r         r            r               r
r < lo and A < 0 (clipped low)         0         beta1 * lo   0               lo
r < lo and A > 0                       r         r            r               lo
r > hi and A > 0 (clipped high)        0         beta2 * hi   beta2 * hi      hi
r > hi and A < 0 (and r <= c)          r         r            r               hi
A < 0 and r > c (dual-clip cap taken)  0         0            0               0
=====================================  ========  ===========  ==============  =========

* ``ppo_clip``: PPO / GRPO (Eq. 1, 5); DAPO Clip-Higher (Eq. 6) when
  ``clip_ratio_high > clip_ratio_low``.
* ``gppo``: gradient-preserving clipping (Eq. 11, 12), general form with
  ``beta1`` / ``beta2`` (Appendix A.2, Eq. 17, 18).  The forward value is exactly
  that of ``ppo_clip``; only the gradient of clipped tokens differs.
* ``gppo_only_high``: only the high-side clipped gradient is kept (scaled by
  ``beta2``); low-side clipped tokens get zero gradient as in PPO.
* ``cispo``: MiniMax-M1's CISPO (Appendix A.1, Eq. 15, 16), per-token loss
  ``-sg(clip(r, lo, hi)) * A * log_prob``.

The RL objective is ``L = L_pg + alpha * L_LM`` (Eq. 14) with ``L_LM`` the SFT loss on
the correct rollouts (Eq. 13, Sec. 3.2.3): :func:`total_loss`.

CE-GPPO (Su et al., arXiv 2509.20712) is ``gppo`` with ``beta1 < beta2`` used as an entropy
controller (released: ``beta1`` 0.5 or 0.75, ``beta2 = 1``, ``eps_low = eps_high = 0.2``): the
low-side clipped tokens (``A < 0``, ``r < lo``) push already-unlikely tokens down and so lower the
entropy; scaling their gradient by ``beta1 < 1`` slows the entropy decrease.  It needs no mode of its
own (``configs/rl_math_cegppo.yaml``); when the per-token entropies are passed, the metrics
``entropy_share_clip_high`` / ``entropy_share_clip_low`` show which clipped tokens carry entropy.

Entropy Ratio Clipping
----------------------
ERC (Su et al., "Entropy Ratio Clipping as a Soft Global Constraint for Stable Reinforcement
Learning", arXiv 2512.05591; released code ``Kwai-Klear/ERC``, ``compute_policy_loss_gppo_erc`` /
``compute_policy_loss_grpo_erc``) adds, per token, the entropy ratio
``rho = (H_theta(s_t) + 1e-8) / (H_old(s_t) + 1e-8)`` of the current and the rollout policy's
next-token distributions.  A token with ``rho`` outside the open band ``(1 - erc_low, 1 + erc_high)``
(released: ``0.95, 1.05``) keeps its loss value but gets no gradient: its per-token loss ``l`` is
replaced by ``sg(l)``; it stays in the divisor of every aggregation.  So ``F`` of the gradient table
becomes ``F * 1[1 - erc_low < rho < 1 + erc_high]``:

* ``ppo_erc``: ``ppo_clip`` + ERC (the authors' DAPO + ERC, ``grpo_erc``).
* ``gppo_erc``: ``gppo`` (with ``beta1`` / ``beta2``) + ERC (the authors' ``gppo_erc``).

ERC is not defined for CISPO in the paper (it integrates ERC into DAPO and GPPO only), so there is no
``cispo_erc``.  Choices where the paper leaves room, all as in the authors' code: ``H`` is the entropy
(nats) of the temperature-scaled distribution (the one the log-probs come from); ``H_theta`` is the
current policy's entropy used only as a mask, so it is detached; the ``1e-8`` (``ERC_ENTROPY_EPS``) is
theirs, so two (near-)zero entropies give ``rho = 1`` (kept) and a token whose rollout entropy was
about 0 but whose current entropy is not is masked; a token whose ``rho`` is NaN is masked; the mask
is applied to the whole per-token term after clipping (the dual-clip cap is a constant anyway) and
never to the SFT term.

Registry
--------
``LOSS_REGISTRY`` maps each ``loss_mode`` name to a :class:`LossMode`: a small function
``token_loss(terms: TokenTerms, settings: LossSettings) -> TokenLoss`` (the per-token loss
and which tokens it clipped) plus what the mode needs: the mode-specific settings it reads
(``beta1``/``beta2``, ``erc_low``/``erc_high``; any other mode must leave them at their defaults) and
whether it needs the
per-token entropies of the current (``needs_entropies``) or rollout (``needs_old_entropies``)
policy, which the trainer then computes and passes in :class:`LossInputs`.  Everything
shared by the modes happens once, in :func:`compute_policy_loss`: input validation, the
masked log-ratio and ratio (:class:`TokenTerms`), the dual-clip cap, the aggregation
(:func:`aggregate`) and the metrics.  :class:`LossSettings` validates every setting on
construction; ``GPPOConfig`` builds one when it is created, so a bad setting fails before
any model loads.

Adding a loss mode: write its ``token_loss`` function here and add its :class:`LossMode`
to ``_BUILTIN_MODES``; add its column to ``F_TABLE`` / ``MODE_CONFIGS`` in
``tests/test_losses.py`` (the gradient-table test then checks it) and its own tests there.
A mode with settings of its own also needs the field in :class:`LossSettings` (with its
check, and its default in ``_MODE_SETTING_NEUTRAL``) and a field of the same name in
``klear.rl.trainer.GPPOConfig`` (forwarded by name, checked by a test).

Implementation notes
--------------------
* The clipped GPPO terms are written in the paper as ``hi / sg(r) * r`` (value
  ``hi``, gradient ``hi * phi``).  We use the mathematically equivalent
  ``hi + hi * beta * (lr - sg(lr))`` with ``lr = log_prob - old_log_prob``: the
  added term is exactly 0.0 in the forward pass (so the loss value is *bit-equal*
  to ``ppo_clip``) and its derivative w.r.t. ``log_prob`` is exactly 1, giving
  ``F = beta * hi`` without the rounding of ``r / r``.
* Dual clip (not in the paper; dual-clip PPO of Ye et al., 2020, as in verl; the
  authors' scripts use ``c = 10``): for ``A < 0`` the PPO loss ``L = -min(rA, clip(r)A)``
  is capped at ``-A * c``; the cap is taken exactly when ``r > c`` (because
  ``c > 1 > lo``).  Capped tokens contribute the *constant* ``-A * c`` and have zero
  gradient in every mode.  **CISPO + dual clip:** the same rule is applied -- a token
  with ``A < 0`` and ``r > c`` contributes the constant ``-A * c`` instead of
  ``-sg(clip(r)) * A * log_prob`` (zero gradient).  Without ``clip_ratio_c`` CISPO
  keeps ``F = hi`` on such tokens, as in Eq. 16.
* NaN safety: the log-ratio is zeroed with ``torch.where`` at masked positions
  *before* ``exp``, masked per-token losses are dropped with ``torch.where`` (never
  by multiplying with the mask), so padded positions holding ``-1e4``, ``inf`` or
  ``nan`` poison neither the loss nor the gradient.  Advantages are also zeroed at
  masked positions.  For numerical safety on unmasked tokens the log-ratio is clamped
  to ``[-20, 20]`` before ``exp`` (as verl does): beyond that range the unclipped
  branch ``-r * A`` has zero gradient.  The gradient-preserving GPPO terms and
  CISPO's ``log_prob`` term do not go through the clamp.
* Dtypes: per-token math runs in the input dtype (the promotion of ``log_prob`` and
  ``old_log_prob``; float32, bfloat16, float16 and float64 all work).  Reductions
  (sums over tokens, divisions by counts) and metrics accumulate in
  ``promote(dtype, float32)``, so the returned loss is float32 for bf16/fp16 inputs
  and float64 for float64 inputs.  Counts stay integer tensors: a float divided by
  one keeps the float's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple

import torch

__all__ = [
    "LOSS_MODES",
    "LOSS_AGG_MODES",
    "LOSS_REGISTRY",
    "ERC_ENTROPY_EPS",
    "LOG_RATIO_CLAMP",
    "METRIC_REDUCTIONS",
    "LossInputs",
    "LossMode",
    "LossSettings",
    "TokenLoss",
    "TokenTerms",
    "add_sft_term",
    "aggregate",
    "compute_policy_loss",
    "entropy_ratio",
    "policy_loss",
    "sft_loss",
    "total_loss",
]

#: Valid values of ``loss_agg_mode``.
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: The log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``.
LOG_RATIO_CLAMP: float = 20.0
#: How a metric of :func:`compute_policy_loss` combines over processes / micro-batches
#: (``"max"`` or ``"min"``); every metric not listed is averaged.
METRIC_REDUCTIONS: dict[str, str] = {
    "ratio_max": "max",
    "ratio_min": "min",
    "entropy_ratio_max": "max",
    "entropy_ratio_min": "min",
}
#: Added to both entropies of the ERC ratio ``rho = (H + eps) / (H_old + eps)`` (the authors' value).
ERC_ENTROPY_EPS: float = 1e-8

Count = int | float | torch.Tensor


# --------------------------------------------------------------------------- validation helpers


def _check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def _check_scalar(
    name: str, value: object, *, min_value: float, min_inclusive: bool = True, max_value: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < min_value or (not min_inclusive and v == min_value):
        op = ">=" if min_inclusive else ">"
        raise ValueError(f"{name} must be {op} {min_value}, got {v}")
    if max_value is not None and v >= max_value:
        raise ValueError(f"{name} must be < {max_value}, got {v}")
    return v


def _as_bool_mask(name: str, mask: object, shape: tuple[int, ...], shape_desc: str) -> torch.Tensor:
    """Validate a 0/1 mask (bool, integer or float) and return it as a bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape_desc} = {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):  # an empty mask has no bad value
        raise ValueError(f"{name} must contain only 0 and 1 (it is a mask, not weights)")
    return mask != 0


def _resolve_count(name: str, value: Count | None, local_count: torch.Tensor, what: str) -> float | None:
    """Validate an explicit divisor (``num_tokens``, ``num_seqs``) against this batch's own count.

    Returns the divisor as a python float (1.0 when it is 0 and there is nothing to
    divide), or None when ``value`` is None. A tensor ``value`` costs one host sync (``.item()``); a
    python number none (this batch's count is read only when ``value`` is 0).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a 1-element tensor, got a bool")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        v = float(value.item())
    elif isinstance(value, Real):
        v = float(value)
    else:
        raise TypeError(f"{name} must be a number or a 1-element tensor, got {type(value).__name__}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    if v > 0:
        # No lower bound against this batch's count: under data parallelism the divisor is the whole step's
        # count divided by the number of workers (their gradients are averaged), which can be below the count
        # of a worker that holds more than average.
        return v
    local = int(local_count.item())
    if local > 0:
        raise ValueError(f"{name} must be > 0 when the batch has {what} (this batch has {local})")
    return 1.0


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------- data types


class TokenTerms(NamedTuple):
    """Per-token quantities shared by every loss mode, built once by :func:`compute_policy_loss`.

    All tensors are ``(B, T)`` in the input dtype ``promote(log_prob.dtype, old_log_prob.dtype)``.

    Attributes:
        mask: bool, the tokens that count.
        log_prob: log pi_theta (with grad); masked positions keep whatever the caller put there.
        adv: advantages broadcast to ``(B, T)``, 0 at masked positions.
        log_ratio: ``log_prob - old_log_prob``, 0 at masked positions, not clamped (with grad).
        ratio: ``exp(clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))`` (with grad).
        lo: ``1 - clip_ratio_low`` (float).
        hi: ``1 + clip_ratio_high`` (float).
        entropies: detached per-token entropies (nats) of the current policy, or None.
        old_entropies: detached per-token entropies (nats) of the rollout policy, or None.
    """

    mask: torch.Tensor
    log_prob: torch.Tensor
    adv: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    lo: float
    hi: float
    entropies: torch.Tensor | None
    old_entropies: torch.Tensor | None


class TokenLoss(NamedTuple):
    """What a mode's ``token_loss`` returns; every tensor but the metrics is ``(B, T)``.

    Attributes:
        per_token: the per-token loss (before the dual-clip cap, masking and aggregation).
        clipped_high: bool, tokens clipped from above (counted in ``clip_frac_high``).
        clipped_low: bool, tokens clipped from below (counted in ``clip_frac_low``).
        metrics: the mode's own detached 0-dim metrics over the unmasked tokens (added to those of
            :func:`compute_policy_loss`), or None.
    """

    per_token: torch.Tensor
    clipped_high: torch.Tensor
    clipped_low: torch.Tensor
    metrics: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class LossMode:
    """One entry of ``LOSS_REGISTRY``.

    Attributes:
        name: the ``loss_mode`` value.
        token_loss: ``(TokenTerms, LossSettings) -> TokenLoss``, pure tensor math.
        settings: the mode-specific settings the mode reads (names of ``LossSettings`` fields in
            ``_MODE_SETTING_NEUTRAL``); every other mode-specific setting must keep its neutral value.
        needs_entropies: the mode reads ``TokenTerms.entropies`` (current policy).
        needs_old_entropies: the mode reads ``TokenTerms.old_entropies`` (rollout policy).
    """

    name: str
    token_loss: Callable[[TokenTerms, LossSettings], TokenLoss]
    settings: tuple[str, ...] = ()
    needs_entropies: bool = False
    needs_old_entropies: bool = False


#: Mode-specific settings and their default (the value every mode that does not read them must keep).
_MODE_SETTING_NEUTRAL: dict[str, float] = {"beta1": 1.0, "beta2": 1.0, "erc_low": 0.05, "erc_high": 0.05}


@dataclass(frozen=True)
class LossSettings:
    """The validated loss settings; constructing one IS the validation (``GPPOConfig`` builds one too).

    Attributes:
        loss_mode: a key of ``LOSS_REGISTRY`` (see :func:`policy_loss`).
        clip_ratio_low: eps_low (Eq. 5), ``0 <= eps_low < 1``.
        clip_ratio_high: eps_high (Eq. 5, 6), ``>= 0``.
        clip_ratio_c: dual-clip bound ``c > 1``, or None (off).
        beta1: low-side clipped gradient scale of ``gppo`` (Eq. 17), ``>= 0``; 1.0 for other modes.
        beta2: high-side clipped gradient scale of ``gppo`` / ``gppo_only_high`` (Eq. 17), ``>= 0``;
            1.0 for other modes.
        erc_low: ERC band below 1 (``ppo_erc`` / ``gppo_erc``): tokens with entropy ratio
            ``rho <= 1 - erc_low`` get no gradient; ``0 < erc_low < 1``; 0.05 (the released value) for
            other modes.
        erc_high: ERC band above 1: tokens with ``rho >= 1 + erc_high`` get no gradient; ``> 0``; 0.05
            for other modes.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        alpha: weight of the SFT term in :func:`total_loss` (Eq. 14), ``>= 0``; the paper uses 0.1.

    Numbers are stored as python floats.

    Raises:
        ValueError: unknown ``loss_mode`` / ``loss_agg_mode`` (lists the valid ones); a value
            out of range or not finite (names the field, the bound and the value); a
            mode-specific setting (``beta1``, ``beta2``, ``erc_low``, ``erc_high``) away from its
            default for a mode that does not use it (names the modes that do).
        TypeError: a number field is not a real number (or is a bool).
    """

    loss_mode: str = "gppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = None
    beta1: float = 1.0
    beta2: float = 1.0
    erc_low: float = 0.05
    erc_high: float = 0.05
    loss_agg_mode: str = "token-mean"
    alpha: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.loss_mode, str) or self.loss_mode not in LOSS_REGISTRY:
            raise ValueError(f"unknown loss_mode {self.loss_mode!r}; valid modes: {', '.join(LOSS_REGISTRY)}")
        if not isinstance(self.loss_agg_mode, str) or self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
        checked = {
            "clip_ratio_low": _check_scalar("clip_ratio_low", self.clip_ratio_low, min_value=0.0, max_value=1.0),
            "clip_ratio_high": _check_scalar("clip_ratio_high", self.clip_ratio_high, min_value=0.0),
            "beta1": _check_scalar("beta1", self.beta1, min_value=0.0),
            "beta2": _check_scalar("beta2", self.beta2, min_value=0.0),
            # An empty band (0) would take every token's gradient away, rho == 1 included.
            "erc_low": _check_scalar("erc_low", self.erc_low, min_value=0.0, min_inclusive=False, max_value=1.0),
            "erc_high": _check_scalar("erc_high", self.erc_high, min_value=0.0, min_inclusive=False),
            "alpha": _check_scalar("alpha", self.alpha, min_value=0.0),
        }
        if self.clip_ratio_c is not None:
            checked["clip_ratio_c"] = _check_scalar(
                "clip_ratio_c", self.clip_ratio_c, min_value=1.0, min_inclusive=False
            )
        mode = LOSS_REGISTRY[self.loss_mode]
        for name, neutral in _MODE_SETTING_NEUTRAL.items():
            if checked[name] != neutral and name not in mode.settings:
                users = ", ".join(repr(m.name) for m in LOSS_REGISTRY.values() if name in m.settings)
                raise ValueError(
                    f"{name} is only used by loss_mode {users}; got {name}={checked[name]} "
                    f"with loss_mode={self.loss_mode!r}"
                )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def mode(self) -> LossMode:
        """The registry entry of ``loss_mode``."""
        return LOSS_REGISTRY[self.loss_mode]


@dataclass(frozen=True)
class LossInputs:
    """The tensors and counts of one (micro-)batch, input of :func:`compute_policy_loss` / :func:`total_loss`.

    Attributes:
        log_prob: ``(B, T)`` float, log pi_theta of each response token (requires grad).
        old_log_prob: ``(B, T)`` float, log pi_old of the rollout policy (no grad needed).
        advantages: ``(B,)`` (one per response, broadcast over its tokens, Eq. 4) or ``(B, T)`` float.
        response_mask: ``(B, T)`` bool / int / float with values 0 or 1; 1 marks tokens that count.
            Values at masked positions of the other tensors are ignored (they may be ``inf`` or ``nan``).
        entropies: ``(B, T)`` float per-token entropies (nats) of the current policy, or None; required by
            modes with ``needs_entropies``.  Used as constants (detached).
        old_entropies: ``(B, T)`` float per-token entropies of the rollout policy, or None; required by
            modes with ``needs_old_entropies``.  Used as constants.
        is_correct: ``(B,)`` bool (or 0/1), which responses are correct (the set Phi of Eq. 13); required by
            :func:`total_loss` when ``alpha != 0``.
        num_tokens: the unmasked token count of the whole optimizer step (all micro-batches; divided
            by the number of workers, whose gradients are averaged), or None for this batch's own
            count.  Used by ``token-mean``; int, float or 1-element tensor.
        num_seqs: the same for the number of responses with at least one unmasked token; used by the
            seq-mean modes.
        num_sft_tokens: the same for the unmasked tokens of correct responses; used by the SFT term.

    Each aggregation uses the count it needs and ignores the others, so a caller may pass all three.
    """

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    entropies: torch.Tensor | None = None
    old_entropies: torch.Tensor | None = None
    is_correct: torch.Tensor | None = None
    num_tokens: Count | None = None
    num_seqs: Count | None = None
    num_sft_tokens: Count | None = None


# --------------------------------------------------------------------------- the loss modes


def _clipped_surrogate(t: TokenTerms, high_grad: float | None = None, low_grad: float | None = None) -> TokenLoss:
    """PPO's clipped surrogate ``-min(r*A, clip(r, lo, hi)*A)`` (Eq. 1, 5), optionally gradient-preserving.

    ``high_grad`` / ``low_grad``: ``F`` of the high-side (``r > hi``, ``A > 0``) / low-side (``r < lo``,
    ``A < 0``) clipped tokens (Eq. 12, 18); None keeps PPO's zero gradient there (Eq. 10).  The value is
    the same either way.
    """
    ratio_d = t.ratio.detach()
    clipped_high = t.mask & (t.adv > 0) & (ratio_d > t.hi)
    clipped_low = t.mask & (t.adv < 0) & (ratio_d < t.lo)
    per_tok = -t.ratio * t.adv  # unclipped branch (Eq. 1)
    high_val = -t.hi * t.adv  # clipped branch value, constant (PPO: zero gradient)
    low_val = -t.lo * t.adv
    # Value exactly 0, derivative exactly 1 w.r.t. log_prob; stands in for the paper's r / sg(r) factor of
    # Eq. 11 / 17.
    grad_only = t.log_ratio - t.log_ratio.detach()
    if high_grad is not None:
        high_val = high_val - high_grad * t.adv * grad_only
    if low_grad is not None:
        low_val = low_val - low_grad * t.adv * grad_only
    per_tok = torch.where(clipped_high, high_val, per_tok)
    per_tok = torch.where(clipped_low, low_val, per_tok)
    return TokenLoss(per_tok, clipped_high, clipped_low)


def _ppo_clip(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """PPO / Clip-Higher (Eq. 1, 5, 6); clipped tokens have zero gradient (Eq. 10)."""
    return _clipped_surrogate(t)


def _gppo(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """GPPO (Eq. 11, 12; general form Eq. 17, 18): ``F = beta1*lo`` / ``beta2*hi`` on clipped tokens."""
    return _clipped_surrogate(t, high_grad=s.beta2 * t.hi, low_grad=s.beta1 * t.lo)


def _gppo_only_high(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """GPPO on the high side (``F = beta2*hi``), PPO on the low side (``F = 0``) (Appendix A.2)."""
    return _clipped_surrogate(t, high_grad=s.beta2 * t.hi)


def _cispo(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """CISPO (Eq. 15, 16): ``-sg(clip(r, lo, hi)) * A * log_prob``, ``F = clip(r)`` whatever the sign of A."""
    ratio_d = t.ratio.detach()
    clipped_high = t.mask & (ratio_d > t.hi)
    clipped_low = t.mask & (ratio_d < t.lo)
    weight = ratio_d.clamp(t.lo, t.hi)
    lp_safe = torch.where(t.mask, t.log_prob, 0.0)
    return TokenLoss(-weight * t.adv * lp_safe, clipped_high, clipped_low)


def _mean_max_min(
    x: torch.Tensor, mask: torch.Tensor, acc: torch.dtype, empty: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, max and min of ``x`` over the ``mask`` tokens in dtype ``acc`` (each ``empty`` when there is none)."""
    x = x.detach().to(acc)
    count = mask.sum()
    fill = torch.full((), empty, dtype=acc, device=x.device)
    if x.numel() == 0:
        return fill, fill, fill
    mean = torch.where(mask, x, 0.0).sum() / count.clamp(min=1)
    x_max = torch.where(mask, x, -math.inf).amax()
    x_min = torch.where(mask, x, math.inf).amin()
    has_any = count > 0
    return torch.where(has_any, mean, fill), torch.where(has_any, x_max, fill), torch.where(has_any, x_min, fill)


def entropy_ratio(entropies: torch.Tensor, old_entropies: torch.Tensor) -> torch.Tensor:
    """ERC's per-token entropy ratio ``rho = (H + eps) / (H_old + eps)`` with ``eps = ERC_ENTROPY_EPS``.

    Args:
        entropies: ``(B, T)`` float, entropy (nats) of the current policy's next-token distribution.
        old_entropies: ``(B, T)`` float, the same for the rollout policy.

    Returns:
        ``(B, T)`` detached, in ``promote(entropies.dtype, old_entropies.dtype, float32)``.
    """
    acc = _acc_dtype(torch.promote_types(entropies.dtype, old_entropies.dtype))
    return (entropies.detach().to(acc) + ERC_ENTROPY_EPS) / (old_entropies.detach().to(acc) + ERC_ENTROPY_EPS)


def _entropy_ratio_clip(out: TokenLoss, t: TokenTerms, s: LossSettings) -> TokenLoss:
    """A base mode's ``out`` plus Entropy Ratio Clipping (arXiv 2512.05591): per-token loss ``l`` -> ``sg(l)``
    where ``rho`` is outside ``(1 - erc_low, 1 + erc_high)``; the value and every divisor are unchanged."""
    assert t.entropies is not None and t.old_entropies is not None  # needs_(old_)entropies: checked on input
    rho = entropy_ratio(t.entropies, t.old_entropies)
    kept = t.mask & (rho > 1.0 - s.erc_low) & (rho < 1.0 + s.erc_high)  # NaN rho: not kept
    per_tok = torch.where(kept, out.per_token, out.per_token.detach())
    with torch.no_grad():
        acc = rho.dtype
        denom = t.mask.sum().clamp(min=1)
        high = (t.mask & (rho >= 1.0 + s.erc_high)).sum().to(acc) / denom
        low = (t.mask & (rho <= 1.0 - s.erc_low)).sum().to(acc) / denom
        r_mean, r_max, r_min = _mean_max_min(rho, t.mask, acc, empty=1.0)
        metrics = {
            "erc_frac_high": high,
            "erc_frac_low": low,
            "erc_frac": (t.mask & ~kept).sum().to(acc) / denom,
            "entropy_ratio_mean": r_mean,
            "entropy_ratio_max": r_max,
            "entropy_ratio_min": r_min,
        }
    return out._replace(per_token=per_tok, metrics=metrics)


def _ppo_erc(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """``ppo_clip`` plus Entropy Ratio Clipping (the authors' DAPO + ERC)."""
    return _entropy_ratio_clip(_ppo_clip(t, s), t, s)


def _gppo_erc(t: TokenTerms, s: LossSettings) -> TokenLoss:
    """``gppo`` (with ``beta1`` / ``beta2``) plus Entropy Ratio Clipping."""
    return _entropy_ratio_clip(_gppo(t, s), t, s)


_ERC = ("erc_low", "erc_high")
_BUILTIN_MODES: tuple[LossMode, ...] = (
    LossMode("ppo_clip", _ppo_clip),
    LossMode("gppo", _gppo, settings=("beta1", "beta2")),
    LossMode("gppo_only_high", _gppo_only_high, settings=("beta2",)),
    LossMode("cispo", _cispo),
    LossMode("ppo_erc", _ppo_erc, settings=_ERC, needs_entropies=True, needs_old_entropies=True),
    LossMode(
        "gppo_erc",
        _gppo_erc,
        settings=("beta1", "beta2") + _ERC,
        needs_entropies=True,
        needs_old_entropies=True,
    ),
)
#: ``loss_mode`` name -> :class:`LossMode`.
LOSS_REGISTRY: dict[str, LossMode] = {m.name: m for m in _BUILTIN_MODES}
#: The built-in values of ``loss_mode``.
LOSS_MODES: tuple[str, ...] = tuple(LOSS_REGISTRY)


# --------------------------------------------------------------------------- shared machinery


def _token_terms(inputs: LossInputs, settings: LossSettings) -> TokenTerms:
    """Validate the tensors of ``inputs`` against what ``settings.mode`` needs and build its :class:`TokenTerms`."""
    log_prob, old_log_prob, advantages = inputs.log_prob, inputs.old_log_prob, inputs.advantages
    _check_float_tensor("log_prob", log_prob)
    _check_float_tensor("old_log_prob", old_log_prob)
    _check_float_tensor("advantages", advantages)
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must have shape (B, T), got {tuple(log_prob.shape)}")
    shape = tuple(log_prob.shape)
    if tuple(old_log_prob.shape) != shape:
        raise ValueError(
            f"old_log_prob must have the shape of log_prob (B, T) = {shape}, got {tuple(old_log_prob.shape)}"
        )
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must have shape (B,) = {shape[:1]} or (B, T) = {shape}, got {tuple(advantages.shape)}"
        )
    mask = _as_bool_mask("response_mask", inputs.response_mask, shape, "(B, T)")
    mode = settings.mode
    entropy: dict[str, torch.Tensor | None] = {}
    for name, needed in (("entropies", mode.needs_entropies), ("old_entropies", mode.needs_old_entropies)):
        value = getattr(inputs, name)
        if value is None:
            if needed:
                raise ValueError(f"loss_mode={mode.name!r} needs {name} (B, T); got None")
            entropy[name] = None
            continue
        _check_float_tensor(name, value)
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have the shape of log_prob (B, T) = {shape}, got {tuple(value.shape)}")
        entropy[name] = value.detach()

    dtype = torch.promote_types(log_prob.dtype, old_log_prob.dtype)
    lp = log_prob.to(dtype)
    adv = advantages.to(dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand(shape)
    adv = torch.where(mask, adv, 0.0)
    # Zero the log-ratio at masked positions BEFORE exp (NaN safety), clamp for exp.
    log_ratio = torch.where(mask, lp - old_log_prob, 0.0)  # computed in dtype (promotion)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return TokenTerms(
        mask=mask,
        log_prob=lp,
        adv=adv,
        log_ratio=log_ratio,
        ratio=ratio,
        lo=1.0 - settings.clip_ratio_low,
        hi=1.0 + settings.clip_ratio_high,
        **entropy,
    )


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    what: str = "unmasked tokens",
) -> torch.Tensor:
    """Reduce per-token losses to one loss (Eq. 7 token-mean, Eq. 3 seq-mean-token-mean, seq-mean-token-sum).

    Args:
        per_token: ``(B, T)`` float, already 0 at masked positions, in the accumulation dtype.
        mask: ``(B, T)`` bool.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.  In the seq-mean modes, responses with no unmasked
            token are left out of the mean over responses.
        num_tokens: token-mean divisor instead of ``mask.sum()`` (see :class:`LossInputs`).
        num_seqs: seq-mean divisor instead of this batch's number of responses with unmasked tokens.
        what: what ``num_tokens`` counts, for error messages.

    Returns:
        0-dim tensor of ``per_token``'s dtype; exactly 0 when nothing is unmasked.

    Raises:
        ValueError: a divisor that is negative, not finite, or 0 while there is something to divide.
    """
    if loss_agg_mode == "token-mean":
        tok_count = mask.sum()
        divisor = _resolve_count("num_tokens", num_tokens, tok_count, what)
        if divisor is None:
            return per_token.sum() / tok_count.clamp(min=1)
        return per_token.sum() / divisor
    seq_tok = mask.sum(dim=-1)
    seq_loss = per_token.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / seq_tok.clamp(min=1)
    has_tok = seq_tok > 0
    total = torch.where(has_tok, seq_loss, 0.0).sum()
    n_seqs = has_tok.sum()
    divisor = _resolve_count("num_seqs", num_seqs, n_seqs, "responses with unmasked tokens")
    if divisor is None:
        return total / n_seqs.clamp(min=1)
    return total / divisor


def _policy_metrics(
    t: TokenTerms,
    clipped_high: torch.Tensor,
    clipped_low: torch.Tensor,
    dual: torch.Tensor,
    acc: torch.dtype,
    per_tok: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics over the unmasked tokens (see :func:`policy_loss`); no host sync."""
    grad_share = None
    if per_tok.requires_grad and t.log_prob.requires_grad:
        # d(loss_t)/d(log_prob_t): each token's loss depends on its own log-prob only
        (g,) = torch.autograd.grad(per_tok.sum(), t.log_prob, retain_graph=True, allow_unused=True)
        if g is not None:
            g = g.detach().abs().to(acc)
            grad_share = torch.where(clipped_high | clipped_low, g, 0.0).sum() / g.sum().clamp(min=1e-30)
    with torch.no_grad():
        mask = t.mask
        tok_count = mask.sum()
        denom = tok_count.clamp(min=1)

        def frac(m: torch.Tensor) -> torch.Tensor:
            return m.sum().to(acc) / denom

        r_mean, r_max, r_min = _mean_max_min(t.ratio, mask, acc, empty=1.0)
        f_high, f_low = frac(clipped_high), frac(clipped_low)
        metrics = {
            "clip_frac_high": f_high,
            "clip_frac_low": f_low,
            "clip_frac": f_high + f_low,
            "dual_clip_frac": frac(dual),
            "ppo_kl": torch.where(mask, -t.log_ratio.detach(), 0.0).to(acc).sum() / denom,
            "ratio_mean": r_mean,
            "ratio_max": r_max,
            "ratio_min": r_min,
        }
        log_ratio = t.log_ratio.detach().to(acc)
        for name, side in (("log_ratio_adv_pos", t.adv > 0), ("log_ratio_adv_neg", t.adv < 0)):
            side = mask & side
            metrics[name] = torch.where(side, log_ratio, 0.0).sum() / side.sum().clamp(min=1)
        if grad_share is not None:
            metrics["clip_grad_share"] = grad_share
        if t.entropies is not None:
            ent = t.entropies.to(_acc_dtype(t.entropies.dtype))

            def share(m: torch.Tensor) -> torch.Tensor:
                return torch.where(m, ent, 0.0).sum().to(acc) / denom

            metrics["entropy_mean"] = share(mask)
            metrics["entropy_share_clip_high"] = share(clipped_high)
            metrics["entropy_share_clip_low"] = share(clipped_low)
        return metrics


def compute_policy_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of ``settings.loss_mode`` on one batch: its ``token_loss``, the dual-clip cap,
    masking, aggregation and metrics.  Values, gradients, metrics and errors are those of :func:`policy_loss`
    (which documents them); the counts used are ``inputs.num_tokens`` (token-mean) or ``inputs.num_seqs``
    (seq-mean modes).

    Args:
        inputs: the batch (see :class:`LossInputs`).
        settings: validated settings.

    Returns:
        ``(loss, metrics)`` as :func:`policy_loss`.

    Raises:
        TypeError / ValueError: as :func:`policy_loss`; ValueError also when the mode needs
            ``entropies`` / ``old_entropies`` and they are None or misshapen.
    """
    t = _token_terms(inputs, settings)
    acc = _acc_dtype(t.log_prob.dtype)
    out = settings.mode.token_loss(t, settings)
    per_tok = out.per_token
    c = settings.clip_ratio_c
    if c is not None:
        dual = t.mask & (t.adv < 0) & (t.ratio.detach() > c)
        per_tok = torch.where(dual, -c * t.adv, per_tok)  # dual-clip cap: constant
    else:
        dual = torch.zeros_like(t.mask)
    per_tok = torch.where(t.mask, per_tok, 0.0).to(acc)
    loss = aggregate(per_tok, t.mask, settings.loss_agg_mode, num_tokens=inputs.num_tokens, num_seqs=inputs.num_seqs)
    # The categories unclipped / high / low / dual are disjoint: a dual-capped token is not counted as clipped.
    metrics = _policy_metrics(
        t, t.mask & out.clipped_high & ~dual, t.mask & out.clipped_low & ~dual, dual, acc, per_tok
    )
    if out.metrics is not None:
        metrics.update({k: v.to(acc) for k, v in out.metrics.items()})
    return loss, metrics


# --------------------------------------------------------------------------- public entry points


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "gppo",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    beta1: float = 1.0,
    beta2: float = 1.0,
    erc_low: float = 0.05,
    erc_high: float = 0.05,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    entropies: torch.Tensor | None = None,
    old_entropies: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO / Clip-Higher / GPPO / CISPO, optionally with ERC), minimised: the
    keyword form of :func:`compute_policy_loss`, and the home of its return values and errors.

    Args:
        log_prob, old_log_prob, advantages, response_mask, entropies, old_entropies: the tensors of
            :class:`LossInputs` (shapes, dtypes, masking there).
        num_tokens, num_seqs: the optimizer step's divisors of :class:`LossInputs` (``None``: this batch's).
        loss_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c, beta1, beta2, erc_low, erc_high, loss_agg_mode:
            the fields of :class:`LossSettings` (ranges there). What each mode computes is the module
            docstring's gradient table (Eq. 10, 12, 16, 18); the aggregations are :func:`aggregate`'s.

    Returns:
        ``(loss, metrics)``.  ``loss`` is a 0-dim tensor of dtype
        ``promote(input dtype, float32)``; with no unmasked token it is exactly 0 and
        still differentiable (gradient 0).  ``metrics`` maps names to detached 0-dim
        tensors (no host sync is forced; call ``.item()`` when logging), computed over this
        batch's unmasked tokens:

        * ``clip_frac_high``: fraction of tokens where the high-side clipped branch is
            taken: ``A > 0 and r > 1+eps_high``.  For ``cispo``: tokens whose ratio weight
            was clipped from above (``r > 1+eps_high``, any sign of A), dual-capped tokens
            excluded.
        * ``clip_frac_low``: ``A < 0 and r < 1-eps_low`` (``cispo``: ``r < 1-eps_low``,
            any sign of A).
        * ``clip_frac``: ``clip_frac_high + clip_frac_low``.
        * ``dual_clip_frac``: ``A < 0 and r > c`` (0 when dual clip is off).  The four
            categories unclipped / high / low / dual are disjoint.
        * ``ppo_kl``: approximate KL, mean of ``old_log_prob - log_prob``.
        * ``ratio_mean``, ``ratio_max``, ``ratio_min``: of ``r`` (after the log-ratio
            clamp); 1.0 when there is no unmasked token.
        * ``log_ratio_adv_pos`` / ``log_ratio_adv_neg``: mean ``log_prob - old_log_prob`` (nats) of the
            tokens with ``A > 0`` / ``A < 0`` (0 when there is none): how far the updates since the rollout
            moved the positive and the negative samples.
        * ``clip_grad_share`` (only when ``log_prob`` requires grad): the clipped tokens' (high and low, not
            dual-capped) share of ``sum |d loss_t / d log_prob_t|`` over the unmasked tokens: 0 for PPO /
            Clip-Higher (Eq. 10), what GPPO (Eq. 12) and CISPO give back to the clipped tokens.

        With ``entropies`` (any mode; nats; 0 when there is no unmasked token):

        * ``entropy_mean``: mean ``H`` of the unmasked tokens.
        * ``entropy_share_clip_high`` / ``entropy_share_clip_low``: sum of ``H`` over the tokens
            counted in ``clip_frac_high`` / ``clip_frac_low``, divided by the number of unmasked
            tokens: each clip category's share of ``entropy_mean``.  Divided by ``clip_frac_high`` /
            ``clip_frac_low`` it is that category's mean entropy (CE-GPPO's view).  A share, not a
            mean, so that it averages over micro-batches and processes as the fractions do, even
            where a micro-batch has no clipped token.

        ERC modes only (over the unmasked tokens; not disjoint from the clip categories):

        * ``erc_frac_high`` / ``erc_frac_low``: fraction with ``rho >= 1 + erc_high`` /
            ``rho <= 1 - erc_low`` (no gradient).
        * ``erc_frac``: fraction without gradient from ERC (the sum of the two, plus NaN ``rho``).
        * ``entropy_ratio_mean``, ``entropy_ratio_max``, ``entropy_ratio_min``: of ``rho``; 1.0 when
            there is no unmasked token.

        ``METRIC_REDUCTIONS`` says how each combines over processes.

    Raises:
        TypeError: a tensor argument is not a tensor / not floating point; a scalar
            argument is not a number.
        ValueError: shape mismatch (names the argument and both shapes); unknown
            ``loss_mode`` / ``loss_agg_mode`` (lists the valid ones); mask values other
            than 0/1; ``clip_ratio_c <= 1``; negative or non-finite eps (or
            ``clip_ratio_low >= 1``); negative beta, or beta != 1 for a mode that does not
            use it; ``erc_low`` not in ``(0, 1)``, ``erc_high <= 0``, or either away from 0.05
            for a mode without ERC; ``num_tokens`` given with a seq-mean mode or ``num_seqs`` with
            token-mean; a count negative, or 0 while the batch has tokens; entropies a
            mode needs are missing.
    """
    settings = LossSettings(
        loss_mode=loss_mode,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        beta1=beta1,
        beta2=beta2,
        erc_low=erc_low,
        erc_high=erc_high,
        loss_agg_mode=loss_agg_mode,
    )
    if num_tokens is not None and settings.loss_agg_mode != "token-mean":
        raise ValueError(f"num_tokens only applies to loss_agg_mode='token-mean', got loss_agg_mode={loss_agg_mode!r}")
    if num_seqs is not None and settings.loss_agg_mode == "token-mean":
        raise ValueError("num_seqs only applies to the seq-mean loss_agg_modes, got loss_agg_mode='token-mean'")
    inputs = LossInputs(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        entropies=entropies,
        old_entropies=old_entropies,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    return compute_policy_loss(inputs, settings)


def sft_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    is_correct: torch.Tensor,
    num_tokens: Count | None = None,
) -> torch.Tensor:
    """Token-mean NLL on the rollout responses judged correct (Eq. 13, Sec. 3.2.3).

    ``L_LM = sum over unmasked tokens of correct responses of -log_prob / N`` where N is
    the number of those tokens (the paper writes the probability but means the
    log-probability).  :func:`total_loss` combines it with the policy loss (Eq. 14).

    Args:
        log_prob: ``(B, T)`` float, log pi_theta of each response token (requires grad).
        response_mask: ``(B, T)`` bool / int / float 0/1 mask.  Masked positions may hold
            ``-inf`` or ``nan``; they are ignored (also in the gradient).
        is_correct: ``(B,)`` bool (or 0/1 int/float) -- which responses are in Phi.
        num_tokens: divisor to use instead of this batch's count, for micro-batching /
            several workers: the unmasked token count of the correct responses of the whole
            optimizer batch.  int, float or 1-element tensor; validating it forces one
            host sync.

    Returns:
        0-dim loss of dtype ``promote(log_prob.dtype, float32)``.  When no response is
        correct (or no correct response has an unmasked token) it is exactly 0, still
        attached to the graph (``requires_grad`` when ``log_prob`` does; backward gives
        all-zero gradients).

    Raises:
        TypeError: non-tensor arguments or non-float ``log_prob``.
        ValueError: shape mismatch (names the argument and the shapes); mask or
            is_correct values other than 0/1; ``num_tokens`` negative, 0 while there are
            correct tokens.
    """
    _check_float_tensor("log_prob", log_prob)
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must have shape (B, T), got {tuple(log_prob.shape)}")
    shape = tuple(log_prob.shape)
    mask = _as_bool_mask("response_mask", response_mask, shape, "(B, T)")
    correct = _as_bool_mask("is_correct", is_correct, shape[:1], "(B,)")
    selected = mask & correct.unsqueeze(-1)
    per_tok = torch.where(selected, -log_prob, 0.0).to(_acc_dtype(log_prob.dtype))
    return aggregate(per_tok, selected, "token-mean", num_tokens=num_tokens, what="tokens of correct responses")


def add_sft_term(pg_loss: torch.Tensor, lm_loss: torch.Tensor, alpha: float) -> torch.Tensor:
    """The RL stage's loss ``L = L_pg + alpha * L_LM`` (Eq. 14): the one place it is written, for
    :func:`total_loss` and the verl trainer. Both are 0-dim tensors; the result has their promoted dtype."""
    return pg_loss + alpha * lm_loss


def total_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The RL stage's loss ``L = L_pg + alpha * L_LM`` (Eq. 14) on one (micro-)batch.

    ``L_pg`` is :func:`compute_policy_loss` (divided by ``inputs.num_tokens`` or ``inputs.num_seqs``),
    ``L_LM`` is :func:`sft_loss` on ``inputs.is_correct`` (divided by ``inputs.num_sft_tokens``); with
    ``alpha == 0`` the SFT term is not computed and reported as 0.

    Args:
        inputs: the batch; ``is_correct`` is required when ``settings.alpha != 0``.
        settings: validated settings.

    Returns:
        ``(loss, metrics)``: 0-dim loss of dtype ``promote(input dtype, float32)``; ``metrics`` are those of
        :func:`policy_loss` plus ``policy_loss`` (``L_pg``) and ``sft_loss`` (``L_LM``), detached 0-dim.

    Raises:
        ValueError: ``is_correct`` missing while ``alpha != 0``; otherwise as :func:`compute_policy_loss`
            and :func:`sft_loss`.
    """
    pg_loss, metrics = compute_policy_loss(inputs, settings)
    if settings.alpha != 0.0:
        if inputs.is_correct is None:
            raise ValueError(f"alpha={settings.alpha} needs is_correct (B,) for the SFT term; got None")
        lm_loss = sft_loss(inputs.log_prob, inputs.response_mask, inputs.is_correct, num_tokens=inputs.num_sft_tokens)
        loss = add_sft_term(pg_loss, lm_loss, settings.alpha)
    else:
        lm_loss = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
        loss = pg_loss
    metrics["policy_loss"] = pg_loss.detach()
    metrics["sft_loss"] = lm_loss.detach()
    return loss, metrics
