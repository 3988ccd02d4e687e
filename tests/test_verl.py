"""klear's verl plugin against verl 0.9 itself (run with `make test-verl`, in the verl venv).

Expected values are computed independently: the gradient table of paper Eq. 10, 12, 16, 18 by hand in
float64, verl's own ``vanilla`` / ``cispo`` losses, and a float64 forward of the tiny model.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from conftest import require_or_skip

pytestmark = pytest.mark.verl
verl = require_or_skip("verl", reason="verl is not installed (make test-verl builds its venv)")

from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import klear.integrations.verl as kv  # noqa: E402
from klear.integrations.verl.losses import GPPOLossConfig, sft_term  # noqa: E402
from klear.integrations.verl.trainer import (  # noqa: E402
    IS_CORRECT_KEY,
    NUM_SFT_TOKENS_KEY,
    correct_flags,
    klear_ppo_loss,
    sft_token_count,
)
from klear.rl.losses import policy_loss  # noqa: E402

LO, HI, C = 0.8, 1.28, 10.0
# One token per clip case (ratio r, advantage A), plus one masked token holding nan.
CASES = [
    ("inside", 1.1, 1.0),
    ("low_neg", 0.5, -1.0),
    ("low_pos", 0.5, 2.0),
    ("high_pos", 1.6, 0.5),
    ("high_neg", 1.6, -1.5),
    ("dual", 12.0, -2.0),
    ("inside_neg", 0.9, -0.5),
]
# F per case (gradient coefficient, module docstring of klear.rl.losses) for beta1, beta2.
B1, B2 = 0.5, 0.75


def f_table(mode: str, r: float, case: str) -> float:
    if case == "dual":
        return 0.0
    if mode == "gppo":
        return {"low_neg": B1 * LO, "high_pos": B2 * HI}.get(case, r)
    if mode == "gppo_only_high":
        return {"low_neg": 0.0, "high_pos": B2 * HI}.get(case, r)
    raise AssertionError(mode)


def value_table(r: float, a: float, case: str) -> float:
    return {"low_neg": -LO * a, "high_pos": -HI * a, "dual": -C * a}.get(case, -r * a)


def actor_config(loss_mode: str, **policy) -> ActorConfig:
    """verl's ActorConfig built from a DictConfig whose policy_loss selects GPPOLossConfig by _target_."""
    beta = {"beta1": B1, "beta2": B2} if loss_mode == "gppo" else {"beta2": B2} if loss_mode == "gppo_only_high" else {}
    cfg = OmegaConf.create(
        {
            "_target_": "verl.workers.config.FSDPActorConfig",
            "strategy": "fsdp",
            "rollout_n": 2,
            "ppo_micro_batch_size_per_gpu": 2,
            "clip_ratio_low": 1 - LO,
            "clip_ratio_high": HI - 1,
            "clip_ratio_c": C,
            "use_torch_compile": False,
            "policy_loss": {
                "_target_": "klear.integrations.verl.GPPOLossConfig",
                "loss_mode": loss_mode,
                **beta,
                **policy,
            },
        }
    )
    return omega_conf_to_dataclass(cfg)


def case_batch(dtype=torch.float64):
    n = len(CASES)
    old = torch.tensor([[-1.0] * n + [0.0]], dtype=dtype)
    lr = torch.tensor([[math.log(r) for _, r, _ in CASES] + [float("nan")]], dtype=dtype)
    log_prob = (old + lr).detach().requires_grad_(True)
    adv = torch.tensor([[a for *_, a in CASES] + [float("nan")]], dtype=dtype)
    mask = torch.tensor([[1] * n + [0]], dtype=torch.bool)
    return old, log_prob, adv, mask


def gppo_loss(old, log_prob, adv, mask, config, **kw):
    """verl's registered ``gppo`` policy loss called as verl's actor calls it (``kw``: loss_agg_mode, ...)."""
    return get_policy_loss_fn("gppo")(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, config=config, **kw
    )


