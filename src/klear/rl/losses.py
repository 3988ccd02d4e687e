"""Policy-gradient and SFT losses of the Klear-Reasoner RL stage (pure torch).

Source: Su et al., "Klear-Reasoner: Advancing Reasoning Capability via
Gradient-Preserving Clipping Policy Optimization" (arXiv 2508.07629); restated in
``shared/spec/klear-reasoner.md`` sections 3.1-3.7. Equation numbers are the paper's.

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

Implementation notes
--------------------
* The clipped GPPO terms are written in the paper as ``hi / sg(r) * r`` (value
  ``hi``, gradient ``hi * phi``).  We use the mathematically equivalent
  ``hi + hi * beta * (lr - sg(lr))`` with ``lr = log_prob - old_log_prob``: the
  added term is exactly 0.0 in the forward pass (so the loss value is *bit-equal*
  to ``ppo_clip``) and its derivative w.r.t. ``log_prob`` is exactly 1, giving
  ``F = beta * hi`` without the rounding of ``r / r``.
* Dual clip (spec 3.2): for ``A < 0`` the PPO loss ``L = -min(rA, clip(r)A)`` is
  capped at ``-A * c``; the cap is taken exactly when ``r > c`` (because
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
  and float64 for float64 inputs.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Dict, Optional, Tuple, Union

import torch

__all__ = [
    "LOSS_MODES",
    "LOSS_AGG_MODES",
    "LOG_RATIO_CLAMP",
    "policy_loss",
    "sft_loss",
]

#: Valid values of ``policy_loss(loss_mode=...)``.
LOSS_MODES: Tuple[str, ...] = ("ppo_clip", "gppo", "gppo_only_high", "cispo")
#: Valid values of ``policy_loss(loss_agg_mode=...)``.
LOSS_AGG_MODES: Tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: The log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``.
LOG_RATIO_CLAMP: float = 20.0

Count = Union[int, float, torch.Tensor]


# --------------------------------------------------------------------------- helpers


def _check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def _check_scalar(name: str, value: object, *, min_value: float, min_inclusive: bool = True,
                  max_value: Optional[float] = None) -> float:
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


def _as_bool_mask(name: str, mask: object, shape: Tuple[int, ...], shape_desc: str) -> torch.Tensor:
    """Validate a 0/1 mask (bool, integer or float) and return it as a bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {shape_desc} = {tuple(shape)}, got {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    if mask.numel() > 0 and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must contain only 0 and 1 (it is a mask, not weights)")
    return mask != 0


def _resolve_count(name: str, value: Optional[Count], local_count: torch.Tensor,
                   what: str) -> Optional[float]:
    """Validate an explicit divisor (``num_tokens``) against this batch's own count.

    Returns the divisor as a python float (1.0 when it is 0 and there is nothing to
    divide), or None when ``value`` is None.  Forces one host sync (``.item()``).
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
    local = int(local_count.item())
    if local > 0 and v <= 0:
        raise ValueError(f"{name} must be > 0 when the batch has {what} (this batch has {local})")
    # No lower bound against `local`: under data parallelism the divisor is the whole step's
    # count divided by the number of workers (their gradients are averaged), which can be below
    # the count of a worker that holds more tokens than average.
    return v if v > 0 else 1.0


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------- policy loss


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "gppo",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
    beta1: float = 1.0,
    beta2: float = 1.0,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Count] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss (PPO / Clip-Higher / GPPO / CISPO), minimised.

    Args:
        log_prob: ``(B, T)`` float, log pi_theta of each response token (requires grad).
        old_log_prob: ``(B, T)`` float, log pi_old of the rollout policy (no grad needed).
        advantages: ``(B,)`` (one per response, broadcast over its tokens, Eq. 4) or
            ``(B, T)`` float.
        response_mask: ``(B, T)`` bool / int / float with values 0 or 1; 1 marks tokens
            that count.  Values at masked positions of the other tensors are ignored
            (they may be ``inf`` or ``nan``).
        loss_mode: one of ``LOSS_MODES``:

            * ``"ppo_clip"``: per-token loss ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)``
              (Eq. 1, 5; Clip-Higher Eq. 6 when ``clip_ratio_high > clip_ratio_low``);
              gradient Eq. 10.
            * ``"gppo"``: same value as ``ppo_clip``; clipped tokens keep the gradient
              ``F = beta1*(1-eps_low)`` (low side, ``r < 1-eps_low`` and ``A < 0``) and
              ``F = beta2*(1+eps_high)`` (high side, ``r > 1+eps_high`` and ``A > 0``).
              Eq. 11/12 (``beta1 = beta2 = 1``), general form Eq. 17/18.
            * ``"gppo_only_high"``: like ``gppo`` on the high side, like ``ppo_clip`` on
              the low side (zero gradient there).
            * ``"cispo"``: per-token loss ``-sg(clip(r, 1-eps_low, 1+eps_high))*A*log_prob``
              (Eq. 15); ``F = clip(r)`` for every token whatever the sign of A (Eq. 16).
              Its value is a surrogate (it depends on ``log_prob`` itself) and is not
              comparable with the other modes' values.

            See the module docstring for the full gradient table.
        clip_ratio_low: eps_low, ``0 <= eps_low < 1``.
        clip_ratio_high: eps_high, ``>= 0`` (0.28 = Clip-Higher as used by Klear).
        clip_ratio_c: dual-clip bound ``c > 1`` or None (off; Klear's scripts use 10).
            Tokens with ``A < 0`` and ``r > c`` contribute the constant ``-A*c`` and have
            zero gradient, in every loss mode (cispo included, see module docstring).
        beta1: gradient scale of low-side clipped tokens in ``gppo`` (Eq. 17), ``>= 0``.
            Must stay 1.0 for the other modes.
        beta2: gradient scale of high-side clipped tokens in ``gppo`` and
            ``gppo_only_high``, ``>= 0``.  Must stay 1.0 for the other modes.
        loss_agg_mode: one of ``LOSS_AGG_MODES``:

            * ``"token-mean"`` (Eq. 7, Klear): sum of all unmasked per-token losses of all
              responses / number of unmasked tokens (or ``num_tokens``).
            * ``"seq-mean-token-mean"`` (Eq. 3, GRPO): mean over each response's unmasked
              tokens, then mean over responses.
            * ``"seq-mean-token-sum"``: sum over each response's unmasked tokens, then
              mean over responses.

            In the seq-mean modes, responses with no unmasked token (e.g. dropped by the
            overlong filter) are left out of the mean over responses.
        num_tokens: token-mean only.  The divisor to use instead of this batch's unmasked
            token count: the unmasked token count of the WHOLE optimizer batch when it is
            split into micro-batches (gradient accumulation) or across workers, so that the
            sum of the micro-batch losses equals the one-batch loss.  int, float or a
            1-element tensor; validating it forces one host sync.

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

    Raises:
        TypeError: a tensor argument is not a tensor / not floating point; a scalar
            argument is not a number.
        ValueError: shape mismatch (names the argument and both shapes); unknown
            ``loss_mode`` / ``loss_agg_mode`` (lists the valid ones); mask values other
            than 0/1; ``clip_ratio_c <= 1``; negative or non-finite eps (or
            ``clip_ratio_low >= 1``); negative beta, or beta != 1 for a mode that does not
            use it; ``num_tokens`` given with a seq-mean mode, negative, 0 while the batch
            has tokens.
    """
    # ---- argument validation
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unknown loss_mode {loss_mode!r}; valid modes: {', '.join(LOSS_MODES)}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if num_tokens is not None and loss_agg_mode != "token-mean":
        raise ValueError(
            f"num_tokens only applies to loss_agg_mode='token-mean', got loss_agg_mode={loss_agg_mode!r}"
        )
    eps_low = _check_scalar("clip_ratio_low", clip_ratio_low, min_value=0.0, max_value=1.0)
    eps_high = _check_scalar("clip_ratio_high", clip_ratio_high, min_value=0.0)
    c: Optional[float] = None
    if clip_ratio_c is not None:
        c = _check_scalar("clip_ratio_c", clip_ratio_c, min_value=1.0, min_inclusive=False)
    b1 = _check_scalar("beta1", beta1, min_value=0.0)
    b2 = _check_scalar("beta2", beta2, min_value=0.0)
    if b1 != 1.0 and loss_mode != "gppo":
        raise ValueError(f"beta1 is only used by loss_mode='gppo'; got beta1={b1} with {loss_mode!r}")
    if b2 != 1.0 and loss_mode not in ("gppo", "gppo_only_high"):
        raise ValueError(
            f"beta2 is only used by loss_mode 'gppo' and 'gppo_only_high'; got beta2={b2} with {loss_mode!r}"
        )

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
    mask = _as_bool_mask("response_mask", response_mask, shape, "(B, T)")

    # ---- per-token quantities, in the input dtype
    dtype = torch.promote_types(log_prob.dtype, old_log_prob.dtype)
    acc = _acc_dtype(dtype)
    lp = log_prob.to(dtype)
    olp = old_log_prob.to(dtype)
    adv = advantages.to(dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand(shape)
    adv = torch.where(mask, adv, 0.0)

    # Zero the log-ratio at masked positions BEFORE exp (NaN safety), clamp for exp.
    log_ratio = torch.where(mask, lp - olp, 0.0)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ratio_d = ratio.detach()

    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    pos, neg = adv > 0, adv < 0
    if c is not None:
        dual = mask & neg & (ratio_d > c)
    else:
        dual = torch.zeros_like(mask)

    if loss_mode == "cispo":
        clipped_high = mask & (ratio_d > hi) & ~dual
        clipped_low = mask & (ratio_d < lo)
        weight = ratio_d.clamp(lo, hi)
        lp_safe = torch.where(mask, lp, 0.0)
        per_tok = -weight * adv * lp_safe
    else:
        clipped_high = mask & pos & (ratio_d > hi)
        clipped_low = mask & neg & (ratio_d < lo)
        per_tok = -ratio * adv  # unclipped branch (Eq. 1)
        high_val = -hi * adv  # clipped branch value, constant (PPO: zero gradient)
        low_val = -lo * adv
        # Value exactly 0, derivative exactly 1 w.r.t. log_prob; stands in for the
        # paper's r / sg(r) factor of Eq. 11 / 17.
        grad_only = log_ratio - log_ratio.detach()
        if loss_mode in ("gppo", "gppo_only_high"):
            high_val = high_val - (b2 * hi) * adv * grad_only
        if loss_mode == "gppo":
            low_val = low_val - (b1 * lo) * adv * grad_only
        per_tok = torch.where(clipped_high, high_val, per_tok)
        per_tok = torch.where(clipped_low, low_val, per_tok)
    if c is not None:
        per_tok = torch.where(dual, -c * adv, per_tok)  # dual-clip cap: constant
    per_tok = torch.where(mask, per_tok, 0.0).to(acc)

    # ---- aggregation (Eq. 7 / Eq. 3)
    tok_count = mask.sum()
    if loss_agg_mode == "token-mean":
        divisor = _resolve_count("num_tokens", num_tokens, tok_count, "unmasked tokens")
        if divisor is None:
            loss = per_tok.sum() / tok_count.clamp(min=1).to(acc)
        else:
            loss = per_tok.sum() / divisor
    else:
        seq_tok = mask.sum(dim=-1)
        seq_loss = per_tok.sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_loss = seq_loss / seq_tok.clamp(min=1).to(acc)
        has_tok = seq_tok > 0
        loss = torch.where(has_tok, seq_loss, 0.0).sum() / has_tok.sum().clamp(min=1).to(acc)

    # ---- metrics (detached 0-dim tensors, no host sync)
    with torch.no_grad():
        denom = tok_count.clamp(min=1).to(acc)
        has_any = tok_count > 0

        def frac(m: torch.Tensor) -> torch.Tensor:
            return m.sum().to(acc) / denom

        r_acc = ratio_d.to(acc)
        one = torch.ones((), dtype=acc, device=r_acc.device)
        if r_acc.numel() > 0:
            r_max = torch.where(mask, r_acc, -math.inf).amax()
            r_min = torch.where(mask, r_acc, math.inf).amin()
        else:
            r_max = r_min = one
        f_high, f_low = frac(clipped_high), frac(clipped_low)
        metrics = {
            "clip_frac_high": f_high,
            "clip_frac_low": f_low,
            "clip_frac": f_high + f_low,
            "dual_clip_frac": frac(dual),
            "ppo_kl": torch.where(mask, -log_ratio.detach(), 0.0).to(acc).sum() / denom,
            "ratio_mean": torch.where(has_any, torch.where(mask, r_acc, 0.0).sum() / denom, one),
            "ratio_max": torch.where(has_any, r_max, one),
            "ratio_min": torch.where(has_any, r_min, one),
        }
    return loss, metrics


# --------------------------------------------------------------------------- SFT loss


def sft_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    is_correct: torch.Tensor,
    num_tokens: Optional[Count] = None,
) -> torch.Tensor:
    """Token-mean NLL on the rollout responses judged correct (Eq. 13, Sec. 3.2.3).

    ``L_LM = sum over unmasked tokens of correct responses of -log_prob / N`` where N is
    the number of those tokens (the paper writes the probability but means the
    log-probability).  The RL total is ``L = L_GPPO + alpha * L_LM`` with alpha = 0.1
    (Eq. 14) -- combining is the caller's job.

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

    acc = _acc_dtype(log_prob.dtype)
    total = torch.where(selected, -log_prob, 0.0).to(acc).sum()
    count = selected.sum()
    divisor = _resolve_count("num_tokens", num_tokens, count, "tokens of correct responses")
    if divisor is None:
        return total / count.clamp(min=1).to(acc)
    return total / divisor
