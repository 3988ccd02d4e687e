"""The trainer's normalisation and filtering as plain tensor functions, on hand-computed values (no model).

* :func:`optimizer_window_counts`: the exact per-optimizer-step divisors (token-mean Eq. 7, SFT term Eq. 13,
  seq-mean Eq. 3) and ``GPPOTrainer._annotate_optimizer_windows`` around it (the cross-process reduce and the
  division by the number of processes, with the accelerator faked);
* :func:`rollout_keep_mask`: which samples enter the loss (unscored, zero-advantage groups Sec. 5.2.5, the
  overlong filter Sec. 4.1);
* :func:`rollout_rewards`, :func:`_prompt_key`, :func:`truncated_mask`, :func:`drop_filtered_samples`.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from types import SimpleNamespace

import pytest
import torch

from klear.rl.trainer import (
    GPPOTrainer,
    _prompt_key,
    drop_filtered_samples,
    optimizer_window_counts,
    rollout_keep_mask,
    rollout_rewards,
    truncated_mask,
)

NAN = float("nan")


# ---------------------------------------------------------------- optimizer_window_counts
def _window_inputs():
    """Four micro-batches of unequal token counts: ``(loss masks, is_correct)``.

    per micro-batch (tokens, correct tokens, responses with a token):
      0: rows of 2 and 0 tokens, both correct          -> (2, 2, 1)
      1: rows of 4 and 1 tokens, the second correct    -> (5, 1, 2)
      2: one row of 1 token, wrong                     -> (1, 0, 1)
      3: rows of 2, 2 and 1 tokens, rows 0 and 2 correct -> (5, 3, 3)
    """
    masks = [
        torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]),
        torch.tensor([[1.0]]),
        torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]]),
    ]
    correct = [
        torch.tensor([True, True]),
        torch.tensor([False, True]),
        torch.tensor([False]),
        torch.tensor([True, False, True]),
    ]
    return masks, correct


@pytest.mark.parametrize(
    "ga, expected",
    [
        (1, [[2, 2, 1], [5, 1, 2], [1, 0, 1], [5, 3, 3]]),
        (2, [[7, 3, 3], [6, 3, 4]]),  # sums of micro-batches 0+1 and 2+3
        (4, [[13, 6, 7]]),
    ],
)
def test_optimizer_window_counts_sum_each_step_s_micro_batches(ga, expected):
    masks, correct = _window_inputs()
    counts = optimizer_window_counts(masks, correct, ga)
    assert counts.dtype == torch.float64
    assert counts.tolist() == expected


def test_optimizer_window_counts_differ_from_per_micro_batch_counts():
    """Eq. 7 divides by the token count of the whole optimizer step: 7 for micro-batches 0 and 1 of step 0, where a
    per-micro-batch normaliser would use 2 and 5 (verl's style, exact only when every micro-batch is equal)."""
    masks, correct = _window_inputs()
    step = optimizer_window_counts(masks, correct, 2)
    per_mb = optimizer_window_counts(masks, correct, 1)
    assert step[0, 0].item() == 7.0
    assert per_mb[0, 0].item() * 2 != step[0, 0].item()
    assert per_mb[1, 0].item() * 2 != step[0, 0].item()


def test_optimizer_window_counts_accept_integer_correct_flags_and_stay_on_the_masks_device():
    ones = torch.ones(2, 3, device="meta")
    counts = optimizer_window_counts([ones, ones], [torch.ones(2, dtype=torch.bool, device="meta")] * 2, 2)
    assert counts.device.type == "meta" and counts.shape == (1, 3) and counts.dtype == torch.float64
    # 0/1 integer flags count like bools
    counts = optimizer_window_counts([torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])], [torch.tensor([0, 1])], 1)
    assert counts.tolist() == [[4.0, 1.0, 2.0]]


