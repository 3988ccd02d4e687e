"""Tests for klear.rl.losses: values, GRADIENTS (the gradient table of Eq. 10, 12, 16, 18), masking,
aggregation, micro-batching, dtypes, errors, the loss-mode registry, the total loss (Eq. 14) and Entropy
Ratio Clipping (ERC, arXiv 2512.05591: ppo_erc, gppo_erc).

Expected values are written by hand or computed in float64 with a different formula
(the literal torch.min / torch.clamp expressions of the paper).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from klear.rl.losses import (
    LOSS_AGG_MODES,
    LOSS_MODES,
    LOSS_REGISTRY,
    METRIC_REDUCTIONS,
    LossInputs,
    LossMode,
    LossSettings,
    TokenLoss,
    compute_policy_loss,
    entropy_ratio,
    policy_loss,
    sft_loss,
    total_loss,
)

F64 = torch.float64
EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 10.0  # lo = 0.8, hi = 1.28

# --------------------------------------------------------------------------- gradient table
# (name, ratio r, advantage A).  Each case is one unmasked token.
CASES = [
    ("inside_pos", 1.1, 1.5),
    ("inside_neg", 0.9, -0.7),
    ("low_negA", 0.5, -1.0),  # r < 1 - eps_low, A < 0: low-side clipped branch taken
    ("low_posA", 0.5, 2.0),  # r < 1 - eps_low, A > 0: NOT clipped for PPO
    ("high_posA", 2.0, 1.0),  # r > 1 + eps_high, A > 0: high-side clipped branch taken
    ("high_negA", 2.0, -1.2),  # r > 1 + eps_high, A < 0, r < c: NOT clipped for PPO
    ("dual_cap", 20.0, -0.5),  # A < 0, r > c = 10: dual-clip cap taken
    ("zero_adv", 3.0, 0.0),  # A = 0: no gradient whatever F
]

# F per case, written out by hand from Eq. 10, 12, 16, 18 (lo = 0.8, hi = 1.28), WITH dual clip c=10.
MODE_CONFIGS = {
    "ppo_clip": dict(loss_mode="ppo_clip"),
    "gppo": dict(loss_mode="gppo"),
    "gppo_b0.5_1": dict(loss_mode="gppo", beta1=0.5, beta2=1.0),
    "gppo_b0.25_0.7": dict(loss_mode="gppo", beta1=0.25, beta2=0.7),
    "gppo_only_high": dict(loss_mode="gppo_only_high"),
    "gppo_only_high_b2_0.7": dict(loss_mode="gppo_only_high", beta2=0.7),
    "cispo": dict(loss_mode="cispo"),
    # ERC modes: with every entropy ratio inside the band their F is the base mode's (test_erc_gradient_table
    # covers the tokens outside it).
    "ppo_erc": dict(loss_mode="ppo_erc"),
    "gppo_erc": dict(loss_mode="gppo_erc"),
    "gppo_erc_b0.5_1": dict(loss_mode="gppo_erc", beta1=0.5, beta2=1.0),  # CE-GPPO + ERC
}
F_TABLE = {
    #                 inside_pos inside_neg low_negA low_posA high_posA high_negA dual_cap zero_adv
    "ppo_clip": [1.1, 0.9, 0.0, 0.5, 0.0, 2.0, 0.0, 0.0],
    "gppo": [1.1, 0.9, 0.8, 0.5, 1.28, 2.0, 0.0, 0.0],
    "gppo_b0.5_1": [1.1, 0.9, 0.4, 0.5, 1.28, 2.0, 0.0, 0.0],
    "gppo_b0.25_0.7": [1.1, 0.9, 0.2, 0.5, 0.896, 2.0, 0.0, 0.0],
    "gppo_only_high": [1.1, 0.9, 0.0, 0.5, 1.28, 2.0, 0.0, 0.0],
    "gppo_only_high_b2_0.7": [1.1, 0.9, 0.0, 0.5, 0.896, 2.0, 0.0, 0.0],
    "cispo": [1.1, 0.9, 0.8, 0.8, 1.28, 1.28, 0.0, 0.0],
    "ppo_erc": [1.1, 0.9, 0.0, 0.5, 0.0, 2.0, 0.0, 0.0],
    "gppo_erc": [1.1, 0.9, 0.8, 0.5, 1.28, 2.0, 0.0, 0.0],
    "gppo_erc_b0.5_1": [1.1, 0.9, 0.4, 0.5, 1.28, 2.0, 0.0, 0.0],
}
# Without dual clip only the dual_cap token (r = 20, A < 0) changes: unclipped branch.
F_NO_DUAL_CAP = {
    "ppo_clip": 20.0,
    "gppo": 20.0,
    "gppo_b0.5_1": 20.0,
    "gppo_b0.25_0.7": 20.0,
    "gppo_only_high": 20.0,
    "gppo_only_high_b2_0.7": 20.0,
    "cispo": 1.28,
    "ppo_erc": 20.0,
    "gppo_erc": 20.0,
    "gppo_erc_b0.5_1": 20.0,
}


def _needs_entropies(mode):
    m = LOSS_REGISTRY[mode]
    return m.needs_entropies or m.needs_old_entropies


def _ent(mode, like, seed=0, band=0.1):
    """``entropies`` / ``old_entropies`` kwargs for a mode that needs them (else {}), shaped like ``like``.

    ``H_old`` is uniform in [0.1, 2.1) nats and ``H = H_old * u`` with ``u`` uniform in ``(1 - band, 1 + band)``:
    with the default band about half the tokens are outside ERC's (0.95, 1.05); ``band=0`` gives ``rho = 1``.
    """
    if not _needs_entropies(mode):
        return {}
    g = torch.Generator().manual_seed(seed)
    old = torch.rand(like.shape, generator=g, dtype=F64) * 2 + 0.1
    u = 1 + (torch.rand(like.shape, generator=g, dtype=F64) * 2 - 1) * band
    return {"entropies": (old * u).to(like.dtype), "old_entropies": old.to(like.dtype)}


def _case_batch(dtype=F64, pad_value=-1e4):
    """One unmasked token per row (column 0) plus one padded column holding junk."""
    n = len(CASES)
    r = torch.tensor([c[1] for c in CASES], dtype=F64)
    a = torch.tensor([c[2] for c in CASES], dtype=F64)
    old = torch.full((n, 2), -1.3, dtype=F64)
    old[:, 0] = torch.linspace(-2.0, -0.2, n, dtype=F64)
    lp = old.clone()
    lp[:, 0] = old[:, 0] + torch.log(r)
    lp[:, 1] = pad_value
    mask = torch.zeros(n, 2)
    mask[:, 0] = 1
    return lp.to(dtype).requires_grad_(True), old.to(dtype), a.to(dtype), mask, r, a


@pytest.mark.parametrize("dual", [True, False], ids=["dual_c10", "no_dual"])
@pytest.mark.parametrize("config", list(MODE_CONFIGS))
def test_gradient_table(config, dual):
    lp, old, adv, mask, r, a = _case_batch()
    n = len(CASES)
    h_old = torch.full_like(lp.detach(), 0.8)
    h = h_old * torch.tensor([1.03, 0.97] * 4, dtype=F64)[:, None]  # inside ERC's band (0.95, 1.05)
    h[:, 1] = math.nan  # padded column
    ent = {"entropies": h, "old_entropies": h_old} if _needs_entropies(MODE_CONFIGS[config]["loss_mode"]) else {}
    loss, _ = policy_loss(
        lp,
        old,
        adv,
        mask,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        clip_ratio_c=C if dual else None,
        **MODE_CONFIGS[config],
        **ent,
    )
    loss.backward()
    f = torch.tensor(F_TABLE[config], dtype=F64)
    if not dual:
        f[6] = F_NO_DUAL_CAP[config]
    expected = -f * a / n
    got = lp.grad[:, 0]
    for i, (name, _, _) in enumerate(CASES):
        assert got[i].item() == pytest.approx(expected[i].item(), rel=1e-12, abs=1e-15), (config, name)
    assert torch.all(lp.grad[:, 1] == 0)  # padded column


@pytest.mark.parametrize("dual", [True, False])
def test_case_values_match_literal_formulas(dual):
    """Forward values against the literal Eq. 1 / dual clip / Eq. 15 expressions."""
    lp, old, adv, mask, r, a = _case_batch()
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    ppo_tok = -torch.minimum(r * a, r.clamp(lo, hi) * a)
    if dual:
        ppo_tok = torch.where(a < 0, torch.minimum(ppo_tok, -a * C), ppo_tok)
    for mode in ("ppo_clip", "gppo", "gppo_only_high"):
        loss, _ = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=C if dual else None)
        assert loss.item() == pytest.approx(ppo_tok.mean().item(), rel=1e-12)
    cispo_tok = -r.clamp(lo, hi) * a * lp.detach()[:, 0]
    if dual:
        cispo_tok = torch.where((a < 0) & (r > C), -a * C, cispo_tok)
    loss, _ = policy_loss(lp, old, adv, mask, loss_mode="cispo", clip_ratio_c=C if dual else None)
    assert loss.item() == pytest.approx(cispo_tok.mean().item(), rel=1e-12)


def _random_batch(seed, b=5, t=7, dtype=F64, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    lp = old + torch.randn(b, t, generator=g, dtype=F64) * spread
    adv = torch.randn(b, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.int64)
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
@pytest.mark.parametrize("c", [None, 3.0])
def test_gppo_forward_equals_ppo_clip(seed, eps, c):
    lp, old, adv, mask = _random_batch(seed, spread=1.0)
    kw = dict(clip_ratio_low=eps[0], clip_ratio_high=eps[1], clip_ratio_c=c)
    ref, _ = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", **kw)
    for mode_kw in (
        dict(loss_mode="gppo"),
        dict(loss_mode="gppo", beta1=0.25, beta2=0.7),
        dict(loss_mode="gppo_only_high"),
    ):
        for agg in LOSS_AGG_MODES:
            ref_agg, _ = policy_loss(lp, old, adv, mask, loss_mode="ppo_clip", loss_agg_mode=agg, **kw)
            val, _ = policy_loss(lp.clone().requires_grad_(True), old, adv, mask, loss_agg_mode=agg, **mode_kw, **kw)
            assert torch.equal(val.detach(), ref_agg)  # bit-identical
    # ppo_clip itself against the literal formula (float64, torch.min / torch.clamp)
    lo, hi = 1 - eps[0], 1 + eps[1]
    r = torch.exp(lp - old)
    a = adv[:, None].expand_as(r)
    tok = -torch.minimum(r * a, r.clamp(lo, hi) * a)
    if c is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -a * c), tok)
    m = mask.bool()
    assert ref.item() == pytest.approx(tok[m].sum().item() / m.sum().item(), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_gppo_gradient_matches_paper_clamp_expression(seed):
    """GPPO (beta=1) vs the paper's one-line change written literally (Eq. 11)."""
    lp, old, adv, mask = _random_batch(seed, spread=1.0)
    lo, hi = 1 - EPS_LOW, 1 + EPS_HIGH
    x = lp.clone().requires_grad_(True)
    ratio = torch.exp(x - old)
    a = adv[:, None].expand_as(ratio)
    clamped = torch.clamp(ratio, lo / ratio.detach() * ratio, hi / ratio.detach() * ratio)
    tok = -torch.minimum(ratio * a, clamped * a)
    m = mask.bool()
    (tok[m].sum() / m.sum()).backward()
    y = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(y, old, adv, mask, loss_mode="gppo")
    loss.backward()
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-14)