@pytest.mark.parametrize("mode", ["gppo", "gppo_only_high"])
@pytest.mark.parametrize("dp_size,batch_num_tokens", [(None, None), (2, 20)])
def test_registered_loss_matches_hand_table_and_klear(mode, dp_size, batch_num_tokens):
    config = actor_config(mode)
    assert isinstance(config.policy_loss, GPPOLossConfig)
    if dp_size is not None:
        config.global_batch_info.update(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=8)
    old, log_prob, adv, mask = case_batch()
    fn = get_policy_loss_fn(mode)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=None,
    )
    loss.backward()
    divisor = len(CASES) if dp_size is None else batch_num_tokens / dp_size
    want = sum(value_table(r, a, c) for c, r, a in CASES) / divisor
    assert loss.item() == pytest.approx(want, rel=1e-12)
    want_grad = [-f_table(mode, r, c) * a / divisor for c, r, a in CASES] + [0.0]
    torch.testing.assert_close(log_prob.grad, torch.tensor([want_grad], dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # and the same as klear's loss called directly (one copy of the math)
    lp2 = log_prob.detach().clone().requires_grad_(True)
    ref, _ = policy_loss(
        lp2,
        old,
        adv,
        mask,
        loss_mode=mode,
        clip_ratio_low=1 - LO,
        clip_ratio_high=HI - 1,
        clip_ratio_c=C,
        beta1=B1 if mode == "gppo" else 1.0,
        beta2=B2,
        num_tokens=None if dp_size is None else divisor,
    )
    ref.backward()
    assert loss.item() == ref.item()
    assert torch.equal(log_prob.grad, lp2.grad)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / len(CASES))  # verl's name: dual-clip fraction
    assert metrics["actor/pg_clipfrac_high"] == pytest.approx(1 / len(CASES))
    assert metrics["actor/pg_clipfrac_low"] == pytest.approx(1 / len(CASES))


def test_gppo_value_equals_verl_vanilla_and_verl_cispo_is_klear_cispo():
    old, log_prob, adv, mask = case_batch()
    adv0 = torch.where(mask, adv, 0.0)  # verl's own losses are not NaN-safe at masked positions
    lp0 = torch.where(mask, log_prob.detach(), old)
    kw = dict(
        old_log_prob=old, advantages=adv0, response_mask=mask, loss_agg_mode="token-mean", rollout_is_weights=None
    )
    gppo, _ = get_policy_loss_fn("gppo")(log_prob=lp0, config=actor_config("gppo"), **kw)
    vanilla, _ = get_policy_loss_fn("vanilla")(log_prob=lp0, config=actor_config("vanilla"), **kw)
    assert gppo.item() == pytest.approx(vanilla.item(), rel=1e-12)
    # verl's cispo is Eq. 15 without dual clip: equal to klear's cispo with clip_ratio_c=None, value and gradient
    lp1 = lp0.clone().requires_grad_(True)
    verl_cispo, _ = get_policy_loss_fn("cispo")(log_prob=lp1, config=actor_config("cispo"), **kw)
    verl_cispo.backward()
    lp2 = lp0.clone().requires_grad_(True)
    klear_cispo, _ = policy_loss(
        lp2, old, adv0, mask, loss_mode="cispo", clip_ratio_low=1 - LO, clip_ratio_high=HI - 1, clip_ratio_c=None
    )
    klear_cispo.backward()
    assert verl_cispo.item() == pytest.approx(klear_cispo.item(), rel=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-12, atol=1e-15)


def test_seq_mean_uses_verl_global_batch_size():
    config = actor_config("gppo")
    config.global_batch_info.update(dp_size=2, batch_num_tokens=99, global_batch_size=6)
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.full((2, 3), 0.05, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0] * 3, [-0.5] * 3], dtype=torch.float64)  # rows that do not cancel
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = gppo_loss(old, lp, adv, mask, config, loss_agg_mode="seq-mean-token-mean")
    r = math.exp(0.05)
    # per-row token-means -2r and 0.5r, summed, over verl's per-rank share of the global batch: 6 / dp_size = 3
    # (this rank's 2 rows would give -0.75r, the global 6 without dp_size -0.25r)
    assert loss.item() == pytest.approx((-2 * r + 0.5 * r) / (6 / 2), rel=1e-12)
    loss2, _ = gppo_loss(old, lp, adv, mask, config, loss_agg_mode="seq-mean-token-sum")
    assert loss2.item() == pytest.approx((-2 * 2 * r + 3 * 0.5 * r) / 3, rel=1e-12)  # token-sums -4r and 1.5r


