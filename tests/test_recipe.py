"""klear.recipe: the typed recipe sections are the one home of each default and each range check, and the jobs
read their defaults from there."""

import ast
import dataclasses
import inspect

import pytest

import klear.recipe as R
from klear.config import load_config
from klear.recipe import UNSET, build_section

SECTIONS = [
    R.EvalSection,
    R.SFTEvalSection,
    R.RewardSection,
    R.RLDataSection,
    R.SFTDataSection,
    R.RLRecipe,
    R.SFTRecipe,
]


def _field_docstrings(cls) -> set[str]:
    """Names of the fields the class body itself documents with a string right after the field."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        node.target.id
        for node, following in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    documented = set().union(*(_field_docstrings(k) for k in cls.__mro__ if k.__module__ == "klear.recipe"))
    missing = {f.name for f in dataclasses.fields(cls)} - documented
    assert not missing, f"{cls.__name__}: document {sorted(missing)}"


@pytest.mark.parametrize(
    "cls, value, message",
    [
        (R.EvalSection, {"n_samples": 0}, "eval.n_samples=0 must be an integer >= 1"),
        (R.EvalSection, {"n_samples": 4}, "eval.n_samples > 1 needs eval.temperature > 0"),
        (R.EvalSection, {"batchsize": 4}, "'batchsize' (did you mean 'batch_size'?) in 'eval'"),
        (R.SFTEvalSection, {"every_steps": 2}, "eval.every_steps is a klear rl setting"),
        (R.RewardSection, {"reward_mode": "binary"}, "reward.reward_mode='binary' must be 'soft' or 'hard'"),
        (R.RewardSection, {"timeout_s": -1}, "reward.timeout_s=-1 must be a number >= 0"),
        (R.RewardSection, {"require_think": "yes"}, "reward.require_think='yes' must be true or false"),
        (R.RLDataSection, {"train": "reasoning_gym"}, "data.train=reasoning_gym needs data.tasks"),
        (R.RLDataSection, {"train": "x.jsonl", "train_size": 0}, "data.train_size=0 must be an integer >= 1"),
        (R.SFTDataSection, {"train": "teacher", "tasks": [{}]}, "data.train_size is required"),
        (R.SFTDataSection, {"train": "f.jsonl", "easy_pass_rate": -1}, "data.easy_pass_rate=-1 must be a number"),
        (R.SFTDataSection, {"train": "f.jsonl", "filter": "all"}, "data.filter='all' must be none, correct or"),
        # found by feeding klear bad inputs: each used to pass the plan and fail later (or not at all)
        (R.EvalSection, {"temperature": float("nan")}, "eval.temperature=nan must be a number >= 0"),
        (R.EvalSection, {"temperature": float("inf")}, "eval.temperature=inf must be a number >= 0"),
        (R.RewardSection, {"timeout_s": 0}, "reward.timeout_s=0 must be a number of seconds > 0"),
        (R.RLDataSection, {"tasks": [{}], "few_shot": 5}, "data.few_shot=5 must be a list of {role, content}"),
        (R.RLDataSection, {"tasks": [{}], "instruction": ["x"]}, "data.instruction=['x'] must be a string"),
        (R.RLDataSection, {"tasks": "foo"}, "data.tasks='foo' must be a non-empty list of"),
        (R.RLDataSection, {"tasks": [{}], "heldout": 5}, "data.heldout=5 must be a string"),
        (R.RLDataSection, {"tasks": [{}], "system_prompt": 5}, "data.system_prompt=5 must be a string"),
        (R.RLDataSection, {"train": "humaneval", "heldout": "reasoning_gym"}, "data.train=humaneval takes"),
        (R.SFTDataSection, {"train": "f.jsonl", "easy_pass_rate": 2}, "data.easy_pass_rate=2 must be a pass rate"),
        (R.SFTDataSection, {"train": "f.jsonl", "data_source": ["x"]}, "data.data_source=['x'] must be a string"),
        (R.RLRecipe, {"model": "m", "output_dir": 5, "data": {}, "trainer": {}}, "output_dir=5 must be a string"),
    ],
)
def test_a_section_refuses_out_of_range_values_naming_the_file_and_key(cls, value, message):
    with pytest.raises(ValueError, match="^r.yaml: ") as e:
        build_section(cls, value, "r.yaml")
    assert message in str(e.value)


def test_defaults_live_in_the_sections():
    rl = build_section(R.RLRecipe, {"model": "m", "output_dir": "o", "data": {"tasks": [{}]}, "trainer": {}}, "r")
    assert (rl.seed, rl.trainer_impl, rl.context_length) == (0, "klear", None)
    assert (rl.data.train, rl.data.train_size, rl.data.heldout_size, rl.data.heldout) == ("reasoning_gym", 32, 0, None)
    assert (rl.eval.batch_size, rl.eval.max_new_tokens, rl.eval.n_samples, rl.eval.temperature) == (64, None, 1, 0.0)
    assert rl.reward.scorer_kwargs() == {"reward_mode": "soft"}  # the scorer's own defaults for the rest
    sft = build_section(R.SFTRecipe, {"model": "m", "output_dir": "o", "data": {"train": "f"}, "trainer": {}}, "r")
    assert (sft.eval.batch_size, sft.eval.max_new_tokens) == (32, 512)
    assert (sft.data.filter, sft.data.easy_pass_rate, sft.data.data_source) == ("none", 0.5, "math_reasoning_gym")


def test_a_key_left_to_its_consumer_is_passed_only_when_set():
    data = build_section(R.RLDataSection, {"tasks": [{}], "few_shot": None}, "r")
    assert data.system_prompt is UNSET
    assert data.given("few_shot", "system_prompt") == {"few_shot": None}  # null turns the worked example off


def test_klear_rl_builds_its_data_from_the_section_defaults():
    """A recipe without data.train_size gets RLDataSection's 32 (the job used to read a literal of its own)."""
    from klear.rl.job import _build_datasets, build_rl_recipe

    config, path = load_config("rl_demo")
    del config["data"]["train_size"], config["data"]["heldout_size"]
    config["data"]["heldout"] = "none"
    recipe = build_rl_recipe(config, str(path))
    train, heldout = _build_datasets(recipe.data, 0)
    assert (len(train), heldout) == (R.RLDataSection.train_size, None)


def test_a_null_eval_budget_is_the_stage_s():
    from klear.runs import eval_settings

    settings = eval_settings({"eval": {"max_new_tokens": None}}, max_new_tokens=7, batch_size=1, seed=0)
    assert settings["max_new_tokens"] == 7


def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"model: \xff\n")
    with pytest.raises(ValueError, match=f"^{path}: not valid UTF-8"):
        load_config(str(path))