def test_advantages_per_token_equals_broadcast():
    lp, old, adv, mask = _random_batch(7)
    for mode in LOSS_MODES:
        ent = _ent(mode, lp)
        l1, _ = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0, **ent)
        l2, _ = policy_loss(lp, old, adv[:, None].expand_as(lp).clone(), mask, loss_mode=mode, clip_ratio_c=3.0, **ent)
        assert torch.equal(l1, l2)


# --------------------------------------------------------------------------- first update


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_ratio_one_first_update(mode):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 5, generator=g, dtype=F64) * 2
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5, -0.25], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    n = int(mask.sum())
    # ERC modes: the rollout pass's entropies equal the current ones on the first update (rho = 1)
    loss, metrics = policy_loss(lp, old, adv, mask, loss_mode=mode, clip_ratio_c=C, **_ent(mode, lp, band=0.0))
    loss.backward()
    a_tok = adv[:, None].expand(4, 5)
    m = mask.bool()
    if mode == "cispo":
        assert loss.item() == pytest.approx((-a_tok * old)[m].sum().item() / n, rel=1e-12)
    else:
        assert loss.item() == pytest.approx(-a_tok[m].sum().item() / n, rel=1e-12)
    expected = torch.where(m, -1.0 * a_tok / n, torch.zeros_like(a_tok))  # F = 1
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=1e-15)
    assert metrics["clip_frac"].item() == 0.0
    assert metrics["ppo_kl"].item() == 0.0
    assert metrics["ratio_mean"].item() == metrics["ratio_max"].item() == metrics["ratio_min"].item() == 1.0
    if _needs_entropies(mode):
        assert metrics["erc_frac"].item() == 0.0
        assert metrics["entropy_ratio_max"].item() == metrics["entropy_ratio_min"].item() == 1.0


# --------------------------------------------------------------------------- aggregation