@pytest.mark.parametrize(
    "n_masks, n_flags, ga, message",
    [
        (2, 1, 1, "2 loss masks, 1 is_correct flags and gradient_accumulation_steps=1"),
        (1, 2, 1, "1 loss masks, 2 is_correct flags and gradient_accumulation_steps=1"),
        (0, 0, 1, "0 loss masks, 0 is_correct flags and gradient_accumulation_steps=1"),
        (2, 2, 0, "2 loss masks, 2 is_correct flags and gradient_accumulation_steps=0"),
        (3, 3, 2, "3 loss masks, 3 is_correct flags and gradient_accumulation_steps=2"),
    ],
)
def test_optimizer_window_counts_refuse_inconsistent_inputs(n_masks, n_flags, ga, message):
    mask, flag = torch.ones(1, 2), torch.tensor([True])
    with pytest.raises(
        ValueError,
        match=f"^optimizer_window_counts: {message}: expected one flag tensor per mask and a positive multiple of "
        "gradient_accumulation_steps >= 1 micro-batches$",
    ):
        optimizer_window_counts([mask] * n_masks, [flag] * n_flags, ga)


def test_annotate_optimizer_windows_reduces_over_processes_and_divides_by_their_number():
    """GPPOTrainer's side: the loss mask (completion x tool mask x keep), the sum over processes (faked: a second
    process adds known counts) and the division by the number of processes (DDP averages gradients)."""
    other = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 2.0]], dtype=torch.float64)  # the other process's counts
    calls = []

    def reduce(tensor, reduction):
        calls.append((tensor.clone(), reduction))
        return tensor + other

    fake = SimpleNamespace(
        args=SimpleNamespace(gradient_accumulation_steps=2),
        accelerator=SimpleNamespace(device=torch.device("cpu"), num_processes=2, reduce=reduce),
        _loss_mask=GPPOTrainer._loss_mask,
    )
    micro_batches = [
        {  # row 1 is filtered out (keep False): loss mask [[1, 1, 0], [0, 0, 0]]
            "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "klear_keep": torch.tensor([True, False]),
            "klear_is_correct": torch.tensor([True, True]),
        },
        {
            "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]),
            "klear_keep": torch.tensor([True, True]),
            "klear_is_correct": torch.tensor([False, True]),
        },
        {"completion_mask": torch.tensor([[1]]), "klear_keep": None, "klear_is_correct": torch.tensor([False])},
        {  # a tool-call token (tool_mask 0) is not a loss token: loss mask [[1, 1], [1, 1], [0, 1]]
            "completion_mask": torch.tensor([[1, 1], [1, 1], [1, 1]]),
            "tool_mask": torch.tensor([[1, 1], [1, 1], [0, 1]]),
            "klear_keep": torch.tensor([True, True, True]),
            "klear_is_correct": torch.tensor([True, False, True]),
        },
    ]
    GPPOTrainer._annotate_optimizer_windows(fake, micro_batches)
    (local, reduction), *more = calls
    assert not more and reduction == "sum"
    assert local.tolist() == [[7.0, 3.0, 3.0], [6.0, 3.0, 4.0]]  # this process's counts (see _window_inputs)
    # (local + other) / 2 processes, the same for both micro-batches of a step
    expected = [(4.0, 2.0, 2.0), (4.0, 2.0, 2.0), (4.5, 1.5, 3.0), (4.5, 1.5, 3.0)]
    for mb, (tokens, sft_tokens, seqs) in zip(micro_batches, expected, strict=True):
        assert all(type(mb[k]) is float for k in ("klear_num_tokens", "klear_num_sft_tokens", "klear_num_seqs"))
        assert (mb["klear_num_tokens"], mb["klear_num_sft_tokens"], mb["klear_num_seqs"]) == (
            tokens,
            sft_tokens,
            seqs,
        )


def test_loss_mask_is_completion_times_tool_mask_times_keep():
    completion = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert GPPOTrainer._loss_mask({"completion_mask": completion}).tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    mask = GPPOTrainer._loss_mask(
        {
            "completion_mask": completion,
            "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 0]]),
            "klear_keep": torch.tensor([True, False]),
        }
    )
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    no_tool = GPPOTrainer._loss_mask({"completion_mask": completion, "tool_mask": None, "klear_keep": None})
    assert no_tool.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


# ---------------------------------------------------------------- rollout_keep_mask
# Every combination of (scored, zero-advantage group, truncated), one sample each.
_SCORED = [False, False, False, False, True, True, True, True]
_ZERO_ADV = [False, False, True, True, False, False, True, True]
_TRUNCATED = [False, True, False, True, False, True, False, True]


