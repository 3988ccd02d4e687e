"""Group-relative advantages (GRPO, Eq. 4) and zero-advantage group detection.

Source: Su et al., "Klear-Reasoner" (arXiv 2508.07629), Eq. 4 and Sec. 5.2.5 (zero-advantage groups).

For one prompt the policy samples a group of M responses with rewards R(1..M):

    A(j) = (R(j) - mean(R)) / (std(R) + epsilon)        (Eq. 4)

with the POPULATION standard deviation (divide by M, not M - 1).  Groups are keyed
by prompt id, not by position: members of a group need not be contiguous.

A group whose rewards are all exactly equal (all correct, all wrong, or e.g. eight
soft code rewards of 0.7) carries no policy gradient; Klear filters such groups out of
the RL batch.  Equality is decided by comparing the raw rewards with ``==``, never by
``std < threshold``: a float32 std of identical values can come out as ~1e-8 instead
of 0, and a threshold would also swallow genuinely close-but-different rewards.

Unscored samples: a NaN reward (:data:`klear.rewards.correctness.UNSCORED_REWARD`, a score the
judge could not compute) is not a reward. Mean, std and the all-equal test of its group use the
SCORED members only, its own advantage is 0, and a group with fewer than 2 scored members has
zero advantages (and counts as all-equal). The trainer also leaves unscored samples out of the
loss. ``+-inf`` is still an error.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

__all__ = [
    "all_equal_groups",
    "compute_group_advantages",
    "filter_mask_exact_correct",
    "zero_advantage_group_mask",
]

GroupIds = torch.Tensor | Sequence[Hashable]


# --------------------------------------------------------------------------- helpers


def _as_1d(name: str, values: object) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        t = values
    elif isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {type(values).__name__}")
    else:
        try:
            t = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers: {exc}") from exc
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {tuple(t.shape)}")
    if t.is_complex():
        raise TypeError(f"{name} must be real, got dtype {t.dtype}")
    return t


def _group_index(group_ids: GroupIds, values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map the group ids of ``values`` ``(N,)`` to dense indices 0..G-1.

    Returns ``(inverse (N,) long on values' device, G)``."""
    n, device = values.shape[0], values.device
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D (N,), got shape {tuple(group_ids.shape)}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise TypeError(f"a group_ids tensor must have an integer dtype, got {group_ids.dtype}")
        if group_ids.shape[0] != n:
            raise ValueError(f"group_ids has length {group_ids.shape[0]} but there are {n} values")
        uniq, inverse = torch.unique(group_ids, return_inverse=True)  # inverse: long (empty for N = 0)
        return inverse.to(device), int(uniq.numel())
    is_sized_iterable = hasattr(group_ids, "__len__") and hasattr(group_ids, "__iter__")
    if isinstance(group_ids, (str, bytes)) or not is_sized_iterable:
        raise TypeError(
            f"group_ids must be an integer tensor or a sequence of hashable prompt ids, got {type(group_ids).__name__}"
        )
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has length {len(ids)} but there are {n} values")
    index: dict = {}
    inverse_list = []
    for i, gid in enumerate(ids):
        try:
            k = index.setdefault(gid, len(index))
        except TypeError as exc:
            raise TypeError(f"group_ids[{i}] = {gid!r} is not hashable") from exc
        inverse_list.append(k)
    return torch.tensor(inverse_list, dtype=torch.long, device=device), len(index)