def test_seq_mean_modes_hand_case():
    # ratio = 1 so per-token loss = -A (ppo_clip / gppo); per-token advantages.
    old = torch.zeros(3, 3, dtype=F64)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # 3rd response fully masked
    expected = {
        # (value, gradient wrt log_prob of the unmasked tokens)
        "token-mean": (-(1 + 2 + 3 + 4) / 4, [[-1 / 4, -2 / 4, -3 / 4], [-4 / 4]]),
        "seq-mean-token-mean": (-(6 / 3 + 4 / 1) / 2, [[-1 / 6, -2 / 6, -3 / 6], [-4 / 2]]),
        "seq-mean-token-sum": (-(6 + 4) / 2, [[-1 / 2, -2 / 2, -3 / 2], [-4 / 2]]),
    }
    for agg, (value, grads) in expected.items():
        for mode in ("ppo_clip", "gppo"):
            lp = old.clone().requires_grad_(True)
            loss, _ = policy_loss(lp, old, adv, mask, loss_mode=mode, loss_agg_mode=agg)
            loss.backward()
            assert loss.item() == pytest.approx(value, rel=1e-12), agg
            assert lp.grad[0].tolist() == pytest.approx(grads[0], rel=1e-12)
            assert lp.grad[1, 0].item() == pytest.approx(grads[1][0], rel=1e-12)
            assert lp.grad[1, 1:].abs().sum() == 0 and lp.grad[2].abs().sum() == 0


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_token_mean_microbatch_split_with_num_tokens(mode):
    lp, old, adv, mask = _random_batch(11, b=6, t=9, spread=0.8)
    mask[2] = 0  # one fully masked row
    mask[4, 1:] = 0
    total_tokens = int(mask.sum())
    kw = dict(loss_mode=mode, clip_ratio_c=3.0)
    ent = _ent(mode, lp, seed=2)

    def part(sl):
        return {k: v[sl] for k, v in ent.items()}

    full_lp = lp.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, old, adv, mask, **kw, **ent)
    full.backward()

    acc_lp = lp.clone().requires_grad_(True)
    naive_lp = lp.clone().requires_grad_(True)
    micro_sum = 0.0
    naive_sum = 0.0
    slices = (slice(0, 2), slice(2, 4), slice(4, 6))
    for sl in slices:
        micro, _ = policy_loss(acc_lp[sl], old[sl], adv[sl], mask[sl], num_tokens=total_tokens, **kw, **part(sl))
        micro.backward()  # gradient accumulation
        micro_sum += micro.item()
        naive, _ = policy_loss(naive_lp[sl], old[sl], adv[sl], mask[sl], **kw, **part(sl))
        (naive / len(slices)).backward()  # average of per-micro-batch means
        naive_sum += naive.item() / len(slices)
    assert micro_sum == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(acc_lp.grad, full_lp.grad, rtol=1e-12, atol=1e-15)
    # The fault num_tokens guards against: per-micro-batch means weight tokens by
    # N / (3 * n_micro) instead of 1 (token counts 15, 1 and 10 here, N = 26).
    counts = [int(mask[sl].sum()) for sl in slices]
    assert len(set(counts)) > 1
    for sl, n_micro in zip(slices, counts):
        torch.testing.assert_close(
            naive_lp.grad[sl], full_lp.grad[sl] * total_tokens / (3 * n_micro), rtol=1e-10, atol=1e-15
        )
    assert naive_sum != pytest.approx(full.item(), rel=1e-6)

    # num_tokens as a tensor (e.g. an all-reduced count) works the same
    l_t, _ = policy_loss(lp, old, adv, mask, num_tokens=torch.tensor(float(total_tokens)), **kw, **ent)
    assert l_t.item() == pytest.approx(full.item(), rel=1e-12)


