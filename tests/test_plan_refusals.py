"""The recipe settings issue 23 named, refused at plan time on the shipped ``rl_demo`` recipe: by
``klear experiment`` before any arm runs, and by ``klear rl`` before any model or tokenizer loads."""

import pytest
import yaml

from conftest import write_experiment
from klear.cli import main

BAD = [
    ("trainer.loss_mode", "gppo_typo", "trainer: unknown loss_mode 'gppo_typo'"),
    ("trainer.clip_ratio_low", 1.0, "trainer: clip_ratio_low must be < 1.0, got 1.0"),
    ("trainer.alpha", -0.1, "trainer: alpha must be >= 0.0, got -0.1"),
    ("trainer.alhpa", 0.1, "'alhpa' (did you mean 'alpha'?)"),
    ("data.train_sise", 8, "'train_sise' (did you mean 'train_size'?)"),
    ("data.data_source", "foo", "data.data_source='foo': no reward scorer for data_source 'foo'"),
]


@pytest.fixture
def no_model(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


def _error(capsys, command):
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"klear {command}: error:")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("key, value, message", BAD, ids=[b[0] for b in BAD])
def test_klear_experiment_refuses_a_bad_arm_before_any_arm_runs(
    tmp_path, capsys, monkeypatch, no_model, key, value, message
):
    monkeypatch.setattr("klear.rl.job.run_rl", lambda *a, **k: pytest.fail("a run started"))
    arms = {"gppo": {}, "bad": {key: value}}
    path = write_experiment(
        tmp_path / "bad_arm.yaml", "the second arm has a bad setting", "rl_demo", arms, tmp_path / "exp"
    )
    assert main(["experiment", "--config", str(path)]) == 2
    err = _error(capsys, "experiment")
    assert "arm bad, seed 0" in err and message in err, err
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("key, value, message", BAD, ids=[b[0] for b in BAD])
def test_klear_rl_refuses_a_bad_setting_before_any_model_loads(tmp_path, capsys, no_model, key, value, message):
    out = tmp_path / "run"
    assert main(["rl", "--config", "rl_demo", f"output_dir={out}", f"{key}={value}"]) == 2
    assert message in _error(capsys, "rl")
    assert not out.exists()


def test_klear_experiment_names_a_misspelt_top_level_key(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "base": "rl_demo", "arms": {"a": {}}, "seed": [0]}))
    assert main(["experiment", "--config", str(path)]) == 2
    assert "unknown key(s) 'seed' (did you mean 'seeds'?) in the top level" in _error(capsys, "experiment")


@pytest.mark.parametrize("key, value, message", BAD[:3], ids=[b[0] for b in BAD[:3]])
def test_loss_settings_are_checked_from_the_mapping_before_the_trainer_arguments(monkeypatch, key, value, message):
    from klear.config import load_config
    from klear.rl.job import build_rl_recipe
    from klear.rl.trainer import GPPOConfig

    def refuse(self, *args, **kwargs):
        raise AssertionError("the trainer arguments were built")

    monkeypatch.setattr(GPPOConfig, "__init__", refuse)
    config, path = load_config("rl_demo", [f"{key}={value}"])
    with pytest.raises(ValueError, match="trainer: ") as e:
        build_rl_recipe(config, str(path))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "field, message",
    [
        ({"reference": ["gppo"]}, "reference=['gppo'] is not an arm"),
        ({"output_dir": 5}, "output_dir must be a string, got 5"),
        ({"name": "../escape"}, "name '../escape' must be letters, digits"),
    ],
)
def test_a_malformed_experiment_file_is_one_line(tmp_path, capsys, field, message):
    spec = {"name": "x", "base": "rl_demo", "arms": {"gppo": {}}, "seeds": [0], **field}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["experiment", "--config", str(path)]) == 2
    assert message in _error(capsys, "experiment")


def test_rl_and_sft_rows_need_a_user_message(tmp_path):
    import json

    from klear.data.rl_data import load_rl_file
    from klear.sft.data import load_sft_file

    rl = tmp_path / "rl.jsonl"
    rl.write_text(
        json.dumps({"prompt": [{"role": "system", "content": "be nice"}], "reward_model": {"ground_truth": "1"}}) + "\n"
    )
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' has no message with role 'user'"):
        load_rl_file(rl, default_data_source="math_test")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}], "response": "ok"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: field 'prompt' has no message with role 'user'"):
        load_sft_file(sft)


def test_klear_rl_refuses_data_smaller_than_one_rollout_batch(tmp_path, tiny_ckpt, capsys, monkeypatch):
    """TRL's sampler drops an incomplete rollout batch: 8 prompts with 16 per batch used to train 0 steps silently."""
    import transformers

    from conftest import rl_recipe

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded")
    )
    recipe = rl_recipe(tmp_path, tiny_ckpt, eval_settings={"enabled": False}, per_device_train_batch_size=32)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["rl", "--config", str(path)]) == 2
    assert "data.train has 8 prompts, fewer than one rollout batch of 16" in _error(capsys, "rl")
    assert not (tmp_path / "run").exists()


def test_a_shipped_recipe_of_the_other_stage_is_named(capsys):
    assert main(["rl", "--config", "sft_demo", "--dry-run"]) == 2
    assert "sft_demo is a klear sft recipe: run klear sft --config sft_demo" in _error(capsys, "rl")
    assert main(["sft", "--config", "rl_demo", "--dry-run"]) == 2
    assert "rl_demo is a klear rl recipe: run klear rl --config rl_demo" in _error(capsys, "sft")


def test_sft_help_has_no_rl_only_flag(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    assert "--prompt-tokens" not in capsys.readouterr().out


@pytest.mark.parametrize("stage", ["rl", "sft"])
def test_stage_help_names_every_shipped_recipe_of_the_stage(capsys, stage):
    """``klear rl/sft --help`` lists the shipped ``<stage>_*`` recipes from the configs directory (a hand-kept list
    had drifted: it missed rl_bench_sums_code and sft_bench_arith)."""
    from klear.config import CONFIG_DIR

    with pytest.raises(SystemExit):
        main([stage, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = sorted(p.stem for p in CONFIG_DIR.glob(f"{stage}_*.yaml"))
    assert len(names) >= 3 and f"({', '.join(names)}); default {stage}_demo" in text
