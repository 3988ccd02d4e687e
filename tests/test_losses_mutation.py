"""More tests of klear.rl.losses, for what the mutation run (`make mutation`, issue 21) found unpinned: the exact
clip / dual-clip boundaries, advantages of 0 or in (0, 1), batches with one token or none, the log-ratio clamp's
lower side, dtypes and devices of the loss and its metrics, the TokenTerms a mode receives, and the full error
messages.

Expected values are written by hand or computed here in float64 (math / a literal formula), never read back from
the code under test.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from klear.rl.losses import (
    LOG_RATIO_CLAMP,
    LOSS_REGISTRY,
    LossInputs,
    LossMode,
    LossSettings,
    TokenLoss,
    entropy_ratio,
    policy_loss,
    sft_loss,
    total_loss,
)

F64 = torch.float64
BF16 = torch.bfloat16
CLIP_METRICS = ("clip_frac_high", "clip_frac_low", "clip_frac", "dual_clip_frac")


def _tokens(log_ratios, advantages, mask=None, dtype=F64):
    """One response per token (column 0); ``log_prob - old_log_prob`` is exactly the given log-ratio."""
    old = torch.full((len(log_ratios), 1), -0.5, dtype=dtype)
    lp = (old + torch.tensor(log_ratios, dtype=dtype)[:, None]).requires_grad_(True)
    if mask is None:
        mask = torch.ones(len(log_ratios), 1)
    return lp, old, torch.tensor(advantages, dtype=dtype), mask


def _exact(msg):
    return "^" + re.escape(msg) + "$"


# --------------------------------------------------------------------------- clip boundaries


@pytest.mark.parametrize("mode", ["ppo_clip", "gppo", "gppo_only_high", "cispo"])
def test_a_ratio_exactly_at_a_clip_bound_is_not_clipped(mode):
    """eps_low = eps_high = 0 puts both bounds at 1 and a first-update ratio is exactly 1: ``r > hi`` and ``r < lo``
    are strict (Eq. 5), so no token is clipped and each keeps F = r = 1."""
    lp, old, adv, mask = _tokens([0.0, 0.0], [2.0, -3.0])
    loss, m = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_low=0.0, clip_ratio_high=0.0)
    loss.backward()
    assert [m[k].item() for k in CLIP_METRICS] == [0.0, 0.0, 0.0, 0.0]
    assert lp.grad[:, 0].tolist() == [-2.0 / 2, 3.0 / 2]  # -F * A / N with F = 1


@pytest.mark.parametrize("mode", ["ppo_clip", "gppo", "gppo_only_high"])
def test_a_zero_advantage_token_is_in_no_clip_category(mode):
    """A = 0: neither ``A > 0`` (high side) nor ``A < 0`` (low side, dual clip) holds, whatever r."""
    lp, old, adv, mask = _tokens([math.log(5.0), math.log(0.5)], [0.0, 0.0])
    loss, m = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0)
    loss.backward()
    assert [m[k].item() for k in CLIP_METRICS] == [0.0, 0.0, 0.0, 0.0]
    assert loss.item() == 0.0 and lp.grad.abs().sum().item() == 0.0


def test_advantages_below_one_take_the_branch_of_their_sign():
    """0 < A < 1: a low ratio is not clipped (A > 0: value -r*A, F = r) and a ratio above c is clipped high, not
    dual-capped (value -hi*A, F = 0 for ppo_clip)."""
    lp, old, adv, mask = _tokens([math.log(0.5), math.log(5.0)], [0.5, 0.25])
    loss, m = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", clip_ratio_c=3.0)
    loss.backward()
    r0 = math.exp(math.log(0.5))
    assert loss.item() == pytest.approx((-r0 * 0.5 - 1.28 * 0.25) / 2, rel=1e-14)
    assert lp.grad[:, 0].tolist() == pytest.approx([-r0 * 0.5 / 2, 0.0], rel=1e-14, abs=0.0)
    assert [m[k].item() for k in CLIP_METRICS] == [0.5, 0.0, 0.5, 0.0]


def test_the_dual_clip_cap_is_taken_only_above_c():
    """A ratio exactly equal to c is not capped: ``-A*c`` is the same value there, but the token keeps F = r."""
    c = torch.exp(torch.tensor(1.0, dtype=F64)).item()  # the ratio of log-ratio 1.0, bit for bit
    lp, old, adv, mask = _tokens([1.0, 1.5], [-1.0, -1.0])
    loss, m = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", clip_ratio_c=c)
    loss.backward()
    assert lp.grad[:, 0].tolist() == [c / 2, 0.0]  # -F*A/N: F = r = c below the cap; the capped token has F = 0
    assert loss.item() == pytest.approx(c, rel=1e-15)  # (c + c) / 2
    assert m["dual_clip_frac"].item() == 0.5


# --------------------------------------------------------------------------- one token, no token


def test_one_unmasked_token_is_its_own_mean():
    """Every divisor is 1 with a single unmasked token: the ratio statistics, the fractions, the KL and the loss."""
    x = 0.5  # log-ratio > log(1.28): clipped high with A > 0
    lp, old, adv, mask = _tokens([x, -0.3], [2.0, 7.0], mask=torch.tensor([[1], [0]]))
    h_old = torch.tensor([[1.0], [1.0]], dtype=F64)
    loss, m = policy_loss(
        lp, old, adv, mask, loss_mode="ppo_erc", entropies=h_old * 2, old_entropies=h_old, clip_ratio_c=3.0
    )
    r = math.exp(x)
    assert m["ratio_mean"].item() == m["ratio_max"].item() == m["ratio_min"].item() == pytest.approx(r, rel=1e-15)
    assert m["clip_frac_high"].item() == 1.0 and m["clip_frac"].item() == 1.0
    assert m["ppo_kl"].item() == pytest.approx(-x, rel=1e-15)
    assert loss.item() == pytest.approx(-1.28 * 2.0, rel=1e-15)
    rho = (2 + 1e-8) / (1 + 1e-8)
    assert m["erc_frac"].item() == m["erc_frac_high"].item() == 1.0
    assert m["entropy_ratio_mean"].item() == pytest.approx(rho, rel=1e-15)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_mean_over_a_single_response(agg):
    """One response with tokens (the other fully masked): the mean over responses divides by 1."""
    old = torch.zeros(2, 3, dtype=F64)
    lp = old.clone().requires_grad_(True)  # r = 1: per-token loss -A
    adv = torch.tensor([[1.0, 2.0, 4.0], [8.0, 8.0, 8.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", loss_agg_mode=agg)
    loss.backward()
    per_seq_divisor = 2.0 if agg == "seq-mean-token-mean" else 1.0
    assert loss.item() == -(1.0 + 2.0) / per_seq_divisor
    assert lp.grad.tolist() == [[-1.0 / per_seq_divisor, -2.0 / per_seq_divisor, 0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("mode", ["gppo", "gppo_erc"])
def test_metrics_without_unmasked_tokens_take_their_documented_values(mode):
    """No unmasked token: ratio and entropy-ratio statistics are 1.0, fractions, KL and entropies 0 (policy_loss)."""
    lp = torch.randn(3, 4, dtype=F64) * 3
    ent = torch.rand(3, 4, dtype=F64) * 5
    _, m = policy_loss(
        lp,
        lp * 2,
        torch.ones(3, dtype=F64),
        torch.zeros(3, 4),
        loss_mode=mode,
        entropies=ent,
        old_entropies=ent / 2,
        clip_ratio_c=3.0,
    )
    ones = ["ratio_mean", "ratio_max", "ratio_min"]
    if mode == "gppo_erc":
        ones += ["entropy_ratio_mean", "entropy_ratio_max", "entropy_ratio_min"]
    assert {k: m[k].item() for k in ones} == {k: 1.0 for k in ones}
    assert {k: v.item() for k, v in m.items() if k not in ones} == {k: 0.0 for k in m if k not in ones}


@pytest.mark.parametrize("mode", ["ppo_clip", "cispo", "ppo_erc"])
def test_an_empty_batch_gives_a_zero_loss_and_the_empty_metrics_in_float64(mode):
    lp = torch.zeros(0, 5, dtype=F64, requires_grad=True)
    ent = torch.zeros(0, 5, dtype=F64)
    loss, m = policy_loss(
        lp, lp.detach(), torch.zeros(0, dtype=F64), torch.zeros(0, 5), loss_mode=mode, entropies=ent, old_entropies=ent
    )
    assert loss.item() == 0.0 and loss.dtype == F64
    assert all(v.dtype == F64 for v in m.values()), {k: v.dtype for k, v in m.items()}
    assert m["ratio_mean"].item() == m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["clip_frac"].item() == 0.0 and m["entropy_mean"].item() == 0.0


def test_the_log_ratio_is_clamped_from_below_too():
    """log-ratio -200 on an unmasked token: r = exp(-20) (the documented clamp), not exp(-200)."""
    lp, old, adv, mask = _tokens([-200.0], [3.0])  # r < lo with A > 0: the unclipped branch -r*A
    loss, m = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip")
    assert m["ratio_min"].item() == pytest.approx(math.exp(-LOG_RATIO_CLAMP), rel=1e-15)
    assert loss.item() == pytest.approx(-3.0 * math.exp(-20.0), rel=1e-15)


def test_a_fractional_divisor_is_used_as_given():
    """num_tokens below 1 (1 token of the step over 2 workers: 0.5) divides by 0.5; 0 with no token divides nothing."""
    lp, old, adv, mask = _tokens([0.0], [2.0])
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", num_tokens=0.5)
    loss.backward()
    assert loss.item() == -2.0 / 0.5 and lp.grad[0, 0].item() == -2.0 / 0.5
    seq, _ = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", loss_agg_mode="seq-mean-token-sum", num_seqs=0.5)
    assert seq.item() == -2.0 / 0.5


# --------------------------------------------------------------------------- dtypes and devices


def test_bf16_inputs_give_float32_loss_and_metrics():
    """bf16 log-probs (and entropies): the loss and every metric are float32 (module docstring, Dtypes)."""
    g = torch.Generator().manual_seed(0)
    old = (-torch.rand(3, 5, generator=g) * 2).to(BF16)
    lp = (old.float() + torch.randn(3, 5, generator=g) * 0.5).to(BF16).requires_grad_(True)
    ent = (torch.rand(3, 5, generator=g) + 0.5).to(BF16)
    for mode in ("gppo", "gppo_erc", "cispo"):
        loss, m = policy_loss(
            lp,
            old,
            torch.randn(3, generator=g),
            torch.ones(3, 5),
            loss_mode=mode,
            entropies=ent,
            old_entropies=ent * 1.02,
            clip_ratio_c=3.0,
        )
        assert loss.dtype == torch.float32
        assert {k: v.dtype for k, v in m.items()} == {k: torch.float32 for k in m}, mode


def test_metrics_are_in_the_input_accumulation_dtype_whatever_the_entropies_dtype():
    """float32 log-probs with float64 entropies: the entropy, entropy-share and ERC metrics are float32 too."""
    lp, old, adv, mask = _tokens([0.1, 0.6, -0.4], [1.0, 1.0, -1.0], dtype=torch.float32)
    ent = torch.tensor([[0.5], [1.0], [2.0]], dtype=F64)
    _, m = policy_loss(lp, old, adv, mask, loss_mode="ppo_erc", entropies=ent, old_entropies=ent * 1.5)
    assert {k: v.dtype for k, v in m.items()} == {k: torch.float32 for k in m}
    assert m["entropy_mean"].item() == pytest.approx(3.5 / 3, rel=1e-7)
    assert m["erc_frac"].item() == 1.0  # rho = 1 / 1.5 for every token


def test_bf16_entropies_are_summed_in_float32():
    """The entropy metrics accumulate in float32: 1 + 1/256 is not a bf16 number (it rounds to 1)."""
    lp, old, adv, mask = _tokens([0.0, 0.0], [1.0, 1.0], dtype=torch.float32)
    ent = torch.tensor([[1.0], [1.0 / 256]], dtype=BF16)
    _, m = policy_loss(lp, old, adv, mask, entropies=ent)
    assert m["entropy_mean"].item() == (1.0 + 1.0 / 256) / 2


def test_entropy_ratio_of_bf16_entropies_is_float32_and_exact_at_zero():
    """rho is computed in float32 for bf16 entropies: two zero entropies give exactly 1 (the 1e-8, rounded the same
    way on both sides) and 3 / 7 is float32-accurate (a bf16 division is ~2e-3 off)."""
    zero = torch.zeros(2, 2, dtype=BF16)
    rho = entropy_ratio(zero, zero)
    assert rho.dtype == torch.float32 and rho.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    three, seven = torch.full((1, 1), 3.0, dtype=BF16), torch.full((1, 1), 7.0, dtype=BF16)
    assert entropy_ratio(three, seven).item() == pytest.approx(3.0 / 7.0, rel=1e-7)  # bf16 division: ~2e-3 off


def test_sft_loss_of_bf16_log_probs_is_float32():
    lp = torch.tensor([[-1.0, -1.0 / 256]], dtype=BF16, requires_grad=True)
    loss = sft_loss(lp, torch.ones(1, 2), torch.tensor([True]))
    assert loss.dtype == torch.float32
    assert loss.item() == (1.0 + 1.0 / 256) / 2  # a bf16 sum would round 1 + 1/256 to 1


def test_a_mode_receives_token_terms_in_the_promoted_dtype_zeroed_at_masked_positions(monkeypatch):
    """TokenTerms' documented contract: (B, T) tensors in promote(log_prob, old_log_prob); adv and log_ratio 0 and
    ratio 1 at masked positions (whatever junk the caller left there)."""
    seen = []

    def probe(t, s):
        seen.append(t)
        return TokenLoss(-t.ratio * t.adv, torch.zeros_like(t.mask), torch.zeros_like(t.mask))

    monkeypatch.setitem(LOSS_REGISTRY, "probe", LossMode("probe", probe))
    lp = torch.tensor([[-1.0, math.nan], [-2.0, -3.0]], dtype=BF16)
    old = torch.tensor([[-1.5, -1.0], [-2.0, math.inf]], dtype=torch.float32)
    adv = torch.tensor([[1.0, math.nan], [2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 0], [1, 0]])
    policy_loss(lp, old, adv, mask, loss_mode="probe")
    (t,) = seen
    assert {t.log_prob.dtype, t.adv.dtype, t.log_ratio.dtype, t.ratio.dtype} == {torch.float32}
    assert t.adv[:, 1].tolist() == [0.0, 0.0] and t.log_ratio[:, 1].tolist() == [0.0, 0.0]
    assert t.ratio[:, 1].tolist() == [1.0, 1.0]
    assert t.log_ratio[:, 0].tolist() == [0.5, 0.0] and t.adv[:, 0].tolist() == [1.0, 2.0]
    assert (t.lo, t.hi) == (0.8, 1.28)


def test_loss_and_metrics_stay_on_the_inputs_device():
    """The meta device stands in for an accelerator: a tensor made without the inputs' device lands on the CPU.
    An empty batch takes the early returns, where nothing on the inputs' device is combined with it."""
    meta = torch.device("meta")
    lp = torch.zeros(0, 3, dtype=F64, device=meta, requires_grad=True)
    adv = torch.zeros(0, dtype=F64, device=meta)
    mask = torch.zeros(0, 3, dtype=torch.bool, device=meta)
    ent = torch.zeros(0, 3, dtype=F64, device=meta)
    loss, m = policy_loss(lp, lp.detach(), adv, mask, loss_mode="gppo_erc", entropies=ent, old_entropies=ent)
    assert loss.device == meta and {k: v.device for k, v in m.items()} == {k: meta for k in m}
    loss, m = total_loss(LossInputs(lp, lp.detach(), adv, mask), LossSettings(alpha=0.0))
    assert loss.device == meta and {k: v.device for k, v in m.items()} == {k: meta for k in m}


