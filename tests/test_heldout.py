import math

import pytest
import torch

from klear.eval.heldout import evaluate, generate
from klear.stats import paired_difference

Z95 = 1.959963984540054  # Phi^-1(0.975)


# ------------------------------------------------------------------ paired_difference


def test_paired_difference_symmetric_case():
    # d = [0, 1, 0, -1]: mean 0, sample var = (1 + 1) / 3
    r = paired_difference([1, 0, 0, 1], [1, 1, 0, 0])
    assert r["n"] == 4 and r["before"] == 0.5 and r["after"] == 0.5
    assert r["mean_diff"] == 0.0
    half = Z95 * math.sqrt(2 / 3) / 2
    assert r["ci_low"] == pytest.approx(-half) and r["ci_high"] == pytest.approx(half)
    assert (r["n_improved"], r["n_worsened"]) == (1, 1)
    # b = c = 1: 2 * (C(2,0) + C(2,1)) / 4 = 1.5 -> capped at 1
    assert r["mcnemar_p"] == 1.0


def test_paired_difference_all_improve():
    before = [False] * 10
    after = [True] * 8 + [False] * 2
    r = paired_difference(before, after)
    assert r["mean_diff"] == pytest.approx(0.8)
    sd = math.sqrt((8 * 0.2**2 + 2 * 0.8**2) / 9)  # 0.42164
    assert r["ci_low"] == pytest.approx(0.8 - Z95 * sd / math.sqrt(10))
    assert r["ci_high"] == pytest.approx(0.8 + Z95 * sd / math.sqrt(10))
    assert r["ci_low"] == pytest.approx(0.53867, abs=1e-4)
    assert (r["n_improved"], r["n_worsened"]) == (8, 0)
    assert r["mcnemar_p"] == pytest.approx(2 / 2**8)  # 0.0078125


def test_paired_difference_mixed_and_confidence():
    # 7 improved, 2 worsened, 3 concordant (2 both right, 1 both wrong)
    before = [0] * 7 + [1] * 2 + [1, 1, 0]
    after = [1] * 7 + [0] * 2 + [1, 1, 0]
    r = paired_difference(before, after, confidence=0.90)
    assert (r["n_improved"], r["n_worsened"], r["n"]) == (7, 2, 12)
    assert r["before"] == pytest.approx(4 / 12) and r["after"] == pytest.approx(9 / 12)
    assert r["mean_diff"] == pytest.approx(5 / 12)
    # exact two-sided: 2 * (C(9,0) + C(9,1) + C(9,2)) / 2^9 = 92 / 512
    assert r["mcnemar_p"] == pytest.approx(92 / 512)
    m = 5 / 12
    var = (7 * (1 - m) ** 2 + 2 * (-1 - m) ** 2 + 3 * m**2) / 11
    half = 1.6448536269514722 * math.sqrt(var / 12)
    assert r["ci_low"] == pytest.approx(m - half) and r["ci_high"] == pytest.approx(m + half)


def test_paired_difference_constant_difference_collapses_ci():
    r = paired_difference([0, 0, 0], [1, 1, 1])
    assert r["mean_diff"] == r["ci_low"] == r["ci_high"] == 1.0
    assert r["mcnemar_p"] == pytest.approx(2 / 8)
    r = paired_difference([1, 0], [1, 0])
    assert r["mean_diff"] == r["ci_low"] == r["ci_high"] == 0.0 and r["mcnemar_p"] == 1.0


def test_paired_difference_errors():
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([1], [0])
    with pytest.raises(ValueError, match="confidence"):
        paired_difference([1, 0], [0, 1], confidence=1.0)


# ------------------------------------------------------------------ generate / evaluate


@pytest.fixture(scope="module")
def tiny():
    from klear.models.embedded import tiny_random_model

    return tiny_random_model(hidden_size=32, num_layers=1)


class LengthEchoModel(torch.nn.Module):
    """Fake LM whose 'completion' is the number of real (unpadded) prompt tokens.

    It also checks that padding is on the left, i.e. the prompt ends at the last column.
    """

    def __init__(self, tokenizer, width=4):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok = tokenizer
        self.width = width
        self.calls = []
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig()

    def generate(self, input_ids, attention_mask, generation_config=None, **kw):
        assert not self.training and not torch.is_grad_enabled()
        assert bool(attention_mask[:, -1].all()), "prompts must be LEFT padded"
        self.calls.append(input_ids.shape[0])
        new = []
        for n in attention_mask.sum(1).tolist():
            ids = self.tok(str(n), add_special_tokens=False)["input_ids"]
            ids = ids + [self.tok.eos_token_id] * (self.width - len(ids))
            new.append(ids[: self.width])
        return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype)], dim=1)


def _prompts():
    return [[{"role": "user", "content": "word " * k}] for k in (5, 1, 9, 3, 7)] + ["plain string prompt"]


def test_generate_preserves_order_and_decodes_only_new_tokens(tiny):
    _, tok = tiny
    model = LengthEchoModel(tok)
    model.train()
    tok.padding_side = "right"
    prompts = _prompts()
    out = generate(model, tok, prompts, max_new_tokens=4, batch_size=4, do_sample=True, show_progress=False)
    expected = []
    for p in prompts:
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else p
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        expected.append(str(len(tok(text, add_special_tokens=False)["input_ids"])))
    assert out == expected
    assert model.calls == [4, 2]
    assert tok.padding_side == "right"  # restored
    assert model.training  # training flag restored
    assert generate(model, tok, [], max_new_tokens=4, do_sample=True) == []
    assert generate(model, tok, [], max_new_tokens=4) == []


