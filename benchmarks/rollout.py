"""Rollout generation on CPU: transformers ``generate`` (klear's HF path) vs vLLM (klear's colocated vLLM path).

Workload: the CPU demo's (``configs/rl_demo.yaml``): the embedded SmolLM2-135M-Instruct in float32, 16
reasoning-gym prompts x 8 samples = 128 samples per rollout batch, temperature 0.7, top-p 1, and each of
``--tokens`` (default 32 and 256) response tokens. Every sample is forced to exactly that length (HF
``min_new_tokens``, vLLM ``ignore_eos``), so both sides generate the same number of tokens.

* **HF**: what ``GPPOTrainer`` runs without vLLM: one ``generate`` call on all 128 rows (as TRL makes it),
  each prompt prefilled once per group of 8 (:func:`klear.generation.prefill.grouped_prefill_generate`), torch's
  default thread count.
* **vLLM**: the engine TRL's colocate mode builds (in this process, ``external_launcher``, ``max_num_seqs``
  128, ``max_num_batched_tokens`` 4096, processed log-probs) with klear's CPU settings
  (:func:`klear.generation.vllm.colocated_engine`: float32, eager, torch threads kept), one
  ``SamplingParams(n=1)`` request per row as TRL sends them.

The two run in turns (``--repeats`` rounds) so drift in the machine's load hits both alike; medians are
compared. With ``--rl-steps K`` (default 4: one rollout batch of the demo) it then trains ``GPPOTrainer`` with
the demo's settings for K optimizer steps each way (``use_vllm`` off, and on with klear's weight sync) and
compares TRL's ``step_time``.

Needs vLLM (``make test-vllm`` builds ``.venv-vllm``): ``.venv-vllm/bin/python benchmarks/rollout.py``.
Prints load average and CPU flags at start and end.

``--mode hf-decode`` (no vLLM needed) compares klear's two transformers paths on the same workload instead:
**generate** (the grouped prefill, then transformers' ``generate``, ``fast_decode=False``) and **decode**
(:func:`klear.generation.decode.grouped_decode`: KV buffers written in place, GQA inside ``sdpa``, inverse-CDF
sampling), alternating in one process (``--repeats`` rounds), medians compared; ``--natural`` lets responses end at
their end-of-sequence token (the rollout's real shape; the decode path then also drops finished rows) instead of
forcing every row to the full length. Decode tokens/s counts the generated tokens of the rows that were still
unfinished (the forced-length run: all of them). ``--baseline-rev REV`` adds a third path, **decode@REV**: the loop
as ``src/klear/generation/decode.py`` was at git revision ``REV`` (read with ``git show``), so a change to the loop is
measured against its previous version in the same rounds. ``--bf16`` (a CPU with AMX) adds the two paths a
``trainer.bf16: true`` run takes on a CPU: **generate-bf16** (``generate`` with the policy's forward wrapped in bf16
autocast per call, as accelerate's mixed precision wraps it: klear before this release) and **decode-bf16** (the loop
in one bf16 autocast region, as the trainer now runs its rollouts there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch

from _machine import cpu_flags


def _in_process_env() -> None:
    """The distributed variables TRL's colocate mode sets before building its engine (one process)."""
    from trl.trainer.utils import ensure_master_addr_port

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    ensure_master_addr_port()


def build_engine(model_path: str, memory: float, max_len: int, max_num_seqs: int):
    """A ``vllm.LLM`` with TRL 1.16's colocate arguments plus klear's CPU ones."""
    import trl.generation.vllm_generation as trl_vllm

    from klear.generation.vllm import colocated_engine

    _in_process_env()
    with colocated_engine("float32"):  # TRL's LLM gets klear's CPU arguments inside the block
        return trl_vllm.LLM(
            model=model_path,
            gpu_memory_utilization=memory,
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
            distributed_executor_backend="external_launcher",
            seed=0,
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",
        )


