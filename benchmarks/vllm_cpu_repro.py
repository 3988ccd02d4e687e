"""Minimal reproductions of the three vLLM 0.32 CPU-backend problems klear works around (for upstream reports).

Each runs on an in-process engine (``external_launcher``, as TRL's colocate mode builds it) on a small HF
checkpoint (default: klear's embedded SmolLM2-135M-Instruct, float32, tied embeddings) and prints
``REPRODUCED`` or ``not reproduced``:

1. **Seeded request + split prefill**: with chunked prefill on, a request with ``SamplingParams(seed=...)``
   whose prompt is split over steps makes ``GPUModelRunner._bookkeeping_sync`` call
   ``generator.set_offset(generator.get_offset() - 4)``; a CPU ``torch.Generator`` has no offset:
   ``RuntimeError: CPU Generator does not use offset``. (klear: chunked prefill off on CPU.)
2. **``model.load_weights`` after loading** (what TRL's colocate weight sync calls): the CPU backend's
   ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` replaced each linear weight by an empty
   ``Parameter`` without ``weight_loader``: ``AttributeError: 'Parameter' object has no attribute
   'weight_loader'``.
3. **``model_runner.reload_weights(weights_iterator=...)`` with a tied ``lm_head``**: every layer is
   re-packed except the ``ParallelLMHead`` tied to ``embed_tokens`` (it receives no tensor; vLLM logs
   "ParallelLMHead: Failed to load weights"), so the logits still come from the old weights.
   (klear: re-run the vocabulary layers' ``process_weights_after_loading``.)

Usage: ``.venv-vllm/bin/python benchmarks/vllm_cpu_repro.py [--model PATH]``.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: klear's embedded model)")
    args = p.parse_args()
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
    ):
        os.environ.setdefault(key, value)
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    if args.model is None:
        from klear.models.embedded import embedded_model_path

        args.model = str(embedded_model_path())
    common = dict(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        distributed_executor_backend="external_launcher",
        max_model_len=1024,
        seed=0,
    )

    # 1. seeded requests whose prompts are split by chunked prefill (a 64-token budget, 200-token prompts)
    llm = LLM(**common, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=4)
    try:
        llm.generate(
            [{"prompt_token_ids": list(range(100, 300))}] * 2,
            [SamplingParams(max_tokens=4, seed=s) for s in (1, 2)],
            use_tqdm=False,
        )
        print("1. seeded request, split prefill: not reproduced")
    except RuntimeError as e:
        print(f"1. seeded request, split prefill: REPRODUCED: RuntimeError: {e}")
    del llm

    llm = LLM(**common)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with torch.no_grad():  # a "training step": new weights for every tensor
        for q in hf.parameters():
            q.add_(torch.randn_like(q) * 0.02)

    # 2. TRL 1.16's colocate sync
    try:
        for name, q in hf.named_parameters():
            runner.model.load_weights([(name, q.data)])
        print("2. model.load_weights after loading: not reproduced")
    except AttributeError as e:
        print(f"2. model.load_weights after loading: REPRODUCED: AttributeError: {e}")

    # 3. vLLM's in-place reload, then the engine's log-probs vs the new HF weights'
    ids = list(range(100, 140))
    runner.reload_weights(weights_iterator=((n, q.data) for n, q in hf.named_parameters()), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    engine = torch.tensor([next(iter(d.values())).logprob for d in out[0].prompt_logprobs[1:]])
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    new = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    gap = (engine - new).abs().max().item()
    tied = hf.config.tie_word_embeddings
    verdict = "REPRODUCED" if gap > 1e-3 else "not reproduced"
    print(f"3. reload_weights, tied lm_head={tied}: max |engine - new weights| log-prob {gap:.2e}: {verdict}")


if __name__ == "__main__":
    main()
