"""GPPOTrainer on a tiny random model (real tokenizer) on CPU: filtering, SFT term, exact token-mean windows."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
import torch
import yaml
from datasets import Dataset
from transformers import TrainerCallback

from conftest import cpu_gppo_config
from klear.rl.losses import LOSS_REGISTRY, LossMode, LossSettings, policy_loss
from klear.rl.trainer import GPPOConfig, GPPOTrainer, truncated_mask


def _dataset(n_prompts: int) -> Dataset:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "prompt_id": f"p{i}",
            "data_source": "math_test",
            "reward_model": {"ground_truth": str(2 * i)},
        }
        for i in range(n_prompts)
    ]
    return Dataset.from_list(rows)


def _config(tmp_path, **kw) -> GPPOConfig:
    batch = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=4
    )
    base = dict(max_completion_length=6, max_steps=2, learning_rate=1e-3, **batch)
    base["max_grad_norm"] = 1e9  # no clipping: the gradient test compares raw accumulated gradients
    return cpu_gppo_config(tmp_path / "out", **{**base, **kw})


class _GradRecorder(TrainerCallback):
    """Keeps the parameters at train start and the accumulated gradients just before the first optimizer step."""

    def __init__(self):
        self.params0 = None
        self.grads = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.params0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.grads is None:
            self.grads = {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}


def _reward_table(table: dict[str, list[float]]):
    """Reward function returning, for each prompt id, the next value of its list (cycled)."""
    counters: dict[str, int] = {}

    def reward(prompts, completions, prompt_id, **kw):
        out = []
        for pid in prompt_id:
            vals = table[pid]
            i = counters.get(pid, 0)
            counters[pid] = i + 1
            out.append(vals[i % len(vals)])
        return out

    return reward


def test_two_steps_filter_zero_advantage_groups(tmp_path, tiny_model):
    model, tok = tiny_model
    # p0: all correct, p1: all wrong, p2: soft all-equal 0.7 (float32 std would not be exactly 0),
    # p3: mixed. Generation batch = 4 per device x 4 steps = 16 rollouts = 4 prompts x 4 generations.
    table = {"p0": [1.0], "p1": [-1.0], "p2": [0.7], "p3": [1.0, -1.0, -1.0, 1.0]}
    ds = _dataset(4)
    trainer = GPPOTrainer(
        model=model, reward_funcs=_reward_table(table), args=_config(tmp_path), train_dataset=ds, processing_class=tok
    )
    trainer.train()
    assert trainer.state.global_step == 2
    batches = trainer._buffered_inputs
    keep = torch.cat([b["klear_keep"] for b in batches])
    adv = torch.cat([b["advantages"] for b in batches])
    correct = torch.cat([b["klear_is_correct"] for b in batches])
    # Exactly the 4 rollouts of the mixed group survive, whatever the shuffle put them; the 12 filtered
    # rollouts were dropped from the micro-batches (one kept rollout in each of the 4 micro-batches).
    assert keep.tolist() == [True] * 4
    assert [len(b["klear_keep"]) for b in batches] == [1, 1, 1, 1]
    assert sorted(adv.tolist()) == pytest.approx([-1 / (1 + 1e-6)] * 2 + [1 / (1 + 1e-6)] * 2)
    # The kept ones are those with nonzero advantage, and 2 of them are correct.
    assert int((keep & correct).sum()) == 2
    # The token-mean divisor counts only kept tokens.
    for i, b in enumerate(batches):
        window = batches[(i // 2) * 2 : (i // 2) * 2 + 2]  # gradient_accumulation_steps = 2
        expected = sum(float((w["completion_mask"] * w["klear_keep"].unsqueeze(1)).sum()) for w in window)
        assert b["klear_num_tokens"] == expected
    logs = [h for h in trainer.state.log_history if "klear/zero_adv_group_frac" in h]
    assert logs and logs[0]["klear/zero_adv_group_frac"] == pytest.approx(0.75)


def test_correctness_criterion_keeps_soft_groups(tmp_path, tiny_model):
    """The authors' rule filters on exact correctness: an all-0.7 group is 'all wrong', so it is filtered,
    while a 0.5/0.7 group (no correct response, unequal rewards) is also all-wrong -> filtered; the raw-reward
    rule keeps the latter."""
    model, tok = tiny_model
    table = {"p0": [1.0, -1.0], "p1": [0.5, 0.7], "p2": [0.7], "p3": [1.0]}
    for criterion, expected_kept in (("reward", 8), ("correctness", 4)):
        trainer = GPPOTrainer(
            model=model,
            reward_funcs=_reward_table(dict(table)),
            args=_config(tmp_path, max_steps=1, zero_adv_criterion=criterion),
            train_dataset=_dataset(4),
            processing_class=tok,
        )
        trainer.train()
        keep = torch.cat([b["klear_keep"] for b in trainer._buffered_inputs])
        assert int(keep.sum()) == expected_kept, criterion


def test_sft_loss_zero_when_nothing_correct(tmp_path, tiny_model):
    model, tok = tiny_model
    rng = random.Random(0)
    vals = [0.0, 0.25, 0.5]

    def reward(prompts, completions, **kw):  # soft rewards, never the correct score 1.0
        return [rng.choice(vals) for _ in completions]

    trainer = GPPOTrainer(
        model=model,
        reward_funcs=reward,
        args=_config(tmp_path, alpha=0.5),
        train_dataset=_dataset(4),
        processing_class=tok,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "klear/sft_loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["klear/sft_loss"] == 0.0
        assert h["klear/num_sft_tokens"] == 0.0
        assert h["klear/num_loss_tokens"] > 0


# The exact token-mean / seq-mean windows (accumulated gradient == the paper's one-batch loss, unequal micro-batches,
# off-policy, every loss mode) are tested in tests/test_trainer_exactness.py.


def test_first_update_ratio_is_one_off_policy(tmp_path, tiny_model):
    """With 2 optimizer steps per rollout batch the trainer recomputes old_log_prob (with the sampling
    temperature); the first step's ratio must be 1 and the second's must not."""
    model, tok = tiny_model
    table = {f"p{i}": [1.0, -1.0, 0.0, 1.0] for i in range(4)}
    args = _config(tmp_path, temperature=0.7, max_steps=2, learning_rate=5e-3)
    trainer = GPPOTrainer(
        model=model, reward_funcs=_reward_table(table), args=args, train_dataset=_dataset(4), processing_class=tok
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "klear/ratio_max" in h]
    assert logs[0]["klear/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert logs[0]["klear/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(logs[1]["klear/ratio_max"] - 1.0) > 1e-4
    assert not any("klear_old_entropies" in mb for mb in trainer._buffered_inputs)  # gppo does not read them


def test_truncated_mask_uses_finish_reason():
    # stop ids: Qwen-style <|im_end|>=7 and eos=9; max length 4
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 7, 0], [1, 2, 3, 7], [5, 6, 0, 0], [1, 2, 3, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    out = truncated_mask(ids, mask, 4, [9, 7])
    # full length without stop -> truncated; stopped early (even without a stop token: a stop string) -> not;
    # stop token exactly at the limit -> not truncated.
    assert out.tolist() == [True, False, False, False, False]
    # Judging by tokenizer.eos_token_id alone (9) would wrongly call row 2 truncated:
    assert truncated_mask(ids, mask, 4, [9]).tolist()[2] is True


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"beta": 0.04}, "beta"),
        ({"top_p": 0.95}, "top_p"),
        ({"top_k": 50}, "top_k"),
        ({"loss_mode": "grpo"}, "loss_mode"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"mask_truncated_completions": True}, "overlong_filter"),
        ({"steps_per_generation": 3}, "multiple"),
        ({"zero_adv_criterion": "std"}, "zero_adv_criterion"),
        ({"gradient_checkpointing_kwargs": "use_reentrant"}, "gradient_checkpointing_kwargs"),
    ],
)
def test_config_rejects_unsupported(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **kw)


def test_config_accepts_json_object_checkpointing_kwargs(tmp_path):
    cfg = _config(tmp_path, gradient_checkpointing_kwargs='{"use_reentrant": false}')
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}


def test_config_maps_clip_ratios_to_trl(tmp_path):
    cfg = _config(tmp_path, clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert (cfg.epsilon, cfg.epsilon_high) == (0.1, 0.3)
    assert cfg.optimizer_steps_per_generation == 2


def test_drop_filtered_samples_keeps_order_and_trims():
    from klear.rl.trainer import drop_filtered_samples

    def mb(ids, lens, keep):
        T = 4
        comp = torch.tensor([[i] * T for i in ids])
        mask = torch.tensor([[1] * n + [0] * (T - n) for n in lens])
        return {
            "completion_ids": comp,
            "completion_mask": mask,
            "old_per_token_logps": mask.float(),
            "advantages": torch.tensor(ids, dtype=torch.float),
            "klear_keep": torch.tensor(keep),
            "num_items_in_batch": torch.tensor(7),
            "prompt_ids": torch.ones(len(ids), 3, dtype=torch.long),
        }

    out = drop_filtered_samples(
        [mb([0, 1, 2], [4, 1, 2], [False, True, True]), mb([3, 4, 5], [3, 2, 1], [True, False, True])]
    )
    assert [b["advantages"].tolist() for b in out] == [[1.0, 2.0], [3.0, 5.0]]
    assert [b["completion_ids"].size(1) for b in out] == [2, 3]  # trimmed to each micro-batch's longest
    assert [b["old_per_token_logps"].size(1) for b in out] == [2, 3]
    assert out[0]["prompt_ids"].size(1) == 3 and out[1]["num_items_in_batch"].item() == 7
    # Fewer kept samples than micro-batches: masked placeholders keep every micro-batch non-empty.
    out = drop_filtered_samples([mb([0, 1], [1, 1], [False, False]), mb([2, 3], [1, 1], [False, True])])
    assert [len(b["advantages"]) for b in out] == [1, 1]
    assert sorted(torch.cat([b["klear_keep"] for b in out]).tolist()) == [False, True]


# ------------------------------------------------------------- loss settings are checked by the loss's own validator
# Settings policy_loss rejects; GPPOConfig used to accept all but the first three (issue 11).
_BAD_LOSS_SETTINGS = [
    {"loss_mode": "grpo"},
    {"loss_agg_mode": "sum"},
    {"clip_ratio_c": 1.0},
    {"clip_ratio_low": 1.0},
    {"clip_ratio_low": 1.5},
    {"clip_ratio_low": math.nan},
    {"clip_ratio_high": math.inf},
    {"clip_ratio_c": math.nan},
    {"beta1": -0.5},
    {"beta2": math.nan},
    {"loss_mode": "ppo_clip", "beta1": 0.5},
    {"loss_mode": "gppo_only_high", "beta1": 0.25},
    {"loss_mode": "cispo", "beta2": 0.5},
    {"loss_mode": "gppo_erc", "erc_low": 0.0},
    {"loss_mode": "gppo_erc", "erc_low": 1.0},
    {"loss_mode": "ppo_erc", "erc_high": -0.05},
    {"loss_mode": "ppo_erc", "beta1": 0.5},
    {"loss_mode": "gppo", "erc_high": 0.1},
]


@pytest.mark.parametrize("settings", _BAD_LOSS_SETTINGS, ids=[str(s) for s in _BAD_LOSS_SETTINGS])
def test_config_rejects_every_setting_policy_loss_rejects(tmp_path, settings):
    lp = torch.zeros(2, 3)
    bad = list(settings)[-1]  # the offending setting, named by both errors
    with pytest.raises(ValueError, match=bad) as from_loss:
        policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), **settings)
    with pytest.raises(ValueError, match=bad) as from_config:
        _config(tmp_path, **settings)
    assert str(from_config.value) == str(from_loss.value)


@pytest.mark.parametrize("alpha", [-0.1, math.nan])
def test_config_rejects_bad_alpha(tmp_path, alpha):
    with pytest.raises(ValueError, match="alpha must be"):
        _config(tmp_path, alpha=alpha)


def test_config_forwards_every_loss_setting(tmp_path):
    values = {
        "loss_mode": "gppo_erc",
        "clip_ratio_low": 0.1,
        "clip_ratio_high": 0.4,
        "clip_ratio_c": 3.0,
        "beta1": 0.5,
        "beta2": 0.7,
        "erc_low": 0.1,
        "erc_high": 0.2,
        "loss_agg_mode": "seq-mean-token-sum",
        "alpha": 0.2,
    }
    assert set(values) == {f.name for f in dataclasses.fields(LossSettings)}  # a new setting: add it here
    assert set(values) <= {f.name for f in dataclasses.fields(GPPOConfig)}
    assert _config(tmp_path, **values).loss_settings() == LossSettings(**values)
    cfg = _config(tmp_path)  # the paper's values are GPPOConfig's defaults
    assert cfg.loss_settings() == LossSettings(
        loss_mode="gppo", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, alpha=0.1
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ("clip_ratio_low: 1.0", "clip_ratio_low must be < 1.0, got 1.0"),
        ("{loss_mode: ppo_clip, beta1: 0.5}", "beta1 is only used by loss_mode"),
    ],
)
def test_klear_rl_refuses_a_bad_loss_setting_before_any_model_loads(tmp_path, monkeypatch, capsys, bad, message):
    import transformers

    from klear.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", no_model)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # read only by the (patched) AutoConfig
    train = tmp_path / "train.jsonl"
    train.write_text(
        '{"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "math_test", '
        '"reward_model": {"ground_truth": "2"}}\n'
    )
    trainer = {
        "num_generations": 2,
        "per_device_train_batch_size": 2,
        "max_steps": 1,
        "report_to": [],
        "save_strategy": "no",
    }
    recipe = {
        "model": str(tmp_path / "model"),
        "output_dir": str(tmp_path / "run"),
        "data": {"train": str(train), "heldout": "none"},
        "trainer": trainer,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    overrides = [f"trainer.{k}={v}" for k, v in yaml.safe_load("{" + bad.strip("{}") + "}").items()]
    assert main(["rl", "--config", str(path), *overrides]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("klear rl: error:")]
    assert len(err) == 1 and f"trainer: {message}" in err[0], err
    assert not (tmp_path / "run").exists()
    # Control: with good settings the same recipe gets as far as loading the model.
    with pytest.raises(AssertionError, match="a model or tokenizer was loaded"):
        main(["rl", "--config", str(path)])


# ------------------------------------------------------------------ entropy slots of the loss registry
@pytest.mark.parametrize("steps_per_generation", [4, 2], ids=["off_policy", "on_policy"])
def test_a_mode_that_needs_entropies_gets_current_and_old_ones(tmp_path, tiny_model, monkeypatch, steps_per_generation):
    """A loss mode registered with needs_entropies / needs_old_entropies receives (B, T) entropies of the current
    and of the rollout policy; on the first step after a rollout both policies are the same model."""
    model, tok = tiny_model
    seen = []

    def probe(t, s):  # ppo_clip's loss, recording what the trainer passed in
        seen.append((t.mask, t.entropies, t.old_entropies))
        return LOSS_REGISTRY["ppo_clip"].token_loss(t, s)

    monkeypatch.setitem(
        LOSS_REGISTRY, "probe", LossMode("probe", probe, needs_entropies=True, needs_old_entropies=True)
    )
    table = {f"p{i}": [1.0, -1.0, 0.0, 1.0] for i in range(4)}
    args = _config(
        tmp_path, loss_mode="probe", max_steps=2, learning_rate=5e-3, steps_per_generation=steps_per_generation
    )
    trainer = GPPOTrainer(
        model=model, reward_funcs=_reward_table(table), args=args, train_dataset=_dataset(4), processing_class=tok
    )
    trainer.train()
    assert len(seen) == 4  # 2 optimizer steps x 2 micro-batches
    for i, (mask, ent, old_ent) in enumerate(seen):
        assert ent.shape == old_ent.shape == mask.shape and mask.any()
        assert torch.all(torch.isfinite(ent[mask])) and torch.all(ent[mask] >= 0)
        assert not ent.requires_grad and not old_ent.requires_grad
        diff = (ent - old_ent)[mask].abs().max().item()
        if i < 2 or steps_per_generation == 2:  # first step of a rollout batch (on-policy: every step)
            assert diff < 1e-5, (i, diff)
        else:  # the model was updated since the rollout
            assert diff > 1e-6, (i, diff)
    assert all(("klear_old_entropies" in mb) == (steps_per_generation == 4) for mb in trainer._buffered_inputs)


# ------------------------------------------------------------------ Entropy Ratio Clipping through the trainer
def test_gppo_erc_runs_with_the_rollout_passs_old_entropies(tmp_path, tiny_model):
    """gppo_erc off-policy (2 optimizer steps per rollout batch): the old entropies come from the rollout's log-prob
    pass; on the first step both policies are the same model, so rho == 1 on every token, ERC masks nothing and the
    accumulated gradient is gppo's; on the second step the ratios have moved."""
    model, tok = tiny_model
    twin = copy.deepcopy(model)
    table = {f"p{i}": [1.0, -1.0, 0.0, 1.0] for i in range(4)}
    runs = {}
    for mode, m in (("gppo_erc", model), ("gppo", twin)):
        rec = _GradRecorder()
        args = _config(tmp_path / mode, loss_mode=mode, max_steps=2, learning_rate=5e-3)
        trainer = GPPOTrainer(
            model=m,
            reward_funcs=_reward_table(dict(table)),
            args=args,
            train_dataset=_dataset(4),
            processing_class=tok,
            callbacks=[rec],
        )
        trainer.train()
        runs[mode] = (trainer, rec)
    trainer, rec = runs["gppo_erc"]
    assert all(mb["klear_old_entropies"].shape == mb["completion_mask"].shape for mb in trainer._buffered_inputs)
    logs = [h for h in trainer.state.log_history if "klear/erc_frac" in h]
    assert len(logs) == 2
    first, second = logs
    assert first["klear/erc_frac"] == 0.0
    assert first["klear/entropy_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["klear/entropy_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert abs(second["klear/entropy_ratio_max"] - 1.0) > 1e-6 or abs(second["klear/entropy_ratio_min"] - 1.0) > 1e-6
    for key in (
        "klear/erc_frac_high",
        "klear/erc_frac_low",
        "klear/entropy_ratio_mean",
        "klear/entropy_mean",
        "klear/entropy_share_clip_high",
        "klear/entropy_share_clip_low",
    ):
        assert key in first and math.isfinite(first[key]), key
    gppo_trainer, gppo_rec = runs["gppo"]
    assert "klear/erc_frac" not in gppo_trainer.state.log_history[0]
    assert "klear/entropy_mean" in gppo_trainer.state.log_history[0]  # every mode gets the entropy metrics
    assert rec.grads.keys() == gppo_rec.grads.keys() and rec.grads
    for k, g in rec.grads.items():
        err = (g - gppo_rec.grads[k]).norm() / gppo_rec.grads[k].norm().clamp(min=1e-30)
        assert err < 1e-5, (k, err.item())


@pytest.mark.parametrize("name, loss_mode, beta1", [("rl_math_cegppo", "gppo", 0.5), ("rl_math_erc", "gppo_erc", 1.0)])
def test_shipped_cegppo_and_erc_recipes_are_valid(name, loss_mode, beta1):
    """The GPU-scale recipes load, pass the recipe checks and their loss settings validate (as klear rl does before
    any model loads); the loss settings are the released ones (CE-GPPO: beta1 0.5, beta2 1, eps 0.2; ERC: gppo_erc,
    band (0.95, 1.05), eps 0.2) and everything else is the Klear math recipe's."""
    from klear.config import apply_overrides, load_config
    from klear.rl.job import validate_job_config

    cfg, path = load_config(name)
    validate_job_config(apply_overrides(cfg, ["model=/ckpt", "data.train=/data.parquet"]), str(path))
    t = cfg["trainer"]
    settings = LossSettings(**{f.name: t[f.name] for f in dataclasses.fields(LossSettings) if f.name in t})
    assert (settings.loss_mode, settings.beta1, settings.beta2) == (loss_mode, beta1, 1.0)
    assert (settings.clip_ratio_low, settings.clip_ratio_high, settings.clip_ratio_c, settings.alpha) == (
        0.2,
        0.2,
        10.0,
        0.1,
    )
    assert (settings.erc_low, settings.erc_high) == (0.05, 0.05)
    klear, _ = load_config("rl_math_klear")
    loss_keys = {f.name for f in dataclasses.fields(LossSettings)}
    same = {k: v for k, v in klear["trainer"].items() if k not in loss_keys}
    assert {k: t.get(k) for k in same} == same
    assert cfg["output_dir"] == f"runs/{name}"


# ------------------------------------------------------------------ unscored samples (issue 20)
NAN = float("nan")


def test_an_unscored_reward_is_left_out_instead_of_raising(tmp_path, tiny_model):
    """One NaN reward (the judge could not score it) in p0, three in p3: training runs, the unscored samples are
    out of the loss, p0's advantages come from its 3 scored members, p3 (one scored member) is a zero-advantage
    group, and klear/unscored_frac and klear/accuracy (over scored samples) are logged."""
    model, tok = tiny_model
    table = {"p0": [1.0, -1.0, NAN, 1.0], "p1": [1.0, -1.0, -1.0, 1.0], "p2": [1.0], "p3": [NAN, NAN, NAN, 1.0]}
    trainer = GPPOTrainer(
        model=model,
        reward_funcs=_reward_table(table),
        args=_config(tmp_path, max_steps=1, bf16=False),  # float32, as `klear rl` runs on a CPU
        train_dataset=_dataset(4),
        processing_class=tok,
    )
    trainer.train()
    batches = trainer._buffered_inputs
    keep = torch.cat([b["klear_keep"] for b in batches])
    adv = torch.cat([b["advantages"] for b in batches]).double()
    assert keep.tolist() == [True] * 7  # p0's 3 scored + p1's 4; p2 all equal, p3 < 2 scored, 4 unscored
    # p0 over its scored members 1, -1, 1 (float64 by hand): mean 1/3, population std sqrt(8/9)
    s0 = math.sqrt(8 / 9)
    expected = [(1 - 1 / 3) / (s0 + 1e-6)] * 2 + [(-1 - 1 / 3) / (s0 + 1e-6)] + [1 / (1 + 1e-6)] * 2
    expected += [-1 / (1 + 1e-6)] * 2
    assert sorted(adv.tolist()) == pytest.approx(sorted(expected), rel=1e-6)
    for i, b in enumerate(batches):  # the token-mean divisor counts kept (scored) tokens only
        window = batches[(i // 2) * 2 : (i // 2) * 2 + 2]
        assert b["klear_num_tokens"] == sum(
            float((w["completion_mask"] * w["klear_keep"][:, None]).sum()) for w in window
        )
    logs = [h for h in trainer.state.log_history if "klear/unscored_frac" in h]
    assert logs and logs[0]["klear/unscored_frac"] == pytest.approx(4 / 16)
    assert logs[0]["klear/accuracy"] == pytest.approx(9 / 12)  # 2 + 2 + 4 + 1 correct of 12 scored
    assert logs[0]["klear/zero_adv_group_frac"] == pytest.approx(2 / 4)


def test_a_rollout_batch_with_no_scored_sample_stops_with_a_clear_error(tmp_path, tiny_model):
    model, tok = tiny_model
    trainer = GPPOTrainer(
        model=model,
        reward_funcs=lambda prompts, completions, **kw: [None] * len(completions),
        args=_config(tmp_path, max_steps=1, bf16=False),  # float32, as `klear rl` runs on a CPU
        train_dataset=_dataset(4),
        processing_class=tok,
    )
    with pytest.raises(RuntimeError, match=r"no sample of the rollout batch could be scored \(all 16 rewards"):
        trainer.train()


@pytest.mark.parametrize(
    "loss_mode, loss_agg_mode",
    [("gppo", "token-mean"), ("gppo", "seq-mean-token-mean"), ("cispo", "seq-mean-token-sum")],
)
def test_loss_and_gradient_with_an_unscored_sample_equal_those_without_it(loss_mode, loss_agg_mode):
    """The rollout's advantages and loss mask (rollout_rewards + GPPOTrainer._loss_mask) make an unscored sample
    invisible: loss and gradient equal those of the batch without it (float64), and its own gradient is 0."""
    from klear.rl.losses import LossInputs, total_loss
    from klear.rl.trainer import rollout_rewards

    gen = torch.Generator().manual_seed(0)
    n, t = 8, 6
    rewards = torch.tensor([[1.0], [-1.0], [NAN], [1.0], [0.25], [0.5], [1.0], [0.5]])
    group_ids = ["a"] * 4 + ["b"] * 4
    completion_mask = torch.ones(n, t)
    completion_mask[1, 4:] = 0
    completion_mask[2, 3:] = 0
    completion_mask[5, 2:] = 0
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) - 0.1
    new = old + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    settings = LossSettings(loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, alpha=0.1)

    def loss_and_grad(rows: list[int]):
        rr = rollout_rewards(
            rewards[rows],
            torch.ones(1),
            [group_ids[i] for i in rows],
            adv_epsilon=1e-6,
            correct_reward=1.0,
            zero_adv_criterion="reward",
        )
        mask = GPPOTrainer._loss_mask({"completion_mask": completion_mask[rows], "klear_keep": rr.scored})
        log_prob = new[rows].clone().requires_grad_(True)
        loss, _ = total_loss(
            LossInputs(log_prob, old[rows], rr.advantages.double(), mask, is_correct=rr.is_correct), settings
        )
        loss.backward()
        return loss.detach(), log_prob.grad

    loss_all, grad_all = loss_and_grad(list(range(n)))
    scored_rows = [0, 1, 3, 4, 5, 6, 7]
    loss_ref, grad_ref = loss_and_grad(scored_rows)
    assert torch.isfinite(loss_all) and loss_all.item() != 0.0
    torch.testing.assert_close(loss_all, loss_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_all[scored_rows], grad_ref, rtol=1e-12, atol=1e-15)
    assert torch.equal(grad_all[2], torch.zeros(t, dtype=torch.float64))


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])
def test_rollouts_on_cpu_take_klears_decode_loop(tmp_path, tiny_model, monkeypatch, bf16):
    """The trainer's transformers rollout decodes with klear.generation.decode.grouped_decode on a CPU with one
    process (TRL's fused-LM-head patch of the policy's forward once sent every rollout back to ``generate``); under
    bf16 mixed precision (accelerate wraps the policy's forward in bf16 autocast) inside one bf16 autocast region."""
    import klear.generation.decode as decode

    model, tok = tiny_model
    calls = []
    loop = decode.grouped_decode

    def counted(model, input_ids, *args, **kw):
        under = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
        calls.append((input_ids.shape[0], under))
        return loop(model, input_ids, *args, **kw)

    monkeypatch.setattr(decode, "grouped_decode", counted)
    table = {f"p{i}": [1.0, -1.0] for i in range(4)}
    trainer = GPPOTrainer(
        model=model,
        reward_funcs=_reward_table(table),
        args=_config(tmp_path, max_steps=1, bf16=bf16),  # `klear rl` on a CPU: float32 unless bf16 on AMX
        train_dataset=_dataset(4),
        processing_class=tok,
    )
    trainer.train()
    assert ("_original_forward" in vars(trainer.model)) == bf16  # accelerate's autocast wrapper
    assert calls == [(16, torch.bfloat16 if bf16 else False)]  # one rollout batch: 4 prompts x 4 generations