def test_bad_settings_fail_with_the_field_named():
    # Hydra wraps the config's ValueError in an InstantiationException naming the key
    with pytest.raises(InstantiationException, match="policy_loss: beta1 is only used by"):
        actor_config("gppo_only_high", beta1=0.5)
    with pytest.raises(InstantiationException, match="sft_norm must be one of"):
        actor_config("gppo", sft_norm="per_rank")
    with pytest.raises(InstantiationException, match="alpha must be >= 0"):
        actor_config("gppo", sft_alpha=-0.1)
    old, lp, adv, mask = case_batch()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        gppo_loss(old, lp, adv, mask, actor_config("gppo"), loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="rollout correction"):
        gppo_loss(old, lp, adv, mask, actor_config("gppo"), rollout_is_weights=torch.ones_like(old))


def test_plugin_is_loaded_by_import_verl_and_check_passes():
    import subprocess
    import sys

    code = (
        "import verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
        "import sys; sys.exit(0 if R['gppo'].__module__ == 'klear.integrations.verl.losses' else 3)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    kv.check_plugin()


# ------------------------------------------------------------------------------------------ SFT term


def test_sft_term_mini_batch_norm_sums_to_the_whole_token_mean():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(8, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = (torch.rand(8, 5, generator=g) > 0.3).long()
    correct = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0])
    n_c = sft_token_count(mask, correct)
    assert n_c.item() == float((mask * correct[:, None]).sum())
    # 2 ranks x 2 micro-batches: per rank sum micro-batch losses, then average over ranks (DDP)
    ranks = []
    for rows in (range(0, 4), range(4, 8)):
        rows = list(rows)
        ranks.append(
            sum(
                sft_term(lp[m], mask[m], correct[m], "mini_batch", num_sft_tokens=n_c.item(), dp_size=2)
                for m in (rows[:2], rows[2:])
            )
        )
    total = (ranks[0] + ranks[1]) / 2
    sel = (mask.bool() & correct.bool()[:, None]).double()
    want = -(lp.detach() * sel).sum() / sel.sum()
    assert total.item() == pytest.approx(want.item(), rel=1e-12)
    total.backward()
    torch.testing.assert_close(lp.grad, -sel / sel.sum(), rtol=1e-12, atol=0)
    # the authors' per-micro-batch normalisation: each micro-batch's own mean over the number of micro-batches
    mb = sft_term(lp[:2], mask[:2], correct[:2], "micro_batch", num_micro_batches=2)
    s2 = sel[:2]
    assert mb.item() == pytest.approx((-(lp.detach()[:2] * s2).sum() / s2.sum() / 2).item(), rel=1e-12)


def _micro_batch(model, tok, correct):
    """A verl actor micro-batch (nested no-padding layout) of 3 responses and the model's log-probs."""
    prompts = [tok(p).input_ids for p in ("What is 2+2?", "Name a colour.", "Say hi")]
    responses = [tok(r).input_ids for r in (" 4, surely", " Blue", " hi there friend")]
    seqs = [torch.tensor(p + r) for p, r in zip(prompts, responses)]
    max_resp = max(len(r) for r in responses)
    response_mask = torch.tensor([[1] * len(r) + [0] * (max_resp - len(r)) for r in responses])
    old = torch.stack(
        [
            torch.nn.functional.pad(torch.full((len(r),), -2.0, dtype=torch.float64), (0, max_resp - len(r)))
            for r in responses
        ]
    )
    data = TensorDict(
        {
            "prompts": torch.nested.as_nested_tensor([torch.tensor(p) for p in prompts], layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor([torch.tensor(r) for r in responses], layout=torch.jagged),
            "response_mask": response_mask,
            "old_log_probs": old,
            "advantages": torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)[:, None].expand(3, max_resp).clone(),
            IS_CORRECT_KEY: torch.tensor(correct, dtype=torch.float64),
        },
        batch_size=[3],
    )
    for k, v in {
        "dp_size": 1,
        "batch_num_tokens": int(response_mask.sum()),
        "global_batch_size": 3,
        "max_response_len": max_resp,
        NUM_SFT_TOKENS_KEY: float(sft_token_count(response_mask, data[IS_CORRECT_KEY])),
    }.items():
        data.set_non_tensor(k, v)
    # the engine's no-padding output: per row, log p of token t+1 at position t (last position unused)
    values = []
    for s in seqs:
        lg = model(input_ids=s[None]).logits[0].double()
        lp = torch.log_softmax(lg, -1)[:-1].gather(-1, s[1:, None])[:, 0]
        values.append(torch.cat([lp, lp.new_zeros(1)]))
    log_probs = torch.nested.as_nested_tensor(values, layout=torch.jagged)
    return data, {"log_probs": log_probs}, seqs, [len(p) for p in prompts]