# --------------------------------------------------------------------------- error messages


def test_policy_loss_error_messages_name_the_argument():
    lp, old, adv, mask = _tokens([0.0, 0.1, 0.2], [1.0, 1.0, 1.0])  # (3, 1)

    def call(**over):
        kw = {"log_prob": lp, "old_log_prob": old, "advantages": adv, "response_mask": mask, **over}
        return policy_loss(
            kw.pop("log_prob"), kw.pop("old_log_prob"), kw.pop("advantages"), kw.pop("response_mask"), **kw
        )

    long = torch.zeros(3, 1, dtype=torch.long)
    cases = [
        (TypeError, dict(log_prob=[[0.0]] * 3), "log_prob must be a torch.Tensor, got list"),
        (TypeError, dict(log_prob=long), "log_prob must be a floating-point tensor, got dtype torch.int64"),
        (TypeError, dict(old_log_prob=long), "old_log_prob must be a floating-point tensor, got dtype torch.int64"),
        (TypeError, dict(advantages=long[:, 0]), "advantages must be a floating-point tensor, got dtype torch.int64"),
        (
            TypeError,
            dict(loss_mode="ppo_erc", entropies=long, old_entropies=old),
            "entropies must be a floating-point tensor, got dtype torch.int64",
        ),
        (ValueError, dict(advantages=adv[:2]), "advantages must have shape (B,) = (3,) or (B, T) = (3, 1), got (2,)"),
        (TypeError, dict(response_mask=[[1]] * 3), "response_mask must be a torch.Tensor, got list"),
        (ValueError, dict(response_mask=torch.ones(1, 3)), "response_mask must have shape (B, T) = (3, 1), got (1, 3)"),
        (
            TypeError,
            dict(response_mask=torch.ones(3, 1, dtype=torch.complex64)),
            "response_mask must be bool, integer or float, got dtype torch.complex64",
        ),
        (TypeError, dict(num_tokens=True), "num_tokens must be a number or a 1-element tensor, got a bool"),
        (TypeError, dict(num_tokens="3"), "num_tokens must be a number or a 1-element tensor, got str"),
        (
            ValueError,
            dict(num_tokens=torch.tensor([3.0, 3.0])),
            "num_tokens must be a scalar, got a tensor of shape (2,)",
        ),
        (ValueError, dict(num_tokens=math.inf), "num_tokens must be a finite number >= 0, got inf"),
        (
            ValueError,
            dict(num_seqs=3),
            "num_seqs only applies to the seq-mean loss_agg_modes, got loss_agg_mode='token-mean'",
        ),
    ]
    for error, over, message in cases:
        with pytest.raises(error, match=_exact(message)):
            call(**over)


