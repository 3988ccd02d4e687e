"""klear.eval.backends: the context / YaRN plan, the HF backend on a tiny model, vLLM engine arguments."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from conftest import small_llama_config
from klear.cli import main
from klear.eval.backends import (
    GenerationRequest,
    HFBackend,
    SamplingSettings,
    apply_rope_plan,
    build_vllm_kwargs,
    plan_context,
    sample_seed,
    select_backend,
)
from klear.eval.benchmarks import load_benchmark
from klear.eval.harness import read_samples, run_eval

cfg = small_llama_config


# ------------------------------------------------------------------------------- rope plan
def test_yarn_plan_keys_and_scaled_engine_length():
    plan = plan_context(cfg(), max_tokens=65536 - 1000, max_prompt_tokens=1000, rope_scaling="yarn", rope_factor=2.5)
    assert plan["source"] == "override" and plan["engine_max_len"] == 81920
    assert plan["override"] == {
        "rope_type": "yarn",
        "factor": 2.5,
        "original_max_position_embeddings": 32768,
        "rope_theta": 1e6,
    }
    assert "type" not in plan["override"]
    c = apply_rope_plan(cfg(), plan)
    assert c.rope_parameters["rope_type"] == "yarn" and c.max_position_embeddings == 81920
    kw = build_vllm_kwargs("m", plan)
    assert kw["max_model_len"] == 65536  # the run's need, beyond the unscaled 32768
    assert kw["hf_overrides"]["max_position_embeddings"] == 81920
    assert kw["hf_overrides"][plan["config_key"]]["rope_type"] == "yarn"
    assert kw["hf_overrides"][plan["config_key"]]["original_max_position_embeddings"] == 32768


def test_yarn_refused_within_native_context_unless_forced():
    with pytest.raises(ValueError, match="YaRN refused"):
        plan_context(cfg(), max_tokens=32000, max_prompt_tokens=500, rope_scaling="yarn")
    forced = plan_context(cfg(), max_tokens=32000, max_prompt_tokens=500, rope_scaling="yarn", force=True)
    assert forced["engine_max_len"] == 81920


def test_budget_checks_and_native_context():
    with pytest.raises(ValueError, match="exceeds the model's context of 32768"):
        plan_context(cfg(), max_tokens=32768, max_prompt_tokens=100)
    with pytest.raises(ValueError, match="exceeds the YaRN context"):
        plan_context(cfg(), max_tokens=90000, max_prompt_tokens=100, rope_scaling="yarn", rope_factor=2.5)
    none = plan_context(cfg(), max_tokens=30000, max_prompt_tokens=100)
    assert none["source"] == "none" and none["override"] is None and none["engine_max_len"] == 32768
    assert "hf_overrides" not in build_vllm_kwargs("m", none) and build_vllm_kwargs("m", none)["max_model_len"] == 30100
    # a Qwen3-like config (max 40960) whose training context was 32768
    q = plan_context(
        cfg(max_position_embeddings=40960),
        max_tokens=64000,
        max_prompt_tokens=1000,
        rope_scaling="yarn",
        rope_factor=2.5,
        original_max=32768,
    )
    assert q["override"]["original_max_position_embeddings"] == 32768 and q["engine_max_len"] == 81920
    with pytest.raises(ValueError, match="> 1"):
        plan_context(cfg(), max_tokens=64000, max_prompt_tokens=1, rope_scaling="yarn", rope_factor=1.0)


def test_checkpoint_that_already_uses_yarn():
    c = cfg(
        max_position_embeddings=81920,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 2.5,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1e6,
        },
    )
    plan = plan_context(c, max_tokens=64000, max_prompt_tokens=1000)
    assert plan["source"] == "checkpoint" and plan["rope_type"] == "yarn" and plan["engine_max_len"] == 81920
    with pytest.raises(ValueError, match="already uses rope_type 'yarn'"):
        plan_context(c, max_tokens=64000, max_prompt_tokens=1000, rope_scaling="yarn")


def test_select_backend_without_vllm():
    assert select_backend("auto") == "hf"  # no vLLM / no GPU in this environment
    assert select_backend("hf") == "hf"
    with pytest.raises(ValueError, match="not installed"):
        select_backend("vllm")


def test_sampling_settings_validation():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingSettings(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        SamplingSettings(max_tokens=0)
    assert sample_seed(0, "a", 1) == sample_seed(0, "a", 1) != sample_seed(0, "a", 2)


# --------------------------------------------------------------------------- tiny real model
@pytest.fixture()
def tiny_dir(tiny_ckpt):
    return tiny_ckpt


def test_yarn_changes_the_loaded_rotary_embedding(tiny_dir):
    config = AutoConfig.from_pretrained(tiny_dir)  # native 2048
    plain = HFBackend(str(tiny_dir), plan_context(config, max_tokens=16, max_prompt_tokens=100))
    plan = plan_context(config, max_tokens=4000, max_prompt_tokens=100, rope_scaling="yarn", rope_factor=2.5)
    yarn = HFBackend(str(tiny_dir), plan)
    rot_plain = plain.model.model.rotary_emb
    rot_yarn = yarn.model.model.rotary_emb
    assert rot_plain.rope_type == "default" and rot_yarn.rope_type == "yarn"
    assert not torch.allclose(rot_plain.inv_freq, rot_yarn.inv_freq)
    assert rot_yarn.attention_scaling > 1.0 == rot_plain.attention_scaling
    assert yarn.model.config.max_position_embeddings == 5120
    assert yarn.rope["rope_type"] == "yarn" and yarn.rope["inv_freq_scaled"] is True
    assert plain.rope["inv_freq_scaled"] is False


def test_hf_backend_samples_do_not_depend_on_batching(tiny_model):
    model, tok = tiny_model
    plan = plan_context(model.config, max_tokens=12, max_prompt_tokens=50)
    msgs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a prime number below 30."}],
    ]
    reqs = [GenerationRequest(f"p{j}", i, msgs[j], sample_seed(0, f"p{j}", i)) for j in range(2) for i in range(3)]
    # top-p 1: a random model's near-uniform distribution puts thousands of tokens within float
    # rounding of the nucleus boundary (see the backends docstring)
    s = SamplingSettings(temperature=0.6, top_p=1.0, max_tokens=12)
    a = HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=6).generate(reqs, s)
    b = HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=2).generate(reqs[::-1], s)[::-1]
    single = HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=1).generate([reqs[4]], s)
    assert [c.text for c in a] == [c.text for c in b]
    assert single[0] == a[4]
    assert len({c.text for c in a}) > 1  # samples of one problem differ
    assert all(c.n_tokens == 12 and c.finish_reason == "length" for c in a)


def test_hf_backend_stop_token_count_and_finish_reason(tiny_model):
    model, tok = tiny_model
    plan = plan_context(model.config, max_tokens=10, max_prompt_tokens=50)
    be = HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=2)
    req = GenerationRequest("p", 0, [{"role": "user", "content": "Hi"}], 1)
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=10)
    first = be.generate([req], greedy)[0]
    enc = tok(
        [tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)],
        return_tensors="pt",
        add_special_tokens=False,
    )
    ids = model.generate(**enc, do_sample=False, max_new_tokens=10)[0, enc["input_ids"].shape[1] :].tolist()
    assert tok.decode(ids, skip_special_tokens=True) == first.text  # temperature 0 is greedy
    be.eos_ids = [ids[3]] if ids[3] not in ids[:3] else [ids[0]]  # pretend a generated token is the stop token
    expect = ids.index(be.eos_ids[0]) + 1
    stopped = be.generate([req], greedy)[0]
    assert stopped.finish_reason == "stop" and stopped.n_tokens == expect
    assert first.finish_reason == "length" and first.n_tokens == 10


def test_resume_with_the_tiny_model_reproduces_the_uninterrupted_run(tmp_path, tiny_model):
    model, tok = tiny_model
    rows = [
        {"id": f"q{i}", "problem": "Add " + " and ".join(["1"] * (i + 1)) + ".", "answer": str(i + 1)} for i in range(3)
    ]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = load_benchmark(str(tmp_path / "b.jsonl"))
    plan = plan_context(model.config, max_tokens=8, max_prompt_tokens=200)
    s = SamplingSettings(temperature=0.6, top_p=1.0, max_tokens=8)
    kw = dict(n=4, sampling=s, seed=1, show_progress=False)
    full = run_eval(bench, HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=4), tmp_path / "a", **kw)

    class Crash(HFBackend):
        calls = 0

        def generate(self, requests, sampling, progress=None):
            self.calls += 1
            if self.calls > 1:
                raise KeyboardInterrupt("simulated kill in generate")
            return super().generate(requests, sampling, progress)

    crash = Crash("tiny", plan, tokenizer=tok, model=model, batch_size=5)
    crash.chunk_size = 5
    with pytest.raises(KeyboardInterrupt, match="simulated kill in generate"):
        run_eval(bench, crash, tmp_path / "b", **kw)
    assert len(read_samples(tmp_path / "b" / "samples.jsonl")) == 5
    resumed = run_eval(bench, HFBackend("tiny", plan, tokenizer=tok, model=model, batch_size=3), tmp_path / "b", **kw)
    assert resumed == full
    key = lambda r: (r["problem_id"], r["sample_index"])  # noqa: E731
    assert sorted(read_samples(tmp_path / "b" / "samples.jsonl"), key=key) == sorted(
        read_samples(tmp_path / "a" / "samples.jsonl"), key=key
    )


def test_cli_refuses_yarn_within_native_context_and_records_forced_yarn(tmp_path, tiny_dir, capsys):
    (tmp_path / "b.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    args = [
        "eval",
        "--model",
        str(tiny_dir),
        "--benchmark",
        str(tmp_path / "b.jsonl"),
        "--n",
        "2",
        "--max-tokens",
        "4",
        "--backend",
        "hf",
        "--no-progress",
        "--rope-scaling",
        "yarn",
    ]
    assert main(args + ["--output", str(tmp_path / "o1")]) == 2
    assert "YaRN refused" in capsys.readouterr().err
    assert main(args + ["--force-rope-scaling", "--output", str(tmp_path / "o2")]) == 0
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert summary["rope"]["plan"]["override"]["rope_type"] == "yarn"
    assert summary["rope"]["plan"]["engine_max_len"] == 5120
    assert summary["rope"]["loaded"]["rope_type"] == "yarn"
    assert summary["n"] == 2 and set(summary["pass_at_k"]) == {"1", "2"}
    assert "yarn" in (tmp_path / "o2" / "summary.md").read_text()


def test_sampler_temperature_and_top_p():
    from klear.eval.backends import _make_sampler

    rows = 4000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(rows, 1)
    chosen = _make_sampler(range(rows), 1.0, 0.7)(None, logits).argmax(-1)
    counts = torch.bincount(chosen, minlength=4).tolist()
    assert counts[2] == counts[3] == 0  # outside the 0.7 nucleus {0, 1}
    assert counts[0] / rows == pytest.approx(0.5 / 0.8, abs=0.03)
    full = torch.bincount(_make_sampler(range(rows), 1.0, 1.0)(None, logits).argmax(-1), minlength=4).tolist()
    assert [c / rows for c in full] == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)
    assert _make_sampler(range(3), 0.0, 0.95)(None, logits[:3]).argmax(-1).tolist() == [0, 0, 0]
    # the same seeds give the same draws
    again = _make_sampler(range(rows), 1.0, 0.7)(None, logits).argmax(-1)
    assert torch.equal(again, chosen)


def test_a_yarn_plan_that_did_not_reach_the_model_is_an_error(tiny_model):
    model, tok = tiny_model  # loaded without the override: default rope, native length
    plan = plan_context(model.config, max_tokens=4000, max_prompt_tokens=100, rope_scaling="yarn")
    with pytest.raises(RuntimeError, match="did not take effect"):
        HFBackend("tiny", plan, tokenizer=tok, model=model)


@pytest.mark.parametrize("scale", [8.0, 0.1])  # peaked: nucleus in the top 1024; flat: full sort
def test_sampler_matches_a_reference_nucleus_sampler(scale):
    from klear.eval.backends import _make_sampler

    torch.manual_seed(1)
    rows, temp, top_p = 32, 0.6, 0.95
    x = torch.randn(rows, 5000) * scale
    got = _make_sampler(range(rows), temp, top_p)(None, x).argmax(-1)
    probs = torch.softmax(x / temp, -1)
    sp, _ = probs.sort(-1, descending=True)
    n_keep = ((sp.cumsum(-1) - sp) < top_p).sum(-1, keepdim=True)
    kept = torch.where(probs >= sp.gather(1, n_keep - 1), probs, torch.zeros_like(probs))
    assert (n_keep.max() > 1024) == (scale < 1)
    cum = kept.double().cumsum(-1)
    u = (
        torch.stack(
            [torch.rand((), generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(rows)]
        )
        * cum[:, -1]
    )
    want = torch.searchsorted(cum, u.unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(got, want)
    assert bool((kept.gather(1, got.unsqueeze(1)) > 0).all())
