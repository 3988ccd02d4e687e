"""Tests for klear.rl.advantages (GRPO Eq. 4, zero-advantage group detection)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from klear.rl.advantages import (
    all_equal_groups,
    compute_group_advantages,
    filter_mask_exact_correct,
    zero_advantage_group_mask,
)


def test_hand_case_single_group():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    adv, zero = compute_group_advantages(rewards, [0, 0, 0, 0])
    # mean 0, population std 1 (sample std would be 2/sqrt(3))
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64) / (1.0 + 1e-6)
    assert torch.equal(adv, expected)
    assert adv.dtype == torch.float64
    assert not zero.any()


def test_population_std_not_sample_std():
    rewards = [1.0, 0.0, 0.0, 0.0]  # mean 0.25, pop var 0.1875
    adv, _ = compute_group_advantages(torch.tensor(rewards), ["p"] * 4, epsilon=0.0)
    pstd = statistics.pstdev(rewards)
    assert pstd == pytest.approx(math.sqrt(0.1875))
    expected = [(r - 0.25) / pstd for r in rewards]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[0].item() == pytest.approx(math.sqrt(3), rel=1e-6)  # not 1.5 (sample std)


def test_interleaved_string_group_ids_match_per_group_reference():
    rewards = [1.0, 0.25, -1.0, 0.5, 1.0, 0.0, -1.0, 0.75, 0.3]
    ids = ["a", "b", "a", "b", "a", "b", "a", "b", "c"]
    adv, zero = compute_group_advantages(torch.tensor(rewards, dtype=torch.float64), ids)
    # independent reference, per group, with the statistics module
    for gid in set(ids):
        idx = [i for i, g in enumerate(ids) if g == gid]
        vals = [rewards[i] for i in idx]
        m, s = statistics.fmean(vals), statistics.pstdev(vals)
        for i in idx:
            exp = 0.0 if len(set(vals)) == 1 else (rewards[i] - m) / (s + 1e-6)
            assert adv[i].item() == pytest.approx(exp, rel=1e-12, abs=1e-15), (gid, i)
    assert zero.tolist() == [False] * 8 + [True]  # "c" is a group of size 1
    assert adv[8].item() == 0.0


def test_int_tensor_ids_and_positions_do_not_matter():
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0, 9.0])
    ids = torch.tensor([7, 2, 7, 2, 7, 2])
    adv, _ = compute_group_advantages(rewards, ids)
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    adv_p, _ = compute_group_advantages(rewards[perm], ids[perm])
    torch.testing.assert_close(adv_p, adv[perm], rtol=0, atol=0)
    # same as contiguous blocks keyed by the same ids
    adv_c, _ = compute_group_advantages(rewards[[0, 2, 4, 1, 3, 5]], [7, 7, 7, 2, 2, 2])
    torch.testing.assert_close(adv_c, adv[[0, 2, 4, 1, 3, 5]], rtol=0, atol=0)


def test_soft_all_equal_group_float32_exactly_zero_and_flagged():
    rewards = torch.tensor([0.7] * 8 + [0.1, 0.9, 0.1, 0.9], dtype=torch.float32)
    ids = [0] * 8 + [1] * 4
    adv, zero = compute_group_advantages(rewards, ids)
    assert adv.dtype == torch.float32
    assert torch.all(adv[:8] == 0.0)
    assert zero.tolist() == [True] * 8 + [False] * 4
    assert adv[8:].tolist() == pytest.approx([-1, 1, -1, 1], rel=1e-5)
    assert torch.equal(zero_advantage_group_mask(rewards, ids), zero)


def test_nearly_equal_but_different_rewards_are_not_flagged():
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5 + 1e-7], dtype=torch.float64)
    adv, zero = compute_group_advantages(rewards, [1, 1, 1, 1])
    assert not zero.any()
    assert adv[3].item() > 0 and adv[0].item() < 0


def test_integer_rewards_give_float32_and_all_wrong_group_zero():
    adv, zero = compute_group_advantages(torch.tensor([-1, -1, -1, 1, -1, 1]), [0, 0, 0, 1, 1, 1])
    assert adv.dtype == torch.float32
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert zero.tolist() == [True, True, True, False, False, False]
    s = math.sqrt(8 / 9)
    assert adv[3:].tolist() == pytest.approx([(2 / 3) / s, (-4 / 3) / s, (2 / 3) / s], rel=1e-5)


def test_no_std_normalize():
    adv, _ = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), [0] * 4, std_normalize=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_all_equal_groups_and_exact_correct_filter():
    ids = ["x", "y", "x", "z", "y", "z"]
    assert all_equal_groups([1, 2, 1, 3, 2, 4], ids).tolist() == [True, True, True, False, True, False]
    assert all_equal_groups(torch.tensor([float("nan"), float("nan")]), [0, 0]).tolist() == [False, False]
    assert all_equal_groups(torch.tensor([]), []).numel() == 0
    # soft code rewards: all wrong (is_correct False) but rewards differ
    rewards = torch.tensor([0.25, 0.5, 1.0, 1.0])
    correct = torch.tensor([False, False, True, True])
    gids = [0, 0, 1, 1]
    assert filter_mask_exact_correct(correct, gids).tolist() == [True, True, True, True]
    assert zero_advantage_group_mask(rewards, gids).tolist() == [False, False, True, True]
    assert filter_mask_exact_correct([1, 0, 1, 1], gids).tolist() == [False, False, True, True]


def test_bad_inputs():
    with pytest.raises(ValueError, match="length"):
        compute_group_advantages(torch.tensor([1.0, 2.0]), [0, 0, 0])
    with pytest.raises(ValueError, match="length"):
        compute_group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="empty"):
        compute_group_advantages(torch.tensor([]), [])
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        compute_group_advantages(torch.tensor([1.0, float("inf")]), [0, 0])
    with pytest.raises(ValueError, match="1-D"):
        compute_group_advantages(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="epsilon"):
        compute_group_advantages(torch.tensor([1.0]), [0], epsilon=-1e-6)
    with pytest.raises(TypeError, match="integer dtype"):
        compute_group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(TypeError, match="hashable"):
        compute_group_advantages(torch.tensor([1.0, 2.0]), [[0], [0]])
    with pytest.raises(TypeError, match="sequence of hashable prompt ids, got str"):
        compute_group_advantages(torch.tensor([1.0, 2.0]), "ab")
    with pytest.raises(ValueError, match="0/1"):
        filter_mask_exact_correct(torch.tensor([0, 2]), [0, 0])


# ------------------------------------------------------------------ unscored samples (NaN rewards)
NAN = float("nan")


def test_unscored_members_are_out_of_their_groups_statistics_float64_by_hand():
    """Group "a": 1, -1, -1 scored + one unscored; mean and population std over the 3 scored members only."""
    rewards = [1.0, NAN, -1.0, 0.5, -1.0, NAN, 0.25, 1.0]
    ids = ["a", "a", "a", "b", "a", "b", "b", "c"]
    adv, zero = compute_group_advantages(torch.tensor(rewards, dtype=torch.float64), ids)
    # a: scored 1, -1, -1 -> mean -1/3, pop var ((4/3)^2 + 2 (2/3)^2) / 3 = 8/9
    m_a, s_a = -1 / 3, math.sqrt(8 / 9)
    # b: scored 0.5, 0.25 -> mean 0.375, pop std 0.125
    m_b, s_b = 0.375, 0.125
    expected = [
        (1.0 - m_a) / (s_a + 1e-6),
        0.0,
        (-1.0 - m_a) / (s_a + 1e-6),
        (0.5 - m_b) / (s_b + 1e-6),
        (-1.0 - m_a) / (s_a + 1e-6),
        0.0,
        (0.25 - m_b) / (s_b + 1e-6),
        0.0,  # c: a group of one
    ]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert adv[1].item() == 0.0 and adv[5].item() == 0.0
    assert zero.tolist() == [False] * 7 + [True]


def test_a_group_with_fewer_than_two_scored_members_has_zero_advantages():
    rewards = torch.tensor([1.0, NAN, NAN, NAN, NAN, NAN, 1.0, -1.0], dtype=torch.float64)
    ids = [0, 0, 0, 1, 1, 2, 2, 2]
    adv, zero = compute_group_advantages(rewards, ids)
    assert adv[:5].tolist() == [0.0] * 5  # group 0: one scored member; group 1: none
    assert zero.tolist() == [True] * 5 + [False] * 3
    assert adv[5:].tolist() == pytest.approx([0.0, 1 / (1 + 1e-6), -1 / (1 + 1e-6)])
    assert torch.equal(zero_advantage_group_mask(rewards, ids), zero)


def test_scored_members_decide_whether_a_group_is_all_equal():
    """1, 1, NaN: the scored members agree, so the group is zero-advantage (the NaN is not a different reward)."""
    rewards = torch.tensor([1.0, 1.0, NAN, 1.0, -1.0, NAN], dtype=torch.float32)
    adv, zero = compute_group_advantages(rewards, [0, 0, 0, 1, 1, 1])
    assert zero.tolist() == [True, True, True, False, False, False]
    assert adv.tolist()[:3] == [0.0, 0.0, 0.0] and adv[5].item() == 0.0
    correct = torch.tensor([True, False, False, True, True, False])
    scored = ~torch.isnan(rewards)
    # is_correct of an unscored sample is False, but it must not make the group "mixed"
    assert all_equal_groups(correct, [0, 0, 0, 1, 1, 1], scored=scored).tolist() == [False] * 3 + [True] * 3
    assert all_equal_groups(correct, [0, 0, 0, 1, 1, 1]).tolist() == [False] * 6