@pytest.mark.parametrize("source, bf16", [("rollout", False), ("recompute", False), ("rollout", True)])
def test_old_log_prob_from_the_rollout_equals_the_recomputed_one(tmp_path, tiny_model, source, bf16, caplog):
    """``old_log_prob_source='rollout'``: every micro-batch's ``old_per_token_logps`` are the decode loop's sampling
    log-probs, equal to the log-prob pass over the same tensors (float32 rounding), and no such pass runs; with
    responses of different lengths (a seventh of the vocabulary ends one) and a filtered zero-advantage group. Under
    bf16 mixed precision (the loop samples in bf16 autocast) the pass runs, with a warning."""
    model, tok = tiny_model
    model.generation_config.eos_token_id = list(range(1, model.config.vocab_size, 7))
    table = {f"p{i}": [1.0, -1.0] for i in range(4)}
    table["p0"] = [1.0]  # a zero-advantage group: filtered before the micro-batches are rebuilt
    trainer = GPPOTrainer(
        model=model,
        reward_funcs=_reward_table(table),
        args=_config(tmp_path, max_steps=1, bf16=bf16, old_log_prob_source=source),
        train_dataset=_dataset(4),
        processing_class=tok,
    )
    passes, checked, lengths, kept = [], [], [], []
    fill = trainer._old_log_probs
    policy_log_probs = trainer._policy_log_probs

    def counted(*a, **kw):
        passes.append(torch.is_grad_enabled())
        return policy_log_probs(*a, **kw)

    def check(micro_batches):
        trainer._policy_log_probs = counted
        try:
            fill(micro_batches)
        finally:
            trainer._policy_log_probs = policy_log_probs
        for mb in micro_batches:  # before any update: the recomputed log-probs of the same policy
            with torch.no_grad():
                recomputed, _ = policy_log_probs(trainer.model, mb)
            mask = mb["completion_mask"].bool()
            assert mb["old_per_token_logps"].shape == recomputed.shape
            torch.testing.assert_close(mb["old_per_token_logps"][mask], recomputed[mask], rtol=0, atol=1e-4)
            checked.append(int(mask.sum()))
            lengths.extend(mask.sum(1).tolist())
            kept.append(int(mb["klear_keep"].sum()))

    trainer._old_log_probs = check
    trainer.train()
    assert sum(checked) > 0
    assert min(lengths) < max(lengths) == 6  # some responses ended early, some ran to the limit
    assert sum(kept) == 12  # 16 samples, the zero-advantage group's 4 filtered
    assert passes == ([] if source == "rollout" and not bf16 else [False] * len(checked))
    assert ("old_log_prob is recomputed" in caplog.text) == (source == "rollout" and bf16)