def test_klear_ppo_loss_on_a_tiny_model_equals_float64_hand_computation(tiny_model):
    model, tok = tiny_model
    model = model.double()
    alpha = 0.1
    config = actor_config("gppo", sft_alpha=alpha)
    correct = [1.0, 0.0, 1.0]
    data, out, seqs, plens = _micro_batch(model, tok, correct)
    base = partial(ppo_loss, config=config)
    loss, metrics = klear_ppo_loss(config, out, data, base_loss_fn=base)
    # hand computation: mean of -log p over the response tokens of the correct responses, float64
    nll, n = 0.0, 0
    for s, pl, ok in zip(seqs, plens, correct):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=s[None]).logits[0].double(), -1)
        for t in range(pl, len(s)):
            if ok:
                nll -= logp[t - 1, s[t]].item()
                n += 1
    assert metrics["actor/sft_loss"] == pytest.approx(nll / n, rel=1e-10)
    pg, _ = base(model_output=out, data=data)  # verl's loss alone, on the same forward
    assert loss.item() == pytest.approx(pg.item() + alpha * nll / n, rel=1e-10)
    # gradient: d(loss - pg)/d params == alpha * d(hand SFT)/d params
    params = [p for p in model.parameters() if p.requires_grad]
    g_total = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    g_pg = torch.autograd.grad(pg, params, allow_unused=True)
    hand = 0.0
    for s, pl, ok in zip(seqs, plens, correct):
        if ok:
            logp = torch.log_softmax(model(input_ids=s[None]).logits[0].double(), -1)
            hand = hand - logp[torch.arange(pl - 1, len(s) - 1), s[pl:]].sum()
    g_hand = torch.autograd.grad(alpha * hand / n, params, allow_unused=True)
    for a, b, h in zip(g_total, g_pg, g_hand):
        if h is None:
            continue
        # |h| <= ~0.08; the subtraction a - b leaves ~5e-9 on a few embedding rows (tokens shared by rows)
        torch.testing.assert_close(a - b, h, rtol=1e-6, atol=2e-8)
    # alpha = 0 is verl's loss unchanged
    data2, out2, _, _ = _micro_batch(model, tok, correct)
    cfg0 = actor_config("gppo")
    loss0, _ = klear_ppo_loss(cfg0, out2, data2, base_loss_fn=partial(ppo_loss, config=cfg0))
    assert loss0.item() == base(model_output=out2, data=data2)[0].item()


def test_correct_flags_from_token_level_rewards():
    rm = torch.zeros(3, 4)
    rm[0, 2], rm[1, 3], rm[2, 1] = 1.0, -1.0, 0.75
    td = TensorDict({"rm_scores": rm}, batch_size=[3])
    assert correct_flags(td).tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(KeyError, match="rm_scores"):
        correct_flags(TensorDict({"x": rm}, batch_size=[3]))


# ------------------------------------------------------------------------------------------ rewards


def test_rewards_through_verl_naive_reward_manager(embedded_path):
    from transformers import AutoTokenizer
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    tok = AutoTokenizer.from_pretrained(embedded_path)
    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://klear.integrations.verl.rewards",
                    "name": "compute_score",
                    "reward_kwargs": {},
                }
            }
        }
    )
    manager = NaiveRewardManager(cfg, tok, get_custom_reward_fn(cfg))
    code_gt = {"format": "stdio", "inputs": ["1", "2", "3", "4"], "outputs": ["2", "4", "6", "8"]}
    rows = [
        ("math_dapo", "<think>2+2</think> The answer is \\boxed{4}.", "4", 1.0, 1.0),
        ("math_dapo", "<think>hmm</think> \\boxed{5}", "4", -1.0, 0.0),
        ("code_test", "```python\nn = int(input())\nprint(n * 2 if n != 3 else 0)\n```", code_gt, 0.75, 0.0),
        ("code_test", "```python\nprint(int(input()) * 2)\n```", code_gt, 1.0, 1.0),
    ]

    async def run_all():
        outs = []
        for ds, text, gt, _, _ in rows:
            resp = tok(text).input_ids
            prompt = tok("Q:").input_ids
            batch = TensorDict(
                {
                    "prompts": torch.tensor([prompt]),
                    "responses": torch.tensor([resp]),
                    "attention_mask": torch.ones(1, len(prompt) + len(resp), dtype=torch.long),
                },
                batch_size=[1],
            )
            nt = {
                "data_source": np.array([ds], dtype=object),
                "reward_model": np.array([{"ground_truth": gt}], dtype=object),
                "extra_info": np.array([{}], dtype=object),
            }
            outs.append(await manager.run_single(DataProto(batch=batch, non_tensor_batch=nt)))
        return outs

    outs = manager.loop.run_until_complete(run_all())  # verl binds its manager to this loop
    for (ds, *_, score, acc), out in zip(rows, outs):
        assert out["reward_score"] == pytest.approx(score), ds
        assert out["reward_extra_info"]["acc"] == acc, ds