@pytest.mark.parametrize(
    "filter_zero_adv_groups, overlong_filter, training, expected",
    [
        # unscored samples (0-3) never enter the loss
        (False, False, True, [0, 0, 0, 0, 1, 1, 1, 1]),
        (False, False, False, [0, 0, 0, 0, 1, 1, 1, 1]),
        # zero-advantage groups leave training batches only
        (True, False, True, [0, 0, 0, 0, 1, 1, 0, 0]),
        (True, False, False, [0, 0, 0, 0, 1, 1, 1, 1]),
        # the overlong filter acts in training and evaluation
        (False, True, True, [0, 0, 0, 0, 1, 0, 1, 0]),
        (False, True, False, [0, 0, 0, 0, 1, 0, 1, 0]),
        (True, True, True, [0, 0, 0, 0, 1, 0, 0, 0]),
        (True, True, False, [0, 0, 0, 0, 1, 0, 1, 0]),
    ],
)
def test_rollout_keep_mask_truth_table(filter_zero_adv_groups, overlong_filter, training, expected):
    scored, zero_adv, truncated = torch.tensor(_SCORED), torch.tensor(_ZERO_ADV), torch.tensor(_TRUNCATED)
    keep = rollout_keep_mask(
        scored,
        zero_adv,
        truncated,
        filter_zero_adv_groups=filter_zero_adv_groups,
        overlong_filter=overlong_filter,
        training=training,
    )
    assert keep.dtype == torch.bool
    assert keep.tolist() == [bool(x) for x in expected]
    # a new tensor: the scored flags (read again for the accuracy metric) are untouched
    assert scored.tolist() == _SCORED and zero_adv.tolist() == _ZERO_ADV and truncated.tolist() == _TRUNCATED


# ---------------------------------------------------------------- rollout_rewards
# Two reward functions weighted 1.0 and 0.5; groups a (one unscored member), b (equal rewards reached by different
# function values), c (correct, unequal), d (one correct).
_RPF = torch.tensor(
    [
        [1.0, 0.0],  # a: 1.0
        [0.0, 0.0],  # a: 0.0
        [1.0, NAN],  # a: unscored (one function returned None)
        [1.0, 2.0],  # b: 2.0
        [1.0, 2.0],  # b: 2.0
        [0.0, 4.0],  # b: 2.0
        [2.5, 0.0],  # c: 2.5
        [1.5, 0.0],  # c: 1.5
        [2.0, 0.0],  # d: 2.0
        [0.0, 0.0],  # d: 0.0
        [2.0, 0.0],  # e: 2.0
        [NAN, 1.0],  # e: unscored (is_correct False, but it does not take part in the group's flags)
        [3.0, 0.0],  # e: 3.0
    ]
)
_GROUPS = ["a", "a", "a", "b", "b", "b", "c", "c", "d", "d", "e", "e", "e"]


@pytest.mark.parametrize(
    "criterion, zero_adv",
    [
        ("reward", [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]),  # only b: all raw rewards equal
        # all wrong (a: 1.0 and 0.0 < 1.5) and all correct (b, c, e's scored members) groups are zero-advantage by
        # correctness
        ("correctness", [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1]),
    ],
)
def test_rollout_rewards_hand_computed(criterion, zero_adv):
    rr = rollout_rewards(
        _RPF, torch.tensor([1.0, 0.5]), _GROUPS, adv_epsilon=0.5, correct_reward=1.5, zero_adv_criterion=criterion
    )
    rewards = rr.rewards.tolist()
    assert math.isnan(rewards[2])
    assert math.isnan(rewards[11])
    assert rewards[:2] + rewards[3:11] + rewards[12:] == [1.0, 0.0, 2.0, 2.0, 2.0, 2.5, 1.5, 2.0, 0.0, 2.0, 3.0]
    assert rr.scored.tolist() == [True, True, False] + [True] * 8 + [False, True]
    # Eq. 4 with the population std over the scored members and epsilon 0.5:
    # a: mean 0.5, std 0.5 -> +-0.5 / 1.0; c: mean 2, std 0.5 -> +-0.5 / 1.0; d: mean 1, std 1 -> +-1 / 1.5;
    # e: mean 2.5, std 0.5 -> -+0.5 / 1.0; unscored samples 0
    expected_adv = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5, 2 / 3, -2 / 3, -0.5, 0.0, 0.5]
    assert rr.advantages.tolist() == pytest.approx(expected_adv, abs=1e-7)
    assert rr.is_correct.tolist() == [False, False, False, True, True, True, True, True, True, False, True, False, True]
    assert rr.zero_adv.tolist() == [bool(z) for z in zero_adv]