def _all_equal_by_index(
    values: torch.Tensor, inverse: torch.Tensor, num_groups: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sample bool: every value of the sample's group ``== `` the group's first value.

    With ``valid`` ``(N,)`` bool, only valid members are compared (with the first valid one); a group
    with at most one valid member is all-equal."""
    n = values.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=values.device)
    positions = torch.arange(n, device=values.device)
    if valid is not None:
        positions = torch.where(valid, positions, n)  # invalid members are never a group's first
    # Every group has a member, so the initial n only stays where a group has no valid member (then
    # every member is invalid, hence equal below, and the clamped index is never decisive).
    first = positions.new_full((num_groups,), n).scatter_reduce(0, inverse, positions, reduce="amin")
    equal = values == values[first.clamp(max=n - 1)][inverse]
    if valid is not None:
        equal = equal | ~valid
    equal = equal.to(torch.int32)
    group_ok = equal.new_ones(num_groups).scatter_reduce(0, inverse, equal, reduce="amin")
    return group_ok.bool()[inverse]


# --------------------------------------------------------------------------- public API


def all_equal_groups(
    values: torch.Tensor | Sequence, group_ids: GroupIds, *, scored: torch.Tensor | Sequence | None = None
) -> torch.Tensor:
    """Per-sample flag: are all values of this sample's group exactly equal?

    Args:
        values: ``(N,)`` tensor (any real dtype, bool included) or a sequence of numbers.
            Compared with ``==`` exactly (no tolerance); a NaN is equal to nothing, so a
            group containing a compared NaN is never all-equal.
        group_ids: ``(N,)`` integer tensor or a sequence of N hashable prompt ids.
            Members of a group need not be contiguous.
        scored: optional ``(N,)`` bool (or 0/1); only these members are compared (the others, e.g.
            unscored samples, are ignored), so a group with at most one of them is all-equal.

    Returns:
        ``(N,)`` bool tensor on ``values``' device; True for every member of a group whose
        values are all equal (a group of size 1 is all-equal).  Empty input gives an empty
        tensor.

    Raises:
        ValueError: length mismatch, or a tensor argument that is not 1-D.
        TypeError: unhashable ids, float id tensor, non-numeric values.
    """
    v = _as_1d("values", values)
    inverse, g = _group_index(group_ids, v)
    valid = None
    if scored is not None:
        valid = _as_1d("scored", scored).to(device=v.device, dtype=torch.bool)
        if valid.shape[0] != v.shape[0]:
            raise ValueError(f"scored has length {valid.shape[0]} but there are {v.shape[0]} values")
    return _all_equal_by_index(v, inverse, g, valid)


def zero_advantage_group_mask(rewards: torch.Tensor | Sequence, group_ids: GroupIds) -> torch.Tensor:
    """``(N,)`` bool, True for samples whose group's raw rewards are all exactly equal.

    These are the zero-advantage groups Klear drops from the RL batch (Sec. 5.2.5); True
    marks samples to DROP.  Same as the second output of
    :func:`compute_group_advantages`: NaN rewards are unscored and ignored (module docstring);
    ValueError on empty input or an infinite reward.
    """
    r = _as_1d("rewards", rewards)
    _check_rewards(r)
    return all_equal_groups(r, group_ids, scored=_scored(r))


def filter_mask_exact_correct(is_correct: torch.Tensor | Sequence, group_ids: GroupIds) -> torch.Tensor:
    """``(N,)`` bool, True for samples whose group is all-correct or all-wrong.

    The authors' code filters groups by exact correctness rather than by reward (this
    differs from :func:`zero_advantage_group_mask` with soft rewards: eight failing
    programs passing 2/16, 3/16, ... tests have different rewards but are all wrong).
    True marks samples to DROP.

    Args:
        is_correct: ``(N,)`` bool tensor (or 0/1 ints, or a sequence of bools).
        group_ids: ``(N,)`` integer tensor or sequence of hashable prompt ids.

    Raises:
        ValueError: length mismatch; values other than 0/1 / True/False.
    """
    c = _as_1d("is_correct", is_correct)
    # 0/1 values need no conversion: equality of the flags is all that is compared.
    if c.dtype != torch.bool and bool(((c != 0) & (c != 1)).any()):
        raise ValueError("is_correct must contain only booleans (or 0/1)")
    return all_equal_groups(c, group_ids)


def _check_rewards(r: torch.Tensor) -> None:
    """Empty input or an infinite reward is an error; NaN (unscored) is allowed."""
    if r.shape[0] == 0:
        raise ValueError("rewards is empty")
    if r.is_floating_point():
        inf = torch.isinf(r)
        if bool(inf.any()):
            i = int(inf.nonzero()[0, 0].item())
            raise ValueError(f"rewards[{i}] = {r[i].item()} is infinite (NaN would mark an unscored sample)")


def _scored(r: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: which rewards are scores (not NaN, i.e. not unscored)."""
    return ~torch.isnan(r)  # integer and bool rewards: never NaN


def compute_group_advantages(
    rewards: torch.Tensor | Sequence,
    group_ids: GroupIds,
    *,
    epsilon: float = 1e-6,
    std_normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantages (Eq. 4) and the zero-advantage-group flag.

    ``A = (R - mean_g) / (std_g + epsilon)`` with the population std over the group
    (``std_normalize=False``: ``A = R - mean_g``, the Dr. GRPO variant).  Mean and std
    are computed in float64 over the group's SCORED members (NaN rewards are unscored, see
    the module docstring; an unscored sample's advantage is 0 and it enters no sum or count).
    Groups whose scored raw rewards are all exactly equal (``==``), and groups with fewer than
    2 scored members, get advantages of exactly 0.0, whatever rounding the std computation
    would give.

    Args:
        rewards: ``(N,)`` raw rewards (float or integer tensor, or a sequence of numbers);
            soft rewards such as 0.7 are fine; NaN marks an unscored sample.
        group_ids: ``(N,)`` integer tensor or a sequence of N hashable prompt ids
            (str, int, tuple, ...).  Groups are keyed by id, not position; members may be
            interleaved.
        epsilon: ``>= 0`` added to the std (klear's default 1e-6, verl's GRPO value).
        std_normalize: divide by ``std + epsilon`` (default) or only centre.

    Returns:
        ``(advantages, is_zero_adv_group)``: ``(N,)`` tensor of ``rewards.dtype``
        (float32 for integer / bool rewards) on the rewards' device, and ``(N,)`` bool,
        True for every member of an all-equal group (a group with at most one scored member
        included).

    Raises:
        ValueError: empty input, length mismatch, infinite reward (names the index),
            negative or non-finite epsilon, tensor arguments that are not 1-D.
        TypeError: unhashable ids, float id tensor, complex or non-numeric rewards.
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"epsilon must be a number, got {epsilon!r}")
    if not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon}")
    r = _as_1d("rewards", rewards)
    _check_rewards(r)
    out_dtype = r.dtype if r.is_floating_point() else torch.float32
    inverse, g = _group_index(group_ids, r)

    scored = _scored(r)
    w = scored.to(torch.float64)
    r64 = torch.where(scored, r.to(torch.float64), 0.0)  # unscored: out of every sum and count
    counts = r64.new_zeros(g).index_add_(0, inverse, w).clamp(min=1.0)
    mean = r64.new_zeros(g).index_add_(0, inverse, r64) / counts
    centred = (r64 - mean[inverse]) * w
    if std_normalize:
        var = r64.new_zeros(g).index_add_(0, inverse, centred * centred) / counts
        adv = centred / (var.sqrt()[inverse] + epsilon)
    else:
        adv = centred

    is_zero = _all_equal_by_index(r, inverse, g, scored)
    adv = torch.where(is_zero | ~scored, torch.zeros_like(adv), adv)
    return adv.to(out_dtype), is_zero
