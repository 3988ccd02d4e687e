"""More tests of klear.rl.advantages, for what the mutation run (`make mutation`, issue 21) found unpinned: the full
error messages, groups of one, epsilon = 0 on all-equal groups, 0/1 ``scored`` flags and the device of the result.
Expected values are written by hand."""

from __future__ import annotations

import re

import pytest
import torch

from klear.rl.advantages import (
    all_equal_groups,
    compute_group_advantages,
    filter_mask_exact_correct,
    zero_advantage_group_mask,
)

NAN = float("nan")


def _exact(msg):
    return "^" + re.escape(msg) + "$"


def test_error_messages_name_the_argument_and_what_was_expected():
    two_d = torch.zeros(2, 2)
    cases = [
        (
            TypeError,
            lambda: all_equal_groups("ab", [0, 0]),
            "values must be a 1-D tensor or a sequence of numbers, got str",
        ),
        (
            TypeError,
            lambda: compute_group_advantages(torch.tensor([1j, 2j]), [0, 0]),
            "rewards must be real, got dtype torch.complex64",
        ),
        (ValueError, lambda: all_equal_groups(two_d, [0, 0]), "values must be 1-D (N,), got shape (2, 2)"),
        (ValueError, lambda: compute_group_advantages(two_d, [0, 0]), "rewards must be 1-D (N,), got shape (2, 2)"),
        (ValueError, lambda: zero_advantage_group_mask(two_d, [0, 0]), "rewards must be 1-D (N,), got shape (2, 2)"),
        (ValueError, lambda: filter_mask_exact_correct(two_d, [0, 0]), "is_correct must be 1-D (N,), got shape (2, 2)"),
        (
            ValueError,
            lambda: all_equal_groups([1, 2, 3], [0, 0, 1], scored=torch.ones(3, 1)),
            "scored must be 1-D (N,), got shape (3, 1)",
        ),
        (
            ValueError,
            lambda: all_equal_groups([1, 2, 3], [0, 0, 1], scored=[True, False]),
            "scored has length 2 but there are 3 values",
        ),
        (
            ValueError,
            lambda: all_equal_groups([1, 2], torch.zeros(2, 1, dtype=torch.long)),
            "group_ids must be 1-D (N,), got shape (2, 1)",
        ),
        (
            TypeError,
            lambda: all_equal_groups([1, 2], (i for i in [0, 0])),
            "group_ids must be an integer tensor or a sequence of hashable prompt ids, got generator",
        ),
        (ValueError, lambda: compute_group_advantages([], []), "rewards is empty"),
        (ValueError, lambda: filter_mask_exact_correct([2], [0]), "is_correct must contain only booleans (or 0/1)"),
        (
            TypeError,
            lambda: compute_group_advantages([1.0, 0.0], [0, 0], epsilon=True),
            "epsilon must be a number, got True",
        ),
        (
            TypeError,
            lambda: compute_group_advantages([1.0, 0.0], [0, 0], epsilon="0"),
            "epsilon must be a number, got '0'",
        ),
    ]
    for error, call, message in cases:
        with pytest.raises(error, match=_exact(message)):
            call()
    with pytest.raises(TypeError, match="^rewards must be a 1-D tensor or a sequence of numbers: "):
        compute_group_advantages([[1.0], [2.0, 3.0]], [0, 0])  # ragged: torch.as_tensor refuses it


def test_a_single_sample_with_a_tensor_id_is_its_own_all_equal_group():
    assert all_equal_groups(torch.tensor([0.3]), torch.tensor([7])).tolist() == [True]
    adv, zero = compute_group_advantages(torch.tensor([0.3]), torch.tensor([7]))
    assert adv.tolist() == [0.0] and zero.tolist() == [True]
    empty = all_equal_groups(torch.tensor([]), torch.tensor([], dtype=torch.long))
    assert empty.dtype == torch.bool and empty.shape == (0,)


def test_all_equal_groups_are_exactly_zero_with_epsilon_zero():
    """epsilon = 0: an all-equal group has std 0 and 0 / 0 would be NaN; Eq. 4's value there is 0 by definition."""
    rewards = torch.tensor([0.5, 0.5, 1.0, 0.0, 2.0, NAN, 2.0], dtype=torch.float64)
    adv, zero = compute_group_advantages(rewards, [0, 0, 1, 1, 2, 2, 2], epsilon=0.0)
    assert adv.tolist() == [0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0]  # group 1: mean 0.5, population std 0.5
    assert zero.tolist() == [True, True, False, False, True, True, True]


def test_scored_flags_may_be_given_as_0_1_integers():
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    ids = [0, 0, 0, 1, 1, 1]
    as_bool = all_equal_groups(values, ids, scored=torch.tensor([True, False, True, True, True, False]))
    assert as_bool.tolist() == [True] * 3 + [False] * 3
    assert torch.equal(all_equal_groups(values, ids, scored=torch.tensor([1, 0, 1, 1, 1, 0])), as_bool)
    assert torch.equal(all_equal_groups(values, ids, scored=[1, 0, 1, 1, 1, 0]), as_bool)


@pytest.mark.parametrize(
    "ids", [[3, 1, 3, 1], ["a", "b", "a", "b"], torch.tensor([3, 1, 3, 1])], ids=["ints", "strs", "cpu_tensor"]
)
def test_all_equal_groups_stay_on_the_values_device(ids):
    """The meta device stands in for an accelerator: a tensor made without the values' device lands on the CPU."""
    meta = torch.device("meta")
    values = torch.tensor([1.0, 2.0, 1.0, 3.0], device=meta)
    for scored in (None, torch.tensor([True, True, False, True])):
        out = all_equal_groups(values, ids, scored=scored)
        assert out.device == meta and out.dtype == torch.bool and out.shape == (4,)
    empty = all_equal_groups(torch.zeros(0, device=meta), [])
    assert empty.device == meta and empty.dtype == torch.bool