def test_rollout_rewards_move_the_weights_to_the_rewards_device():
    """TRL keeps ``reward_weights`` on the CPU while the rewards are on the accelerator: the weights must follow the
    rewards (a stand-in records where they are moved)."""

    class CpuWeights:
        def __init__(self):
            self.moved_to = []

        def to(self, device):
            self.moved_to.append(device)
            return torch.tensor([2.0])

    weights, rewards_per_func = CpuWeights(), torch.tensor([[1.0], [0.0]])
    rr = rollout_rewards(
        rewards_per_func, weights, ["a", "a"], adv_epsilon=1e-6, correct_reward=1.0, zero_adv_criterion="reward"
    )
    assert weights.moved_to == [rewards_per_func.device]
    assert rr.rewards.tolist() == [2.0, 0.0]


def test_rollout_rewards_with_no_scored_sample_stop():
    with pytest.raises(
        RuntimeError,
        match=r"^no sample of the rollout batch could be scored \(all 2 rewards are None/NaN\): the reward judge is "
        r"failing \(see the reward warnings above\); stopping rather than training on nothing$",
    ):
        rollout_rewards(
            torch.tensor([[NAN, 1.0], [1.0, NAN]]),
            torch.ones(2),
            ["a", "a"],
            adv_epsilon=1e-6,
            correct_reward=1.0,
            zero_adv_criterion="reward",
        )


# ---------------------------------------------------------------- _prompt_key
def _sha1(text: str) -> str:
    return "sha1:" + hashlib.sha1(text.encode()).hexdigest()


def test_prompt_key_is_the_prompt_id_else_a_hash_of_the_prompt():
    prompt = [{"role": "user", "content": "hi"}]
    assert _prompt_key({"prompt_id": "p1"}, prompt) == "p1"
    assert _prompt_key({"prompt_id": 0}, prompt) == "0"  # a falsy id is still an id
    # no prompt id: the hash of the prompt's canonical JSON (keys sorted, json.dumps' default separators)
    expected = _sha1('[{"content": "hi", "role": "user"}]')
    assert _prompt_key({}, prompt) == expected
    assert _prompt_key({"prompt_id": None}, [{"content": "hi", "role": "user"}]) == expected  # key order ignored
    # values JSON cannot write are hashed by their str()
    assert _prompt_key({}, {"date": datetime.date(2024, 1, 2)}) == _sha1('{"date": "2024-01-02"}')