def test_an_unscored_response_stops_the_verl_step_instead_of_becoming_a_reward(monkeypatch):
    """verl needs a float per response; klear's unscored (nan) must not reach it as a reward, nor as -1."""
    from klear.integrations.verl import rewards as verl_rewards

    monkeypatch.setattr(verl_rewards, "_klear_compute_score", lambda *a, **k: float("nan"))
    with pytest.raises(RuntimeError, match="could not score a 'math_dapo' response"):
        verl_rewards.compute_score("math_dapo", "\\boxed{4}", "4")
    monkeypatch.setattr(verl_rewards, "_klear_compute_score", lambda *a, **k: -1.0)
    assert verl_rewards.compute_score("math_dapo", "\\boxed{5}", "4") == {"score": -1.0, "acc": 0.0}


# ------------------------------------------------------------------------------------------ recipe


def test_recipe_overrides_compose_with_verl_config():
    """configs/verl/klear_rl.sh's overrides build verl's actor config with the paper's values (no run)."""
    import os
    import re
    import shlex
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    script = (Path(__file__).resolve().parents[1] / "configs" / "verl" / "klear_rl.sh").read_text()
    body = script.split("exec python -m verl.trainer.main_ppo \\\n")[1]
    env = {"TRAIN": "t.parquet", "VAL": "v.parquet", "MODEL": "m", "LR": "1e-6", "MINI_BATCH": "16", "STAGE": "math"}
    env.update(PROMPT_LENGTH="4096", RESPONSE_LENGTH="32768", NEED="36864", CONTEXT_LENGTH="36864")
    # the context overrides the script adds for a 32K checkpoint (tests/test_verl_script.py checks when)
    context = [
        f"+actor_rollout_ref.{k}.max_position_embeddings=36864"
        for k in ("model.override_config", "rollout.engine_kwargs.vllm.hf_overrides")
    ]
    overrides = [
        re.sub(r"\$\{?(\w+)(:-(\w+))?\}?", lambda m: env.get(m.group(1), m.group(3) or ""), a)
        for a in shlex.split(body.replace("\\\n", " "))
        if a not in ("$@", "${CONTEXT_OVERRIDES[@]}")
    ] + context
    with initialize_config_dir(
        config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None
    ):
        cfg = compose("ppo_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, GPPOLossConfig)
    assert (actor.policy_loss.loss_mode, actor.policy_loss.sft_alpha) == ("gppo", 0.1)
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (actor.optim.lr, actor.ppo_mini_batch_size, cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (
        1e-6,
        16,
        128,
        8,
    )
    assert cfg.trainer.v1.trainer_mode == "klear_sync" and not actor.use_kl_loss
    rollout = cfg.actor_rollout_ref.rollout
    assert (rollout.max_model_len, cfg.data.max_prompt_length + cfg.data.max_response_length) == (36864, 36864)
    assert cfg.actor_rollout_ref.model.override_config.max_position_embeddings == 36864
    assert rollout.engine_kwargs.vllm.hf_overrides.max_position_embeddings == 36864


def test_check_plugin_refuses_when_verl_plugins_are_disabled(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")
    with pytest.raises(RuntimeError, match="VERL_USE_EXTERNAL_PLUGINS"):
        kv.check_plugin()
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "other,klear")
    kv.check_plugin()


def test_verl_fsdp_model_patch_runs_with_the_pinned_trl(tiny_model):
    """verl's FSDP engine calls ``apply_monkey_patch`` on every actor model it builds, and that function imports
    ``AutoModelForCausalLMWithValueHead`` from ``trl.experimental.ppo`` (or ``trl``) whenever TRL is installed;
    TRL 1.13+ ships neither, so ``init_model`` failed on a GPU cluster. configs/verl/constraints.txt pins a TRL
    that has it; this runs the same call on CPU."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model, _ = tiny_model
    apply_monkey_patch(model, use_remove_padding=False)