def test_zero_unmasked_tokens():
    old = torch.randn(3, 4)
    lp_data = torch.randn(3, 4)
    lp_data[0, 0] = float("nan")  # junk at a masked position
    lp = lp_data.requires_grad_(True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for mode in LOSS_MODES:
        for agg in LOSS_AGG_MODES:
            lp.grad = None
            loss, metrics = policy_loss(
                lp, old, torch.randn(3), mask, loss_mode=mode, loss_agg_mode=agg, clip_ratio_c=3.0, **_ent(mode, lp)
            )
            assert loss.item() == 0.0 and loss.requires_grad
            loss.backward()
            assert torch.all(lp.grad == 0)
            assert all(math.isfinite(v.item()) for v in metrics.values())
    loss, _ = policy_loss(lp, old, torch.randn(3), mask, num_tokens=0)
    assert loss.item() == 0.0


# --------------------------------------------------------------------------- NaN safety


@pytest.mark.parametrize("bad", [-1e4, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_masked_junk_does_not_poison(bad, mode, agg):
    lp, old, adv, mask = _random_batch(5, b=4, t=6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    adv_tok = adv[:, None].expand_as(lp).clone()

    ent0 = _ent(mode, lp, seed=4)

    def run(lp_val, old_val, adv_val):
        x = lp.clone()
        o = old.clone()
        a = adv_tok.clone()
        ent = {k: v.clone() for k, v in ent0.items()}
        x[1, 5] = lp_val
        o[1, 5] = old_val
        x[3, 3] = lp_val
        a[3, 3] = adv_val
        for v in ent.values():  # the entropies' masked positions hold junk too
            v[1, 5] = old_val
            v[3, 3] = adv_val
        x.requires_grad_(True)
        loss, metrics = policy_loss(x, o, a, mask, loss_mode=mode, loss_agg_mode=agg, clip_ratio_c=3.0, **ent)
        loss.backward()
        return loss, x.grad, metrics

    clean_loss, clean_grad, clean_metrics = run(0.0, 0.0, 0.0)
    for old_val, adv_val in ((0.0, 0.0), (bad, bad)):
        loss, grad, metrics = run(bad, old_val, adv_val)
        assert torch.isfinite(loss) and torch.all(torch.isfinite(grad))
        assert loss.item() == clean_loss.item()
        assert torch.equal(grad, clean_grad)
        for k in clean_metrics:
            assert metrics[k].item() == clean_metrics[k].item(), k


def test_extreme_unmasked_log_ratio_is_finite():
    """log-ratio clamped to [-20, 20] before exp: huge ratios give finite values."""
    old = torch.zeros(1, 2)
    lp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    for mode in LOSS_MODES:
        loss, m = policy_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 2), loss_mode=mode, **_ent(mode, lp))
        loss.backward()
        assert torch.isfinite(loss) and torch.all(torch.isfinite(lp.grad))
        assert m["ratio_max"].item() == pytest.approx(math.exp(20), rel=1e-5)
        lp.grad = None


# --------------------------------------------------------------------------- metrics


def _clip_category_tokens():
    """Seven tokens, one per clip category (ratio r, advantage a, old and new log-probs, mask):
    r=2,A<0 (not high) | r=.5,A>0 (not low) | high | low | inside | dual | MASKED."""
    r = torch.tensor([2.0, 0.5, 2.0, 0.5, 1.0, 20.0, 1.1], dtype=F64)
    a = torch.tensor([-1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 99.0], dtype=F64)
    old = torch.full((7, 1), -1.0, dtype=F64)
    lp = old + torch.log(r)[:, None]
    mask = torch.tensor([[1], [1], [1], [1], [1], [1], [0]])
    return r, a, old, lp, mask


def test_clip_fractions_only_count_taken_branch():
    r, a, old, lp, mask = _clip_category_tokens()
    for mode in ("ppo_clip", "gppo", "gppo_only_high"):
        _, m = policy_loss(lp, old, a, mask, loss_mode=mode, clip_ratio_c=C)
        assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
        assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
        assert m["clip_frac"].item() == pytest.approx(2 / 6)
        assert m["dual_clip_frac"].item() == pytest.approx(1 / 6)
    _, m = policy_loss(lp, old, a, mask, loss_mode="cispo", clip_ratio_c=C)
    # cispo: the ratio weight is clipped whatever the sign of A; dual-capped token excluded
    assert m["clip_frac_high"].item() == pytest.approx(2 / 6)
    assert m["clip_frac_low"].item() == pytest.approx(2 / 6)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 6)
    # without dual clip the r=20 A<0 token is not clipped at all for PPO
    _, m = policy_loss(lp, old, a, mask, loss_mode="ppo_clip")
    assert m["dual_clip_frac"].item() == 0.0 and m["clip_frac"].item() == pytest.approx(2 / 6)
    # ratio stats and approx KL over unmasked tokens only
    rr = r[:6]
    assert m["ratio_mean"].item() == pytest.approx(rr.mean().item(), rel=1e-12)
    assert m["ratio_max"].item() == pytest.approx(20.0, rel=1e-12)
    assert m["ratio_min"].item() == pytest.approx(0.5, rel=1e-12)
    assert m["ppo_kl"].item() == pytest.approx(-torch.log(rr).mean().item(), rel=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


# --------------------------------------------------------------------------- dtypes


def _clear_of_erc_bounds(ent: dict, margin: float = 0.02) -> dict:
    """``ent`` with every token whose ``rho = H / H_old`` lies within ``margin`` of ERC's bounds (0.95, 1.05) moved
    to ``rho = 1`` (``H = H_old``): a rounded ``rho`` then takes the same side of the band as the exact one."""
    if not ent:
        return ent
    h, h_old = ent["entropies"], ent["old_entropies"]
    rho = h.double() / h_old.double()
    near = ((rho - 1.05).abs() < margin) | ((rho - 0.95).abs() < margin)
    return {"entropies": torch.where(near, h_old, h), "old_entropies": h_old}


# Error bound of the loss and of each gradient element computed in ``dtype``, against float64 on the same rounded
# inputs, in units of the dtype's unit roundoff u = 2^-(mantissa bits + 1) (bf16: 2^-8 = 0.39%; float32: 2^-24).
# A token's gradient is a product of a few rounded factors (the ratio exp(lp - old), A, 1/N), each off by about u:
# measured at most 2.9 u per element and 1.7 u on the loss (bf16 and float32 alike) over 20 random batches, the
# batch below being the worst (2.8 u, i.e. 1.1% in bf16). 8 u (bf16: 3.1%) is about 3 times that, so rounding
# differences across CPUs pass while a gradient off by 1.5x, a dropped term or a wrong divisor fails.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", LOSS_MODES)
def test_dtypes(dtype, mode):
    lp, old, adv, mask = _random_batch(1, b=4, t=8, spread=0.3)
    # inputs rounded to dtype for both runs, so the only difference is the arithmetic in dtype; entropies away from
    # ERC's band edges and ratios away from the clip bounds, so both runs take the same branches
    lp, old, adv = (v.to(dtype).double() for v in (lp, old, adv))
    ent = _clear_of_erc_bounds({k: v.to(dtype) for k, v in _ent(mode, lp, seed=6).items()})
    ratio = torch.exp(lp - old)[mask.bool()]
    assert all(((ratio - b).abs() / b).min() > 0.02 for b in (0.8, 1.28, 3.0))
    ref_lp = lp.clone().requires_grad_(True)
    ref, _ = policy_loss(
        ref_lp, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0, **{k: v.double() for k, v in ent.items()}
    )
    ref.backward()
    x = lp.to(dtype).requires_grad_(True)
    loss, metrics = policy_loss(x, old.to(dtype), adv.to(dtype), mask, loss_mode=mode, clip_ratio_c=3.0, **ent)
    loss.backward()
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    assert x.grad.dtype == dtype
    bound = 8 * UNIT_ROUNDOFF[dtype]
    assert loss.item() == pytest.approx(ref.item(), rel=bound, abs=0)
    # relative per element; a zero gradient (masked, clipped or outside ERC's band) must be exactly zero
    torch.testing.assert_close(x.grad.double(), ref_lp.grad, rtol=bound, atol=0)
    assert int((ref_lp.grad != 0).sum()) >= 5  # enough tokens carry a gradient for the check to mean something


# --------------------------------------------------------------------------- errors


def test_policy_loss_errors():
    lp, old, adv, mask = _random_batch(0, b=2, t=3)
    ok = dict(log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask)

    def call(**over):
        kw = {**ok, **over}
        return policy_loss(
            kw.pop("log_prob"), kw.pop("old_log_prob"), kw.pop("advantages"), kw.pop("response_mask"), **kw
        )

    def refuses(match, **over):
        with pytest.raises(ValueError, match=match):
            call(**over)

    refuses(r"old_log_prob.*\(2, 3\).*\(2, 4\)", old_log_prob=torch.zeros(2, 4, dtype=F64))
    refuses(r"advantages.*\(3,\)", advantages=torch.zeros(3, dtype=F64))
    refuses(r"response_mask.*\(2, 3\).*\(3, 2\)", response_mask=torch.ones(3, 2))
    refuses(
        r"log_prob must have shape \(B, T\)",
        log_prob=lp.flatten(),
        old_log_prob=old.flatten(),
        response_mask=mask.flatten(),
    )
    refuses("0 and 1", response_mask=mask * 0.5)
    refuses("ppo_clip, gppo, gppo_only_high, cispo", loss_mode="grpo")
    refuses("token-mean, seq-mean-token-mean, seq-mean-token-sum", loss_agg_mode="seq-mean")
    for bad_c in (1.0, 0.5):
        refuses("clip_ratio_c", clip_ratio_c=bad_c)
    refuses("clip_ratio_low", clip_ratio_low=-0.1)
    refuses("clip_ratio_high", clip_ratio_high=-0.1)
    refuses("clip_ratio_low", clip_ratio_low=1.0)
    refuses("beta1", beta1=-0.5)
    refuses("beta1", loss_mode="ppo_clip", beta1=0.5)
    refuses("beta2", loss_mode="cispo", beta2=0.5)
    refuses("num_tokens", num_tokens=0)
    refuses("num_tokens", num_tokens=-3)
    refuses("num_tokens only applies", loss_agg_mode="seq-mean-token-mean", num_tokens=100)
    with pytest.raises(TypeError, match="log_prob must be a floating-point tensor"):
        call(log_prob=torch.zeros(2, 3, dtype=torch.long))


# --------------------------------------------------------------------------- SFT loss


def test_sft_loss_hand_value_and_grad():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0, -8.0, -9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    correct = torch.tensor([True, False, True])
    loss = sft_loss(lp, mask, correct)
    assert loss.item() == pytest.approx((1 + 2 + 7 + 8 + 9) / 5, rel=1e-12)
    loss.backward()
    expected = torch.tensor([[-1, -1, 0], [0, 0, 0], [-1, -1, -1]], dtype=F64) / 5
    torch.testing.assert_close(lp.grad, expected, rtol=0, atol=1e-15)


def test_sft_loss_microbatch_split():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 5, generator=g, dtype=F64) * 4
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    )
    correct = torch.tensor([True, False, True, True, False, True])
    n = int((mask.bool() & correct[:, None]).sum())
    full_x = lp.clone().requires_grad_(True)
    full = sft_loss(full_x, mask, correct)
    full.backward()
    acc_x = lp.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part = sft_loss(acc_x[sl], mask[sl], correct[sl], num_tokens=n)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(acc_x.grad, full_x.grad, rtol=1e-12, atol=1e-15)
    # a micro-batch with no correct response contributes exactly 0
    assert sft_loss(lp[1:2], mask[1:2], correct[1:2], num_tokens=n).item() == 0.0