def test_old_log_prob_source_is_validated(tmp_path, capsys, tiny_model):
    from klear.cli import main

    # through `klear rl`, before any model loads
    assert main(["rl", "--config", "rl_bench_arith", "--dry-run", "trainer.old_log_prob_source=sampler"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(
        "trainer: GPPOConfig.old_log_prob_source='sampler' is unknown; expected one of ('recompute', 'rollout')"
    )
    with pytest.raises(ValueError, match="old_log_prob_source='sampler' is unknown"):
        _config(tmp_path, old_log_prob_source="sampler")
    with pytest.raises(ValueError, match="no old entropies, which loss_mode='gppo_erc' needs"):
        _config(tmp_path, old_log_prob_source="rollout", loss_mode="gppo_erc")
    with pytest.raises(ValueError, match=r"generation_kwargs overriding \['temperature'\]"):
        _config(tmp_path, old_log_prob_source="rollout", generation_kwargs={"temperature": 0.5})
    model, tok = tiny_model
    with pytest.raises(ValueError, match="tool calls and a rollout_func bypass"):
        GPPOTrainer(
            model=model,
            reward_funcs=_reward_table({"p0": [1.0]}),
            args=_config(tmp_path, old_log_prob_source="rollout", bf16=False),
            train_dataset=_dataset(4),
            processing_class=tok,
            rollout_func=lambda prompts, trainer: {},
        )