def hf_generate(
    model,
    tok,
    prompt_ids: list[list[int]],
    group: int,
    tokens: int,
    temperature: float,
    fast_decode: bool = False,
    natural: bool = False,
) -> int:
    """One ``generate`` call on all rows (left-padded), prefilled once per group; returns the tokens generated
    (up to and including each row's end-of-sequence token). ``fast_decode``: klear's CPU decode loop instead of
    ``generate``; ``natural``: rows may end before ``tokens``."""
    from transformers import GenerationConfig

    from klear.generation.prefill import grouped_prefill_generate

    rows = [ids for ids in prompt_ids for _ in range(group)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=tokens,
        min_new_tokens=None if natural else tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.no_grad():
        out = grouped_prefill_generate(
            model,
            model.generate,
            input_ids,
            mask,
            group_size=group,
            generation_config=config,
            fast_decode=fast_decode,
        )
    new = out[:, width:]
    if not natural:
        return new.numel()  # min_new_tokens = max_new_tokens: every row has exactly `tokens`
    ended = new == tok.eos_token_id
    first = torch.where(
        ended.any(1), ended.int().argmax(1) + 1, torch.full_like(ended[:, 0], new.shape[1], dtype=torch.long)
    )
    return int(first.sum())


def compare_decode(args) -> None:
    """``--mode hf-decode``: transformers' ``generate`` vs klear's decode loop, alternating, medians."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.config import load_config
    from klear.data.rl_data import make_reasoning_gym_dataset
    from klear.models.embedded import resolve_model_path

    model_path = resolve_model_path("embedded")
    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    demo, _ = load_config("rl_demo")
    data, trainer_cfg = demo["data"], demo["trainer"]
    group, temperature = int(trainer_cfg["num_generations"]), float(trainer_cfg["temperature"])
    n_prompts = trainer_cfg["per_device_train_batch_size"] * trainer_cfg["steps_per_generation"] // group
    dataset = make_reasoning_gym_dataset(data["tasks"], size=n_prompts, seed=0, system_prompt=data.get("system_prompt"))
    prompt_ids = [tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True) for row in dataset]
    prompt_ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in prompt_ids]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}, torch threads "
        f"{torch.get_num_threads()}; {n_prompts} prompts x {group} samples, temperature {temperature}, "
        f"prompt tokens {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))}, "
        f"{'natural lengths' if args.natural else 'forced lengths'}",
        flush=True,
    )
    lengths = [int(x) for x in args.tokens.split(",") if x]
    names = ["generate", "decode"]
    loops = {"decode": None}
    if args.baseline_rev:
        names.append(f"decode@{args.baseline_rev}")
        loops[names[-1]] = _decode_at(args.baseline_rev)
    if args.bf16:
        names += ["generate-bf16", "decode-bf16"]
    results = {}
    for tokens in lengths:
        # prefill-only cost (1 new token) measured apart, so decode tok/s excludes it
        times: dict[str, list[float]] = {k: [] for name in names for k in (name, f"prefill_{name}")}
        counts: dict[str, list[int]] = {name: [] for name in names}
        hf_generate(model, tok, prompt_ids[:2], group, 2, temperature, fast_decode=True)  # warm-up
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                fast = not name.startswith("generate")
                bf16 = name.endswith("-bf16")
                # the loop in one bf16 autocast region, as the trainer runs a rollout there
                region = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and fast else contextlib.nullcontext()
                with _loop(loops.get(name)), _per_forward_autocast(model, bf16 and not fast), region:
                    t0 = time.perf_counter()
                    hf_generate(model, tok, prompt_ids, group, 1, temperature, fast_decode=fast)
                    times[f"prefill_{name}"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    n = hf_generate(
                        model, tok, prompt_ids, group, tokens, temperature, fast_decode=fast, natural=args.natural
                    )
                    times[name].append(time.perf_counter() - t0)
                counts[name].append(n)
                print(
                    f"  {tokens} tokens, {name}: {times[name][-1]:.1f} s ({n} tokens, {n / times[name][-1]:.0f} tok/s "
                    f"with prefill), prefill {times[f'prefill_{name}'][-1]:.2f} s, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        results[tokens] = (
            {k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in counts.items()},
        )
    print(f"\nload average after {os.getloadavg()}")
    print(f"{'tokens':<8}{'path':<16}{'total s':>9}{'prefill s':>11}{'tokens':>8}{'tok/s':>8}{'decode tok/s':>14}")
    for tokens, (t, c) in results.items():
        for name in names:
            decode_s = t[name] - t[f"prefill_{name}"]
            print(
                f"{tokens:<8}{name:<16}{t[name]:>9.2f}{t[f'prefill_{name}']:>11.2f}{c[name]:>8.0f}"
                f"{c[name] / t[name]:>8.0f}{c[name] / decode_s:>14.0f}"
            )
        pairs = [("decode", base) for base in names if base != "decode" and not base.endswith("-bf16")]
        if args.bf16:
            pairs += [("decode-bf16", "generate-bf16"), ("decode-bf16", "generate"), ("decode-bf16", "decode")]
        for new, base in pairs:
            ratio = (c[new] / t[new]) / (c[base] / t[base])
            dec = (c[new] / (t[new] - t[f"prefill_{new}"])) / (c[base] / (t[base] - t[f"prefill_{base}"]))
            print(f"{'':<8}ratio {new}/{base}: total tok/s {ratio:.2f}, decode tok/s {dec:.2f}")


def _decode_at(rev: str):
    """``grouped_decode`` of ``src/klear/generation/decode.py`` as it was at git revision ``rev``."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:src/klear/generation/decode.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "decode_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grouped_decode


@contextlib.contextmanager
def _per_forward_autocast(model, on: bool):
    """Inside the block (``on``), ``model.forward`` runs in bf16 autocast per call, as accelerate's native mixed
    precision wraps a prepared model's forward (it keeps the unwrapped one as ``_original_forward``)."""
    if not on:
        yield
        return
    forward = model.forward
    model._original_forward = forward
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(forward)
    try:
        yield
    finally:
        del model._original_forward
        del model.forward  # the class's forward again


@contextlib.contextmanager
def _loop(grouped_decode):
    """klear's prefill calls ``grouped_decode`` (another version of it inside the block; None: the current one)."""
    import klear.generation.decode as decode

    current = decode.grouped_decode
    if grouped_decode is not None:
        # an older loop may not take the arguments added since; the benchmark passes none of them
        decode.grouped_decode = lambda *a, log_probs=False, **kw: grouped_decode(*a, **kw)
    try:
        yield
    finally:
        decode.grouped_decode = current


def vllm_generate(llm, prompt_ids: list[list[int]], group: int, tokens: int, temperature: float) -> int:
    from vllm import SamplingParams

    params = SamplingParams(n=1, temperature=temperature, top_p=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids for _ in range(group)], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def demo_trainer(kind: str, model_path: str, dataset, tok, out: str, steps: int, memory: float):
    """``GPPOTrainer`` with the demo's trainer settings (float32 on CPU), ``kind`` "hf" or "vllm"."""
    from transformers import PrinterCallback

    from klear.config import load_config
    from klear.generation.vllm import colocated_engine, install_weight_sync
    from klear.rl.trainer import GPPOConfig, GPPOTrainer

    demo, _ = load_config("rl_demo")
    settings = {k: v for k, v in demo["trainer"].items() if k not in ("bf16", "save_steps", "save_total_limit")}
    settings.update(
        output_dir=out,
        max_steps=steps,
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    if kind == "vllm":
        settings.update(
            use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=memory, vllm_max_model_length=512
        )
        _in_process_env()
    args = GPPOConfig(**settings)
    with colocated_engine("float32") if kind == "vllm" else contextlib.nullcontext():
        trainer = GPPOTrainer(model=model_path, args=args, train_dataset=dataset, processing_class=tok)
    if kind == "vllm":
        assert install_weight_sync(trainer)
    trainer.remove_callback(PrinterCallback)
    return trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("vllm", "hf-decode"), default="vllm", help="HF vs vLLM, or HF generate vs decode")
    p.add_argument("--natural", action="store_true", help="hf-decode: responses end at end-of-sequence")
    p.add_argument("--baseline-rev", default=None, help="hf-decode: also the decode loop at this git revision")
    p.add_argument("--bf16", action="store_true", help="hf-decode: also generate and the loop under bf16 autocast")
    p.add_argument("--tokens", default="32,256", help="response lengths, comma-separated (default 32,256)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of (HF, vLLM) per length (default 2)")
    p.add_argument("--rl-steps", type=int, default=4, help="GPPOTrainer optimizer steps each way (0: skip)")
    p.add_argument(
        "--memory",
        type=float,
        default=None,
        help="vLLM gpu_memory_utilization (fraction of host memory; default: sized from the need)",
    )
    args = p.parse_args()
    if args.mode == "hf-decode":
        compare_decode(args)
        return

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from klear.config import load_config
    from klear.data.rl_data import make_reasoning_gym_dataset
    from klear.generation.vllm import cpu_engine_memory_utilization, parameter_count
    from klear.models.embedded import resolve_model_path

    lengths = [int(x) for x in args.tokens.split(",") if x]
    model_path = resolve_model_path("embedded")
    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    demo, _ = load_config("rl_demo")
    data, trainer_cfg = demo["data"], demo["trainer"]
    group, temperature = int(trainer_cfg["num_generations"]), float(trainer_cfg["temperature"])
    n_prompts = trainer_cfg["per_device_train_batch_size"] * trainer_cfg["steps_per_generation"] // group
    dataset = make_reasoning_gym_dataset(data["tasks"], size=n_prompts, seed=0, system_prompt=data.get("system_prompt"))
    prompt_ids = [tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True) for row in dataset]
    prompt_ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in prompt_ids]
    max_len = max(map(len, prompt_ids)) + max(lengths)
    config = AutoConfig.from_pretrained(model_path)
    memory = args.memory
    if memory is None:  # the engine runs in this process, next to the HF model (float32)
        memory = cpu_engine_memory_utilization(
            model_path,
            config,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=n_prompts * group,
            setting="--memory",
            colocated=True,
            training_bytes=4 * parameter_count(model_path, config),
        )
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}, torch threads "
        f"{torch.get_num_threads()}; {n_prompts} prompts x {group} samples, temperature {temperature}, "
        f"prompt tokens {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))}, vLLM memory fraction {memory}",
        flush=True,
    )

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    start = time.perf_counter()
    llm = build_engine(model_path, memory, max_len=max_len, max_num_seqs=n_prompts * group)
    print(f"vLLM engine start {time.perf_counter() - start:.1f} s", flush=True)
    vllm_generate(llm, prompt_ids[:2], 2, 4, temperature)  # first call: allocations
    results = {}
    for tokens in lengths:
        times: dict[str, list[float]] = {"hf": [], "vllm": []}
        for _ in range(args.repeats):
            for name in ("hf", "vllm"):
                t0 = time.perf_counter()
                if name == "hf":
                    n = hf_generate(model, tok, prompt_ids, group, tokens, temperature)
                else:
                    n = vllm_generate(llm, prompt_ids, group, tokens, temperature)
                times[name].append(time.perf_counter() - t0)
                print(
                    f"  {tokens} tokens, {name}: {times[name][-1]:.1f} s ({n} tokens, "
                    f"{n / times[name][-1]:.0f} tok/s), load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        results[tokens] = {k: statistics.median(v) for k, v in times.items()}
    del llm
    print(f"\nload average after generation {os.getloadavg()}")
    print(f"{'response tokens':<16}{'HF s':>8}{'vLLM s':>8}{'HF/vLLM':>9}")
    for tokens, r in results.items():
        print(f"{tokens:<16}{r['hf']:>8.1f}{r['vllm']:>8.1f}{r['hf'] / r['vllm']:>9.2f}")

    if args.rl_steps > 0:
        tmp = tempfile.mkdtemp(prefix="klear-rollout-")
        steps = {}
        for kind in ("hf", "vllm"):
            trainer = demo_trainer(kind, model_path, dataset, tok, os.path.join(tmp, kind), args.rl_steps, memory)
            trainer.train()
            rows = [row for row in trainer.state.log_history if "step_time" in row]
            steps[kind] = [row["step_time"] for row in rows]
            rollout = [round(row.get("timing/rollout_s", float("nan")), 1) for row in rows]
            # the zero-advantage filter keeps a different share of each side's rollout: the loss compute differs
            filtered = [round(row.get("klear/filtered_sample_frac", float("nan")), 2) for row in rows]
            print(
                f"  GPPOTrainer {kind}: step_time {[round(t, 1) for t in steps[kind]]} s, rollout phase {rollout} s, "
                f"filtered sample fraction {filtered}, load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            del trainer
        hf_mean, vllm_mean = statistics.mean(steps["hf"]), statistics.mean(steps["vllm"])
        print(
            f"\nGPPOTrainer, demo settings, {args.rl_steps} optimizer steps each: mean s/step HF {hf_mean:.1f}, "
            f"vLLM {vllm_mean:.1f}, HF/vLLM {hf_mean / vllm_mean:.2f}; first (rollout) step HF {steps['hf'][0]:.1f}, "
            f"vLLM {steps['vllm'][0]:.1f}"
        )
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