# ---------------------------------------------------------------- truncated_mask
def test_truncated_mask_edge_cases():
    # stop id 9, limit 3: a full row ending in 9 is finished, a row longer than the limit without it is truncated,
    # a row of length 0 (every token masked) is not truncated.
    ids = torch.tensor([[4, 5, 9, 0], [4, 5, 6, 7], [4, 5, 6, 0], [9, 0, 0, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert truncated_mask(ids, mask, 3, [9]).tolist() == [False, True, True, False, False]
    # the stop ids are a list of any length (here: none, then two)
    assert truncated_mask(ids, mask, 3, []).tolist() == [True, True, True, False, False]
    assert truncated_mask(ids, mask, 3, [7, 6]).tolist() == [True, False, False, False, False]
    # limit 1: a one-token response is judged by its own (first) token
    one = torch.tensor([[9, 5], [5, 9]])
    assert truncated_mask(one, torch.tensor([[1, 0], [1, 0]]), 1, [9]).tolist() == [False, True]


# ---------------------------------------------------------------- drop_filtered_samples
def _micro_batch(ids, lengths, keep, width=4):
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return {
        "completion_ids": torch.tensor([[i] * width for i in ids]),
        "completion_mask": mask,
        "old_per_token_logps": mask.float(),
        "ref_per_token_logps": None,
        "tool_mask": mask.clone(),
        "advantages": torch.tensor(ids, dtype=torch.float),
        "klear_keep": torch.tensor(keep),
        "prompt_ids": torch.ones(len(ids), 5, dtype=torch.long),  # its width is not the completion width
        "prompt_text": [f"p{i}" for i in ids],
        "num_items_in_batch": torch.tensor(9),
    }


def test_drop_filtered_samples_spreads_the_kept_samples_over_the_same_micro_batches():
    out = drop_filtered_samples(
        [
            _micro_batch([0, 1, 2], [4, 1, 2], [True, False, True]),
            _micro_batch([3, 4, 5], [3, 2, 1], [True, True, False]),
            _micro_batch([6, 7, 8], [1, 1, 1], [False, False, True]),
        ]
    )
    # kept in order 0, 2, 3, 4, 8 over three micro-batches: 2, 2, 1
    assert [mb["advantages"].tolist() for mb in out] == [[0.0, 2.0], [3.0, 4.0], [8.0]]
    assert [mb["prompt_text"] for mb in out] == [["p0", "p2"], ["p3", "p4"], ["p8"]]
    assert all(mb["klear_keep"].all() for mb in out)
    # completion tensors are trimmed to each micro-batch's longest response (4, 3, 1); the prompt is not
    for mb, width in zip(out, [4, 3, 1], strict=True):
        for key in ("completion_ids", "completion_mask", "old_per_token_logps", "tool_mask"):
            assert mb[key].shape == (len(mb["advantages"]), width), key
        assert mb["prompt_ids"].shape == (len(mb["advantages"]), 5)
        assert mb["ref_per_token_logps"] is None and mb["num_items_in_batch"].item() == 9
    assert out[1]["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_drop_filtered_samples_of_a_single_micro_batch():
    (out,) = drop_filtered_samples([_micro_batch([0, 1, 2], [2, 3, 1], [True, False, True])])
    assert out["advantages"].tolist() == [0.0, 2.0]
    assert out["completion_ids"].shape == (2, 2)


def test_drop_filtered_samples_with_nothing_kept_keeps_one_masked_sample_per_micro_batch():
    out = drop_filtered_samples(
        [_micro_batch([0, 1], [0, 2], [False, False]), _micro_batch([2, 3], [3, 1], [False, False])]
    )
    assert [mb["advantages"].tolist() for mb in out] == [[0.0], [1.0]]
    assert [mb["klear_keep"].tolist() for mb in out] == [[False], [False]]
    # a filler keeps one column (no zero-width tensors), whatever its length (issue 22: fillers cost ~nothing)
    assert [mb["completion_ids"].size(1) for mb in out] == [1, 1]


def test_a_filler_only_micro_batch_is_cut_to_one_prompt_and_one_completion_token():
    """Issue 22 (low): with fewer kept samples than micro-batches, the filtered fillers run one prompt token and one
    completion token (they enter no loss term and no divisor); the kept sample's micro-batch is untouched."""
    mbs = [_micro_batch([0, 1], [4, 3], [False, True]), _micro_batch([2, 3], [4, 4], [False, False])]
    for mb in mbs:
        mb["prompt_ids"] = torch.arange(10).view(2, 5) + 100 * mb["advantages"].long()[:, None]
        mb["prompt_mask"] = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    kept, filler = drop_filtered_samples(mbs)
    assert kept["klear_keep"].tolist() == [True] and filler["klear_keep"].tolist() == [False]
    assert kept["completion_ids"].shape == (1, 3) and kept["prompt_ids"].shape == (1, 5)
    assert kept["prompt_mask"].tolist() == [[0, 1, 1, 1, 1]]
    for key in ("completion_ids", "completion_mask", "old_per_token_logps", "tool_mask"):
        assert filler[key].shape == (1, 1), key
    assert filler["prompt_ids"].tolist() == [[4]] and filler["prompt_mask"].tolist() == [[1]]  # row 0's last token