def test_a_one_element_weight_mask_is_refused():
    with pytest.raises(ValueError, match=_exact("response_mask must contain only 0 and 1 (it is a mask, not weights)")):
        policy_loss(*_tokens([0.0], [1.0], mask=torch.tensor([[0.5]])))


def test_a_zero_divisor_for_a_batch_of_one_token_is_refused():
    lp, old, adv, _ = _tokens([0.0, 0.0], [1.0, 1.0])
    mask = torch.tensor([[1], [0]])
    msg = "num_tokens must be > 0 when the batch has unmasked tokens (this batch has 1)"
    with pytest.raises(ValueError, match=_exact(msg)):
        policy_loss(lp, old, adv, mask, num_tokens=0)
    msg = "num_seqs must be > 0 when the batch has responses with unmasked tokens (this batch has 1)"
    with pytest.raises(ValueError, match=_exact(msg)):
        policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-mean", num_seqs=torch.tensor(0))


def test_sft_loss_error_messages_name_the_argument():
    lp = torch.zeros(2, 2)
    ok = torch.ones(2, dtype=torch.bool)
    cases = [
        (
            TypeError,
            (torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), ok),
            "log_prob must be a floating-point tensor, got dtype torch.int64",
        ),
        (ValueError, (torch.zeros(3), torch.ones(3), ok), "log_prob must have shape (B, T), got (3,)"),
        (ValueError, (lp, torch.ones(2, 3), ok), "response_mask must have shape (B, T) = (2, 2), got (2, 3)"),
        (ValueError, (lp, torch.ones(2, 2), torch.ones(3)), "is_correct must have shape (B,) = (2,), got (3,)"),
        (
            ValueError,
            (lp, torch.ones(2, 2), torch.tensor([2, 0])),
            "is_correct must contain only 0 and 1 (it is a mask, not weights)",
        ),
    ]
    for error, args, message in cases:
        with pytest.raises(error, match=_exact(message)):
            sft_loss(*args)
    msg = "num_tokens must be > 0 when the batch has tokens of correct responses (this batch has 2)"
    with pytest.raises(ValueError, match=_exact(msg)):
        sft_loss(lp, torch.tensor([[1, 1], [1, 0]]), torch.tensor([True, False]), num_tokens=0)