def test_sft_loss_no_correct_is_zero_with_graph():
    lp = torch.randn(3, 4).requires_grad_(True)
    loss = sft_loss(lp, torch.ones(3, 4), torch.zeros(3, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(3, 4))


def test_sft_loss_masked_junk_and_errors():
    lp = torch.tensor([[-1.0, float("-inf")], [float("nan"), -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    loss = sft_loss(lp, mask, torch.tensor([True, True]))
    loss.backward()
    assert loss.item() == pytest.approx(1.5)
    assert torch.equal(lp.grad, torch.tensor([[-0.5, 0.0], [0.0, -0.5]]))
    with pytest.raises(ValueError, match=r"is_correct.*\(2,\).*\(3,\)"):
        sft_loss(lp, mask, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"response_mask"):
        sft_loss(lp, torch.ones(2, 3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_tokens"):
        sft_loss(lp, mask, torch.tensor([True, True]), num_tokens=0)
    # a divisor below this batch's count is legal (data-parallel: whole-step count / workers)
    half = sft_loss(lp.detach().requires_grad_(), mask, torch.tensor([True, True]), num_tokens=1)
    assert half.item() == pytest.approx(3.0)


# --------------------------------------------------------------------------- registry and settings


def test_every_registered_mode_has_a_gradient_table_row():
    """A new loss mode must add its row to F_TABLE / MODE_CONFIGS (the gradient-table test)."""
    assert set(LOSS_REGISTRY) == set(LOSS_MODES) == {cfg["loss_mode"] for cfg in MODE_CONFIGS.values()}
    assert set(MODE_CONFIGS) == set(F_TABLE) == set(F_NO_DUAL_CAP)
    assert all(name == mode.name for name, mode in LOSS_REGISTRY.items())


# Settings the loss rejects, with a piece of the expected message (GPPOConfig must reject the same ones:
# tests/test_trainer.py).
BAD_SETTINGS = [
    (dict(loss_mode="grpo"), "valid modes: ppo_clip, gppo, gppo_only_high, cispo"),
    (dict(loss_mode=["gppo"]), "unknown loss_mode"),
    (dict(loss_agg_mode="sum"), "valid modes: token-mean, seq-mean-token-mean, seq-mean-token-sum"),
    (dict(clip_ratio_low=1.0), "clip_ratio_low must be < 1.0, got 1.0"),
    (dict(clip_ratio_low=1.5), "clip_ratio_low must be < 1.0"),
    (dict(clip_ratio_low=-0.1), "clip_ratio_low must be >= 0.0"),
    (dict(clip_ratio_low=math.nan), "clip_ratio_low must be finite"),
    (dict(clip_ratio_high=-0.1), "clip_ratio_high must be >= 0.0"),
    (dict(clip_ratio_high=math.inf), "clip_ratio_high must be finite"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c must be > 1.0, got 1.0"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c must be > 1.0"),
    (dict(clip_ratio_c=math.nan), "clip_ratio_c must be finite"),
    (dict(beta1=-0.5), "beta1 must be >= 0.0"),
    (dict(beta2=math.inf), "beta2 must be finite"),
    (
        dict(loss_mode="ppo_clip", beta1=0.5),
        "beta1 is only used by loss_mode 'gppo', 'gppo_erc'; got beta1=0.5 with loss_mode='ppo_clip'",
    ),
    (dict(loss_mode="gppo_only_high", beta1=0.5), "beta1 is only used by loss_mode 'gppo'"),
    (dict(loss_mode="cispo", beta2=0.5), "beta2 is only used by loss_mode 'gppo', 'gppo_only_high'"),
    (dict(loss_mode="ppo_clip", beta2=0.7), "beta2 is only used by loss_mode 'gppo', 'gppo_only_high'"),
    (dict(loss_mode="ppo_erc", beta1=0.5), "beta1 is only used by loss_mode 'gppo', 'gppo_erc'"),
    (dict(loss_mode="gppo_erc", erc_low=0.0), "erc_low must be > 0.0, got 0.0"),
    (dict(loss_mode="gppo_erc", erc_low=1.0), "erc_low must be < 1.0, got 1.0"),
    (dict(loss_mode="ppo_erc", erc_high=0.0), "erc_high must be > 0.0, got 0.0"),
    (dict(loss_mode="ppo_erc", erc_high=-0.1), "erc_high must be > 0.0"),
    (dict(loss_mode="gppo_erc", erc_high=math.nan), "erc_high must be finite"),
    (
        dict(loss_mode="gppo", erc_low=0.1),
        "erc_low is only used by loss_mode 'ppo_erc', 'gppo_erc'; got erc_low=0.1 with loss_mode='gppo'",
    ),
    (dict(loss_mode="cispo", erc_high=0.2), "erc_high is only used by loss_mode 'ppo_erc', 'gppo_erc'"),
]


@pytest.mark.parametrize("settings, message", BAD_SETTINGS, ids=[str(s) for s, _ in BAD_SETTINGS])
def test_policy_loss_and_loss_settings_reject_the_same_settings(settings, message):
    lp, old, adv, mask = _random_batch(0, b=2, t=3)
    with pytest.raises(ValueError, match=re.escape(message)) as from_loss:
        policy_loss(lp, old, adv, mask, **settings)
    with pytest.raises(ValueError, match=re.escape(message)) as from_settings:
        LossSettings(**settings)
    assert str(from_settings.value) == str(from_loss.value)


def test_loss_settings_reject_bad_alpha():
    for alpha, message in (
        (-0.1, "alpha must be >= 0.0"),
        (math.nan, "alpha must be finite"),
        (math.inf, "alpha must be finite"),
    ):
        with pytest.raises(ValueError, match=message):
            LossSettings(alpha=alpha)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        LossSettings(alpha=True)


def test_loss_settings_store_floats_and_accept_mode_specific_values():
    s = LossSettings(loss_mode="gppo", clip_ratio_low=0, clip_ratio_high=1, clip_ratio_c=3, beta1=0, beta2=2, alpha=0)
    assert [type(v) for v in (s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, s.beta1, s.beta2, s.alpha)] == [
        float
    ] * 6
    assert s.mode is LOSS_REGISTRY["gppo"]
    assert LossSettings(loss_mode="gppo_only_high", beta2=0.7).beta2 == 0.7
    with pytest.raises(AttributeError, match="cannot assign to field 'alpha'"):
        s.alpha = 1.0  # frozen: a LossSettings is always a validated one


def test_metric_reductions_name_real_metrics():
    lp, old, adv, mask = _random_batch(1)
    _, metrics = policy_loss(lp, old, adv, mask, loss_mode="gppo_erc", **_ent("gppo_erc", lp))
    assert set(METRIC_REDUCTIONS) <= set(metrics)
    assert set(METRIC_REDUCTIONS.values()) <= {"max", "min"}


# --------------------------------------------------------------------------- seq-mean divisor (num_seqs)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("mode", LOSS_MODES)
def test_seq_mean_microbatch_split_with_num_seqs(mode, agg):
    lp, old, adv, mask = _random_batch(13, b=6, t=9, spread=0.8)
    mask[1] = 0  # a fully masked response: not counted
    kw = dict(loss_mode=mode, loss_agg_mode=agg, clip_ratio_c=3.0)
    ent = _ent(mode, lp, seed=3)
    full_lp = lp.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, old, adv, mask, **kw, **ent)
    full.backward()
    n_seqs = int((mask.sum(dim=1) > 0).sum())
    assert n_seqs == 5
    acc_lp = lp.clone().requires_grad_(True)
    naive_sum = 0.0
    micro_sum = 0.0
    for sl in (slice(0, 2), slice(2, 6)):  # 1 and 4 responses with tokens
        part = {k: v[sl] for k, v in ent.items()}
        micro, _ = policy_loss(acc_lp[sl], old[sl], adv[sl], mask[sl], num_seqs=n_seqs, **kw, **part)
        micro.backward()
        micro_sum += micro.item()
        naive, _ = policy_loss(lp[sl], old[sl], adv[sl], mask[sl], **kw, **part)
        naive_sum += naive.item() / 2
    assert micro_sum == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(acc_lp.grad, full_lp.grad, rtol=1e-12, atol=1e-15)
    assert naive_sum != pytest.approx(full.item(), rel=1e-6)  # what num_seqs guards against


def test_num_seqs_errors():
    lp, old, adv, mask = _random_batch(0, b=2, t=3)
    with pytest.raises(ValueError, match="num_seqs only applies to the seq-mean"):
        policy_loss(lp, old, adv, mask, num_seqs=2)
    with pytest.raises(ValueError, match=r"num_seqs must be > 0 when the batch has responses"):
        policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", num_seqs=0)
    with pytest.raises(ValueError, match="num_seqs must be a finite number >= 0"):
        policy_loss(lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", num_seqs=-1)


def test_loss_inputs_counts_are_used_by_their_aggregation_only():
    """LossInputs carries all the step's counts; each aggregation divides by its own."""
    lp, old, adv, mask = _random_batch(4, b=4, t=5)
    n_tok, n_seq = int(mask.sum()), int((mask.sum(dim=1) > 0).sum())
    for agg, count in (("token-mean", 2 * n_tok), ("seq-mean-token-sum", 2 * n_seq)):
        kw = {"num_tokens": count} if agg == "token-mean" else {"num_seqs": count}
        ref, _ = policy_loss(lp, old, adv, mask, loss_agg_mode=agg, **kw)
        got, _ = compute_policy_loss(
            LossInputs(lp, old, adv, mask, num_tokens=2 * n_tok, num_seqs=2 * n_seq), LossSettings(loss_agg_mode=agg)
        )
        assert torch.equal(got, ref)
        own, _ = policy_loss(lp, old, adv, mask, loss_agg_mode=agg)
        assert got.item() == pytest.approx(own.item() / 2, rel=1e-12)


# --------------------------------------------------------------------------- total loss (Eq. 14)


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_total_loss_is_policy_plus_alpha_sft(mode):
    lp, old, adv, mask = _random_batch(21, b=5, t=6, spread=0.7)
    correct = torch.tensor([True, False, True, True, False])
    n_tok, n_sft = 40, 17  # the whole optimizer step's counts (this batch is part of it)
    ent = _ent(mode, lp, seed=5)
    x = lp.clone().requires_grad_(True)
    loss, metrics = total_loss(
        LossInputs(x, old, adv, mask, is_correct=correct, num_tokens=n_tok, num_sft_tokens=n_sft, **ent),
        LossSettings(loss_mode=mode, clip_ratio_c=3.0, alpha=0.3),
    )
    loss.backward()
    # Reference: policy_loss plus the SFT term written out by hand (Eq. 13), in float64.
    y = lp.clone().requires_grad_(True)
    pg, pg_metrics = policy_loss(y, old, adv, mask, loss_mode=mode, clip_ratio_c=3.0, num_tokens=n_tok, **ent)
    sel = mask.bool() & correct[:, None]
    lm = -(y[sel]).sum() / n_sft
    (pg + 0.3 * lm).backward()
    assert loss.item() == pytest.approx(pg.item() + 0.3 * lm.item(), rel=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    assert metrics["policy_loss"].item() == pytest.approx(pg.item(), rel=1e-12)
    assert metrics["sft_loss"].item() == pytest.approx(lm.item(), rel=1e-12)
    assert {k: v.item() for k, v in metrics.items() if k in pg_metrics} == {k: v.item() for k, v in pg_metrics.items()}
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_total_loss_alpha_zero_and_missing_is_correct():
    lp, old, adv, mask = _random_batch(3)
    x = lp.clone().requires_grad_(True)
    loss, metrics = total_loss(LossInputs(x, old, adv, mask), LossSettings(alpha=0.0))
    ref, _ = policy_loss(lp, old, adv, mask)
    assert torch.equal(loss.detach(), ref)
    assert metrics["sft_loss"].item() == 0.0 and metrics["sft_loss"].dtype == loss.dtype
    with pytest.raises(ValueError, match=r"alpha=0.1 needs is_correct \(B,\)"):
        total_loss(LossInputs(x, old, adv, mask), LossSettings(alpha=0.1))


# --------------------------------------------------------------------------- entropy slot of the registry


def _entropy_weighted(t, s):
    """A test-only mode that reads both entropy slots: per-token loss ``-r * A * (H - H_old)``."""
    return TokenLoss(
        -t.ratio * t.adv * (t.entropies - t.old_entropies), torch.zeros_like(t.mask), torch.zeros_like(t.mask)
    )


def test_a_registered_mode_gets_the_entropies(monkeypatch):
    monkeypatch.setitem(
        LOSS_REGISTRY, "probe", LossMode("probe", _entropy_weighted, needs_entropies=True, needs_old_entropies=True)
    )
    lp, old, adv, mask = _random_batch(8, b=4, t=6)
    g = torch.Generator().manual_seed(1)
    ent = (torch.rand(4, 6, generator=g, dtype=F64) * 2).requires_grad_(True)  # a constant for the loss
    old_ent = torch.rand(4, 6, generator=g, dtype=F64) * 2
    ent_junk = ent.detach().clone()
    ent_junk[~mask.bool()] = math.nan  # masked positions are ignored
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, loss_mode="probe", entropies=ent, old_entropies=old_ent)
    loss.backward()
    m = mask.bool()
    r = torch.exp(lp - old)
    a = adv[:, None].expand_as(r)
    w = ent.detach() - old_ent
    assert loss.item() == pytest.approx((-r * a * w)[m].sum().item() / m.sum().item(), rel=1e-12)
    torch.testing.assert_close(x.grad, torch.where(m, -r * a * w / m.sum(), 0.0), rtol=1e-12, atol=1e-15)
    assert ent.grad is None  # entropies are used as constants
    junk, _ = policy_loss(lp, old, adv, mask, loss_mode="probe", entropies=ent_junk, old_entropies=old_ent)
    assert junk.item() == loss.item()
    assert metrics["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match=r"loss_mode='probe' needs entropies \(B, T\); got None"):
        policy_loss(lp, old, adv, mask, loss_mode="probe", old_entropies=old_ent)
    with pytest.raises(ValueError, match=r"loss_mode='probe' needs old_entropies"):
        policy_loss(lp, old, adv, mask, loss_mode="probe", entropies=ent)
    with pytest.raises(ValueError, match=r"entropies must have the shape of log_prob \(B, T\) = \(4, 6\)"):
        policy_loss(lp, old, adv, mask, loss_mode="probe", entropies=ent[:, :5], old_entropies=old_ent)
    with pytest.raises(ValueError, match="beta1 is only used by loss_mode 'gppo'"):
        LossSettings(loss_mode="probe", beta1=0.5)
    # modes that do not read them accept (and ignore) entropies
    plain, _ = policy_loss(lp, old, adv, mask, entropies=ent_junk)
    assert torch.equal(plain, policy_loss(lp, old, adv, mask)[0])


# --------------------------------------------------------------------------- Entropy Ratio Clipping (ERC)

ERC_CONFIGS = [name for name, cfg in MODE_CONFIGS.items() if _needs_entropies(cfg["loss_mode"])]
ERC_BASE = {"ppo_erc": "ppo_clip", "gppo_erc": "gppo"}  # the mode ERC is added to
# (H / H_old, inside ERC's open band (0.95, 1.05)?): the H_old = 1 column below, so rho = (H + 1e-8) / (1 + 1e-8)
RHO_CASES = [
    (0.5, False),
    (0.95 * (1 - 1e-7), False),
    (0.95 * (1 + 1e-7), True),
    (0.97, True),
    (1.0, True),
    (1.04, True),
    (1.05 * (1 - 1e-7), True),
    (1.05 * (1 + 1e-7), False),
    (3.0, False),
]


def _erc_base_kwargs(config):
    cfg = dict(MODE_CONFIGS[config])
    return {**cfg, "loss_mode": ERC_BASE[cfg["loss_mode"]]}


def kw_base(kw):
    """The settings of an ERC test without the ERC ones (the base mode must keep their defaults)."""
    return {k: v for k, v in kw.items() if not k.startswith("erc_")}


@pytest.mark.parametrize("dual", [True, False], ids=["dual_c10", "no_dual"])
@pytest.mark.parametrize("rho, inside", RHO_CASES, ids=[f"rho{r:.9g}" for r, _ in RHO_CASES])
@pytest.mark.parametrize("config", ERC_CONFIGS)
def test_erc_gradient_table(config, rho, inside, dual):
    """Every clip case x inside/outside the entropy band: F is the table's F inside the band and 0 outside; the
    value is the base mode's (bit-equal) and the divisor is all unmasked tokens, masked-by-ERC ones included."""
    lp, old, adv, mask, r, a = _case_batch()
    n = len(CASES)
    h_old = torch.ones_like(old)
    h = torch.full_like(old, rho)
    h[:, 1] = math.nan  # padded column
    kw = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=C if dual else None)
    loss, metrics = policy_loss(lp, old, adv, mask, entropies=h, old_entropies=h_old, **MODE_CONFIGS[config], **kw)
    loss.backward()
    f = torch.tensor(F_TABLE[config], dtype=F64)
    if not dual:
        f[6] = F_NO_DUAL_CAP[config]
    expected = -f * a / n if inside else torch.zeros(n, dtype=F64)  # divisor n whatever ERC masks
    for i, (name, _, _) in enumerate(CASES):
        assert lp.grad[i, 0].item() == pytest.approx(expected[i].item(), rel=1e-12, abs=1e-15), (config, name)
    assert torch.all(lp.grad[:, 1] == 0)
    base, _ = policy_loss(lp.detach(), old, adv, mask, **_erc_base_kwargs(config), **kw)
    assert torch.equal(loss.detach(), base)  # ERC never changes the value
    assert metrics["erc_frac"].item() == (0.0 if inside else 1.0)
    assert metrics["erc_frac_high"].item() == (1.0 if not inside and rho > 1 else 0.0)
    assert metrics["erc_frac_low"].item() == (1.0 if not inside and rho < 1 else 0.0)
    expected_rho = (rho + 1e-8) / (1 + 1e-8)
    for key in ("entropy_ratio_mean", "entropy_ratio_max", "entropy_ratio_min"):
        assert metrics[key].item() == pytest.approx(expected_rho, rel=1e-14)


@pytest.mark.parametrize("config", ERC_CONFIGS)
def test_erc_per_token_mask_in_one_batch(config):
    """Each token's own rho decides: a mixed batch, F written by hand per token, token-mean over all 8 tokens."""
    lp, old, adv, mask, r, a = _case_batch()
    n = len(CASES)
    rho = torch.tensor([1.2, 1.01, 0.9, 0.99, 0.5, 1.0, 2.0, 0.96], dtype=F64)  # out/in per token
    inside = torch.tensor([False, True, False, True, False, True, False, True])
    h_old = torch.full_like(old, 0.7)
    h = h_old * rho[:, None]
    loss, metrics = policy_loss(
        lp,
        old,
        adv,
        mask,
        entropies=h,
        old_entropies=h_old,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        clip_ratio_c=C,
        **MODE_CONFIGS[config],
    )
    loss.backward()
    f = torch.tensor(F_TABLE[config], dtype=F64) * inside
    torch.testing.assert_close(lp.grad[:, 0], -f * a / n, rtol=1e-12, atol=1e-15)
    assert metrics["erc_frac_high"].item() == pytest.approx(2 / 8)
    assert metrics["erc_frac_low"].item() == pytest.approx(2 / 8)
    assert metrics["erc_frac"].item() == pytest.approx(4 / 8)
    rho_eps = (0.7 * rho + 1e-8) / (0.7 + 1e-8)  # the 1e-8 moves rho by ~1e-8 here
    assert metrics["entropy_ratio_max"].item() == pytest.approx(rho_eps.max().item(), rel=1e-14)
    assert metrics["entropy_ratio_min"].item() == pytest.approx(rho_eps.min().item(), rel=1e-14)
    assert metrics["entropy_ratio_mean"].item() == pytest.approx(rho_eps.mean().item(), rel=1e-14)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", ERC_CONFIGS)
def test_erc_is_the_base_loss_with_a_gradient_mask(config, seed, agg):
    """Random batch, every aggregation: the value is bit-equal to the base mode's, the gradient is the base mode's
    on the kept tokens (so every divisor is unchanged) and 0 on the others; the kept set is computed here in float64
    from the authors' formula."""
    lp, old, adv, mask = _random_batch(seed, b=6, t=9, spread=0.8)
    ent = _ent("gppo_erc", lp, seed=seed, band=0.12)
    kw = dict(clip_ratio_c=3.0, loss_agg_mode=agg, erc_low=0.05, erc_high=0.08)
    x = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, old, adv, mask, **MODE_CONFIGS[config], **ent, **kw)
    loss.backward()
    y = lp.clone().requires_grad_(True)
    base, base_metrics = policy_loss(y, old, adv, mask, **_erc_base_kwargs(config), **kw_base(kw))
    base.backward()
    m = mask.bool()
    rho = (ent["entropies"] + 1e-8) / (ent["old_entropies"] + 1e-8)
    kept = m & (rho > 0.95) & (rho < 1.08)
    assert 0 < int(kept.sum()) < int(m.sum())  # both kinds present
    assert torch.equal(loss.detach(), base.detach())
    assert torch.equal(x.grad, torch.where(kept, y.grad, 0.0))
    assert bool((y.grad[m & ~kept] != 0).any())  # ERC did take some gradient away
    n = int(m.sum())
    assert metrics["erc_frac_high"].item() == pytest.approx(int((m & (rho >= 1.08)).sum()) / n, rel=1e-12)
    assert metrics["erc_frac_low"].item() == pytest.approx(int((m & (rho <= 0.95)).sum()) / n, rel=1e-12)
    assert metrics["erc_frac"].item() == pytest.approx(1 - int(kept.sum()) / n, rel=1e-12)
    assert metrics["entropy_ratio_mean"].item() == pytest.approx(rho[m].mean().item(), rel=1e-12)
    assert metrics["entropy_ratio_max"].item() == rho[m].max().item()
    assert metrics["entropy_ratio_min"].item() == rho[m].min().item()
    for key, value in base_metrics.items():  # the shared metrics are the base mode's
        if key != "clip_grad_share":  # a gradient metric: ERC takes gradient away (checked below)
            assert metrics[key].item() == value.item(), key
    assert metrics["clip_grad_share"].item() <= 1.0


def test_erc_entropy_epsilon_and_nan():
    """The authors' 1e-8 on both entropies: two zero entropies give rho = 1 (gradient kept); a zero rollout entropy
    with a nonzero current one is masked; rho from a NaN entropy on an unmasked token is masked, value unchanged."""
    old = torch.zeros(5, 1, dtype=F64)
    lp = (old + torch.log(torch.tensor([1.1, 0.9, 1.0, 1.0, 1.05], dtype=F64))[:, None]).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5, -3.0], dtype=F64)
    h_old = torch.tensor([[0.0], [0.0], [0.0], [1.0], [0.3]], dtype=F64)
    h = torch.tensor([[0.0], [1e-10], [1e-9], [math.nan], [0.3]], dtype=F64)
    # rho: 1 (kept), 1.01 (kept), 1.1 (masked), NaN (masked), 1 (kept)
    loss, metrics = policy_loss(lp, old, adv, torch.ones(5, 1), loss_mode="ppo_erc", entropies=h, old_entropies=h_old)
    loss.backward()
    r = torch.exp(lp.detach()[:, 0] - old[:, 0])
    expected = torch.tensor([1, 1, 0, 0, 1], dtype=F64) * (-r * adv / 5)  # all inside the PPO band: F = r
    torch.testing.assert_close(lp.grad[:, 0], expected, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx((-r * adv).mean().item(), rel=1e-12)
    assert metrics["erc_frac"].item() == pytest.approx(2 / 5)
    assert metrics["erc_frac_high"].item() == pytest.approx(1 / 5)  # the NaN one is on neither side
    assert metrics["erc_frac_low"].item() == 0.0
    assert entropy_ratio(h[:3], h_old[:3])[:, 0].tolist() == pytest.approx([1.0, 1.01, 1.1], rel=1e-12)


def test_erc_needs_both_entropies_and_other_modes_ignore_them():
    lp, old, adv, mask = _random_batch(0, b=2, t=3)
    ent = _ent("ppo_erc", lp)
    for mode in ("ppo_erc", "gppo_erc"):
        with pytest.raises(ValueError, match=rf"loss_mode='{mode}' needs entropies \(B, T\); got None"):
            policy_loss(lp, old, adv, mask, loss_mode=mode, old_entropies=ent["old_entropies"])
        with pytest.raises(ValueError, match=rf"loss_mode='{mode}' needs old_entropies \(B, T\); got None"):
            policy_loss(lp, old, adv, mask, loss_mode=mode, entropies=ent["entropies"])
    with pytest.raises(ValueError, match=r"old_entropies must have the shape of log_prob \(B, T\) = \(2, 3\)"):
        policy_loss(
            lp,
            old,
            adv,
            mask,
            loss_mode="ppo_erc",
            entropies=ent["entropies"],
            old_entropies=ent["old_entropies"][:, :2],
        )
    gppo, m = policy_loss(lp, old, adv, mask, loss_mode="gppo", **ent)
    assert torch.equal(gppo, policy_loss(lp, old, adv, mask, loss_mode="gppo")[0])
    assert "erc_frac" not in m and "entropy_mean" in m
    assert LossSettings(loss_mode="gppo_erc", beta1=0.5, erc_low=0.1, erc_high=0.2).erc_high == 0.2


def test_entropy_metrics_of_the_clip_categories():
    """With entropies, any mode reports the mean entropy and each clip category's share of it (CE-GPPO's view)."""
    r, a, old, lp, mask = _clip_category_tokens()
    h = torch.tensor([[0.1], [0.2], [0.4], [0.8], [1.6], [3.2], [math.nan]], dtype=F64)
    for mode in ("ppo_clip", "gppo", "ppo_erc"):
        _, m = policy_loss(lp, old, a, mask, loss_mode=mode, clip_ratio_c=C, entropies=h, old_entropies=h)
        assert m["entropy_mean"].item() == pytest.approx(6.3 / 6, rel=1e-12)
        assert m["entropy_share_clip_high"].item() == pytest.approx(0.4 / 6, rel=1e-12)
        assert m["entropy_share_clip_low"].item() == pytest.approx(0.8 / 6, rel=1e-12)
        # share / fraction = the category's mean entropy
        assert m["entropy_share_clip_low"].item() / m["clip_frac_low"].item() == pytest.approx(0.8, rel=1e-12)
    _, m = policy_loss(lp, old, a, mask, loss_mode="cispo", clip_ratio_c=C, entropies=h)
    assert m["entropy_share_clip_high"].item() == pytest.approx((0.1 + 0.4) / 6, rel=1e-12)  # cispo: any sign of A
    _, m = policy_loss(lp, old, a, torch.zeros_like(mask), entropies=h)
    assert m["entropy_mean"].item() == 0.0 and m["entropy_share_clip_high"].item() == 0.0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss_mode", ["gppo", "ppo_clip", "cispo"])
def test_clip_grad_share_and_log_ratio_by_advantage_sign_by_hand(loss_mode, seed):
    """The mechanism metrics from float64 formulas: d loss_t / d log_prob_t is -r*A on unclipped tokens, 0 on
    PPO's clipped ones (Eq. 10), -F*A with F = 1-eps_low / 1+eps_high on GPPO's (Eq. 12), -clip(r)*A for CISPO
    (Eq. 16); the share is the clipped tokens' part of sum |d loss_t / d log_prob_t| (any aggregation: the
    per-token derivative, not the aggregated one)."""
    lp, old, adv, mask = _random_batch(seed, b=6, t=9, spread=0.8)
    x = lp.clone().requires_grad_(True)
    _, metrics = policy_loss(
        x,
        old,
        adv,
        mask,
        loss_mode=loss_mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=None,
        loss_agg_mode="seq-mean-token-mean",
    )
    m = mask.bool()
    a = adv[:, None].expand_as(lp)
    r = torch.exp(lp - old)
    lo, hi = 0.8, 1.28
    if loss_mode == "cispo":
        high, low = m & (r > hi), m & (r < lo)
        d = -r.clamp(lo, hi) * a
    else:
        high, low = m & (a > 0) & (r > hi), m & (a < 0) & (r < lo)
        d = -r * a
        d = torch.where(high, -hi * a if loss_mode == "gppo" else 0.0, d)
        d = torch.where(low, -lo * a if loss_mode == "gppo" else 0.0, d)
    assert int((high | low).sum()) > 0
    share = d.abs()[high | low].sum() / d.abs()[m].sum()
    assert metrics["clip_grad_share"].item() == pytest.approx(share.item(), rel=1e-12)
    assert (share.item() == 0.0) == (loss_mode == "ppo_clip")
    for name, side in (("log_ratio_adv_pos", a > 0), ("log_ratio_adv_neg", a < 0)):
        assert metrics[name].item() == pytest.approx((lp - old)[m & side].mean().item(), rel=1e-12), name
    _, no_grad_metrics = policy_loss(lp, old, adv, mask, loss_mode=loss_mode)  # nothing to differentiate
    assert "clip_grad_share" not in no_grad_metrics