def test_generate_real_tiny_model(tiny):
    model, tok = tiny
    tok.padding_side = "right"
    prompts = _prompts()[:3]
    out = generate(model, tok, prompts, max_new_tokens=3, batch_size=2, show_progress=False)
    assert len(out) == 3 and all(isinstance(o, str) for o in out)
    assert all("<|im_end|>" not in o and "<|im_start|>" not in o for o in out)
    assert tok.padding_side == "right"
    assert generate(model, tok, prompts, max_new_tokens=3, batch_size=2, show_progress=False) == out  # greedy
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        generate(model, tok, prompts, max_new_tokens=0)


def test_sampled_generate_decodes_with_klears_loop_on_cpu(tiny, monkeypatch):
    """The held-out evaluation's sampled path (one sample per problem, as ``klear rl``'s avg@1) decodes with klear's
    CPU loop (klear.generation.decode), not ``model.generate``; with ``group_size`` too."""
    model, tok = tiny
    monkeypatch.setattr(model, "generate", lambda **kw: pytest.fail("model.generate was called"))
    prompts = _prompts()[:3]
    out = generate(model, tok, prompts, max_new_tokens=3, batch_size=2, do_sample=True, show_progress=False)
    assert len(out) == 3 and all(isinstance(o, str) for o in out)
    grouped = [p for p in prompts for _ in range(2)]
    assert len(generate(model, tok, grouped, max_new_tokens=3, batch_size=2, do_sample=True, group_size=2)) == 6


def test_evaluate_with_stub_scorer(tiny):
    model, tok = tiny
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i} " * (i + 1)}],
            "data_source": "stub",
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"index": i},
            "prompt_id": f"p{i}",
        }
        for i, gt in enumerate(["yes", "no", "yes", "yes", "no"])
    ]
    seen = {}

    def scorer(data_sources, solution_strs, ground_truths, extra_infos=None):
        seen["args"] = (list(data_sources), list(solution_strs), list(ground_truths), list(extra_infos))
        return [1.0 if g == "yes" else -1.0 for g in ground_truths]

    import datasets

    for data in (rows, datasets.Dataset.from_list(rows)):
        res = evaluate(model, tok, data, max_new_tokens=2, batch_size=2, scorer=scorer)
        assert res["n"] == 5
        assert res["correct"] == [True, False, True, True, False]
        assert res["rewards"] == [1.0, -1.0, 1.0, 1.0, -1.0]
        assert res["accuracy"] == pytest.approx(0.6)
        assert res["prompt_ids"] == ["p0", "p1", "p2", "p3", "p4"]
        assert len(res["completions"]) == 5
        ds_, sols, gts, infos = seen["args"]
        assert ds_ == ["stub"] * 5 and sols == res["completions"]
        assert gts == ["yes", "no", "yes", "yes", "no"] and [x["index"] for x in infos] == list(range(5))

    def bad_scorer(*a, **k):
        return [1.0]

    with pytest.raises(ValueError, match="scorer returned 1 scores for 5"):
        evaluate(model, tok, rows, max_new_tokens=1, scorer=bad_scorer)


def test_evaluate_sampled_avg_at_n(tiny):
    """avg@n: n samples per problem, per-problem fraction correct, seeded (same samples twice), caller's RNG kept."""
    model, tok = tiny
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "data_source": "stub",
            "reward_model": {"style": "rule", "ground_truth": "x"},
            "prompt_id": f"p{i}",
        }
        for i in range(3)
    ]

    def scorer(data_sources, solution_strs, ground_truths, extra_infos=None):
        return [1.0 if len(s) % 2 == 0 else -1.0 for s in solution_strs]

    def sample():
        return evaluate(
            model,
            tok,
            rows,
            max_new_tokens=5,
            batch_size=4,
            scorer=scorer,
            n_samples=4,
            temperature=1.0,
            seed=7,
            show_progress=False,
        )

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    res = sample()
    assert torch.equal(torch.rand(3), expected_next)  # sampling used its own generator
    assert res["n"] == 3 and res["samples_per_problem"] == 4 and len(res["completions"]) == 12
    hits = [r == 1.0 for r in res["rewards"]]
    assert res["correct"] == [sum(hits[i * 4 : (i + 1) * 4]) / 4 for i in range(3)]
    assert res["accuracy"] == pytest.approx(sum(hits) / 12)
    assert len(set(res["completions"][:4])) > 1  # four different samples of problem 0
    again = sample()
    assert again["completions"] == res["completions"]
    with pytest.raises(ValueError, match="must be > 0 to draw n_samples=2"):
        evaluate(model, tok, rows, max_new_tokens=5, scorer=scorer, n_samples=2)


def test_evaluate_refuses_an_unscored_sample(tiny):
    """The before/after comparison is paired per problem: a sample the judge could not score (nan) is an error
    naming it, never a wrong answer."""
    model, tok = tiny
    rows = [
        {"prompt": [{"role": "user", "content": "q"}], "data_source": "stub", "reward_model": {"ground_truth": g}}
        | {"prompt_id": f"p{i}"}
        for i, g in enumerate(["yes", "no"])
    ]

    def scorer(data_sources, solution_strs, ground_truths, extra_infos=None):
        return [math.nan if g == "no" else 1.0 for g in ground_truths]

    with pytest.raises(RuntimeError, match=r"held-out problem p1 sample 0: the reward judge could not score"):
        evaluate(model, tok, rows, max_new_tokens=1, scorer=scorer, show_progress=False)