@pytest.mark.parametrize("mode", ["ppo_erc", "gppo_erc"])
def test_an_entropy_ratio_exactly_on_an_erc_bound_is_outside_the_band(mode):
    """The band (1 - erc_low, 1 + erc_high) is open: rho exactly on a bound takes the gradient away and counts in
    erc_frac_high (rho >= 1 + erc_high) / erc_frac_low (rho <= 1 - erc_low).  The bounds are set from rho computed
    here in float64 (rho - 1 and 1 - rho are exact for rho in [0.5, 2])."""
    lp, old, adv, mask = _tokens([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])  # r = 1: inside every clip band, F = 1
    h_old = torch.ones(3, 1, dtype=F64)
    h = torch.tensor([[1.5], [0.75], [1.0]], dtype=F64)
    rho = ((h + 1e-8) / (h_old + 1e-8))[:, 0].tolist()
    erc_high, erc_low = rho[0] - 1.0, 1.0 - rho[1]
    assert (1.0 + erc_high, 1.0 - erc_low) == (rho[0], rho[1])
    loss, m = policy_loss(lp, old, adv, mask, loss_mode=mode, entropies=h, old_entropies=h_old, erc_low=erc_low,
                          erc_high=erc_high)  # fmt: skip
    loss.backward()
    assert lp.grad[:, 0].tolist() == [0.0, 0.0, -1.0 / 3]  # only rho = 1 keeps F = 1
    assert (m["erc_frac_high"].item(), m["erc_frac_low"].item()) == (1 / 3, 1 / 3)
    assert m["erc_frac"].item() == 2 / 3


def test_bf16_ratios_are_averaged_in_float32():
    """ratio_mean accumulates in float32: bf16 ratios 1 and 1 + 1/128 average to 1 + 1/256, which is no bf16 number."""
    lp, old, adv, mask = _tokens([0.0, 1.0 / 128], [1.0, 1.0], dtype=BF16)
    r = torch.exp(torch.tensor(1.0 / 128, dtype=BF16)).item()  # the bf16 ratio of the second token
    assert r == 1.0 + 1.0 / 128
    _, m = policy_loss(lp, old, adv, mask)
    assert m["ratio_mean"].item() == (1.0 + r) / 2 and m["ratio_max"].item() == r
