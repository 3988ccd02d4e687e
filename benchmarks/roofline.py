"""How far each phase of one RL step of the CPU demo is from this machine's matmul peak.

1. **Peak**: the best rate of torch square matmuls (n = 1024, 1536, 2048; best of ``--repeats`` each) in float32,
   and in bfloat16 where the CPU has native bf16 matmul (``amx_bf16`` in ``/proc/cpuinfo``).
2. **Phases** of one step at the demo's shapes (``configs/rl_demo.yaml``): the embedded SmolLM2-135M-Instruct
   (:func:`klear.models.embedded.resolve_model_path`, loaded in float32 as the trainer loads it), 16 reasoning-gym
   prompts of the demo x 8 samples = 128 rows, left-padded to the longest prompt (~100 tokens):

   - ``prefill``: one no-grad forward of the 128 prompt rows filling a KV cache, logits of the last position
     only (as ``generate`` asks). klear's rollout prefills each prompt once per group of 8
     (:mod:`klear.generation.prefill`), i.e. 16 rows: this phase measures the rate, not the rollout's cost;
   - ``decode``: ``--decode-steps`` (32) single-token forwards of the 128 rows on that cache (greedy; the
     sampler's own cost is not in it); the tokens become the completions of the next phases;
   - ``old_log_prob``: the no-grad log-prob pass over prompt + completion, in the trainer's micro-batches of
     32 rows, through TRL's fused LM head (:func:`trl.trainer.utils.add_fused_lm_head`, as ``GPPOTrainer``);
   - ``train fwd+bwd``: forward, klear's GPPO loss (:func:`klear.rl.losses.total_loss`, the demo's settings)
     and backward of one micro-batch (32 rows);
   - ``train fwd+bwd, shared prompt``: the same micro-batch through :mod:`klear.rl.shared_prompt` (each distinct
     prompt's forward computed once and shared by its rows, as ``GPPOTrainer`` does on a CPU with one process):
     the same log-probs and gradients, fewer FLOPs (:func:`shared_train_flops`). The training micro-batch is 32 of
     the 128 rows drawn at random, as TRL shuffles a rollout batch (:func:`micro_batch_rows`); the script also
     prints the whole-row pass's FLOPs over the shared pass's time ("effective" rate);
   - ``optimizer``: gradient clipping (max norm 1) and the ``AdamW`` step the HF ``Trainer`` builds (fused
     on CPU, weight decay 0.1 off biases and norms), best of 3.

   Where bf16 is measured the four model phases run again under ``torch.autocast("cpu", torch.bfloat16)``
   with float32 weights (what ``bf16=True`` does in the trainer); the optimizer step is float32 either way.

FLOPs are counted from the model config (:func:`forward_flops`), not measured:

- matmuls: ``2 * P * tokens`` with ``P`` the weights of the decoder layers' projections (q, k, v, o, gate,
  up, down), plus ``2 * hidden * vocab`` per position sent through the LM head (the last position in prefill
  and decode; EVERY position in the fused LM head off CUDA, where TRL does not compact the positions without
  a label: ``old_log_prob`` and training pay the head on the prompt too);
- attention: ``4 * heads * head_dim * keys`` per query token per layer (scores and weighted values), with
  ``keys`` the whole padded width (past + new): the dense kernels with a mask compute every pair, pads and
  future positions included;
- backward = 2 x forward (TRL's fused head recomputes its logits in backward: not counted);
- not counted: embeddings (a lookup), norms, rotary, SiLU, softmax, residual adds, the loss;
- AdamW: 14 FLOPs per parameter (weight decay 1, first moment 3, second 4, denominator 3, update 3) and
  clipping 3 (norm 2, scale 1). It is bound by memory traffic (>= 40 bytes per parameter in float32), so its
  share of the matmul peak says little; the script prints its GB/s too.

Usage: ``python benchmarks/roofline.py [--quick]``. ``--quick`` (under a minute) uses 2 prompts x 8 rows,
8 decode steps and micro-batches of 8. Prints load average, CPU flags and torch's thread count at start and end,
then one markdown table, then the first-step on-policy ratio per dtype (:func:`ratio_spread`). The full run took
248 s on 2 idle cores with AMX (with bf16); with another 2-thread benchmark sharing the cores it took 6 minutes,
and ``--quick`` 1.5 to 3.7.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from _machine import cpu_model, vector_flags

SHARED_PHASE = "train fwd+bwd, shared prompt"
ADAMW_FLOPS_PER_PARAM = 14
CLIP_FLOPS_PER_PARAM = 3
# fp32: AdamW reads p, g, m, v and writes p, m, v (28 bytes); clipping reads g twice and writes it (12)
OPTIMIZER_BYTES_PER_PARAM = 40


def layer_matmul_params(config: Any) -> int:
    """Weights of one decoder layer's projections (q, k, v, o, gate, up, down) of a Llama-style config."""
    h, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    return h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter


def forward_flops(config: Any, *, rows: int, new: int, past: int = 0, head_positions: int) -> int:
    """FLOPs of one forward of a Llama-style model (the counting rules are in this module's docstring).

    Args:
        config: the model config (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim``, ``vocab_size``).
        rows: batch size.
        new: tokens per row in this forward (queries), padding included.
        past: tokens per row already in the KV cache.
        head_positions: positions per row sent through the LM head.
    """
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    matmul = 2 * layers * layer_matmul_params(config) * new
    attention = 4 * layers * heads * head_dim * new * (past + new)
    head = 2 * config.hidden_size * config.vocab_size * head_positions
    return rows * (matmul + attention + head)


def step_flops(
    config: Any, *, rows: int, prompt: int, completion: int, decode_steps: int, micro_batch: int
) -> dict[str, int]:
    """FLOPs of each model phase of one RL step (see the module docstring), by phase name."""
    full = prompt + completion
    return {
        "prefill": forward_flops(config, rows=rows, new=prompt, head_positions=1),
        "decode": sum(
            forward_flops(config, rows=rows, new=1, past=prompt + i, head_positions=1) for i in range(decode_steps)
        ),
        # the fused LM head scores positions 0 .. full-2 (each predicts the next token)
        "old_log_prob": forward_flops(config, rows=rows, new=full, head_positions=full - 1),
        "train fwd+bwd": 3 * forward_flops(config, rows=micro_batch, new=full, head_positions=full - 1),
    }


def shared_train_flops(config: Any, *, distinct: int, micro_batch: int, prompt: int, completion: int) -> int:
    """FLOPs of one micro-batch's forward+backward through :func:`klear.rl.shared_prompt.shared_prompt_log_probs`:
    the ``distinct`` prompts' first ``prompt - 1`` tokens once (its LM head on the last position only, forward
    only: those logits are not used), then every row's last prompt token and completion on their keys and values
    (the fused LM head on all ``completion + 1`` positions off CUDA); backward = 2 x forward, except where no
    gradient flows: in the last layer only the prompt's keys and values are used, so its query, output and MLP
    projections and its attention on the prompt positions have no backward."""
    backbone = forward_flops(config, rows=distinct, new=prompt - 1, head_positions=0)
    head_once = forward_flops(config, rows=distinct, new=0, head_positions=1)
    rows = forward_flops(config, rows=micro_batch, new=completion + 1, past=prompt - 1, head_positions=completion + 1)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_weights = 2 * config.hidden_size * config.num_key_value_heads * head_dim
    unused = 2 * (layer_matmul_params(config) - kv_weights) + 4 * heads * head_dim * (prompt - 1)  # per prompt token
    return 3 * (backbone + rows) + head_once - 2 * distinct * (prompt - 1) * unused


def matmul_peak(dtype: torch.dtype, repeats: int, sizes: tuple[int, ...] = (1024, 1536, 2048)) -> dict[int, float]:
    """GFLOPS of ``a @ b`` for square ``n x n`` matrices, the best of ``repeats`` after one warm-up, per n."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        c = a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - start)
        out[n] = 2 * n**3 / best / 1e9
    return out


def measure_peaks(dtypes: dict[str, torch.dtype], repeats: int, when: str) -> dict[str, float]:
    """Print the matmul GFLOPS of each size and return the best per dtype name."""
    peak = {}
    for name, dtype in dtypes.items():
        by_n = matmul_peak(dtype, repeats)
        print(f"{when}: {name} matmul GFLOPS by n: " + ", ".join(f"{n}: {g:.0f}" for n, g in by_n.items()), flush=True)
        peak[name] = max(by_n.values())
    return peak


def machine_line(when: str) -> str:
    return (
        f"{when}: load average {tuple(round(x, 2) for x in os.getloadavg())}, {os.cpu_count()} CPUs "
        f"({cpu_model()}), torch {torch.__version__} threads {torch.get_num_threads()}, flags: {vector_flags()}"
    )


def build_workload(model_path: str, prompts: int, group: int):
    """(model, left-padded prompt ids (rows, P), mask) for ``prompts`` demo prompts x ``group`` rows each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.config import load_config
    from klear.data.rl_data import make_reasoning_gym_dataset

    demo, _ = load_config("rl_demo")
    data = demo["data"]
    dataset = make_reasoning_gym_dataset(data["tasks"], size=prompts, seed=0, system_prompt=data.get("system_prompt"))
    tok = AutoTokenizer.from_pretrained(model_path)
    chat = [
        tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        for row in dataset
    ]
    ids = [list(c["input_ids"]) for c in chat for _ in range(group)]
    width = max(map(len, ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model, input_ids, mask, demo


def prefill(model, input_ids, mask):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1], cache


def decode(model, logits, cache, mask, steps: int) -> torch.Tensor:
    """``steps`` greedy single-token forwards on ``cache``; returns the (rows, steps) tokens."""
    tokens = []
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        out = model(
            input_ids=nxt,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
    return torch.cat(tokens, dim=1)


def fused_log_probs(model, ids, mask, completion: int):
    """(log_prob, entropy) of the last ``completion`` tokens, as TRL's ``_get_per_token_logps_and_entropies``."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -completion:], out.entropy[:, -completion:]


def old_log_prob(model, ids, mask, completion: int, micro_batch: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [
                fused_log_probs(model, ids[i : i + micro_batch], mask[i : i + micro_batch], completion)[0]
                for i in range(0, ids.size(0), micro_batch)
            ]
        )


def train_step(
    model, ids, mask, completion: int, old: torch.Tensor, settings, *, shared_prompt: bool = False
) -> torch.Tensor:
    """Forward, GPPO loss (klear's ``total_loss``) and backward of one micro-batch; returns the detached
    ``log_prob`` ``(rows, completion)`` float32 the loss saw. ``shared_prompt``: the log-probs come from
    :func:`klear.rl.shared_prompt.shared_prompt_log_probs` (each distinct prompt's forward once, as
    ``GPPOTrainer`` on a CPU with one process), else from TRL's whole-row pass."""
    from klear.rl.losses import LossInputs, total_loss
    from klear.rl.shared_prompt import shared_prompt_log_probs

    if shared_prompt:
        p = ids.size(1) - completion
        log_prob, entropy = shared_prompt_log_probs(
            model, ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:], compute_entropy=True
        )
    else:
        log_prob, entropy = fused_log_probs(model, ids, mask, completion)
    rows = ids.size(0)
    gen = torch.Generator().manual_seed(0)
    response = torch.ones(rows, completion, dtype=torch.bool)
    is_correct = torch.arange(rows) % 3 == 0
    advantages = torch.where(is_correct, 1.0, -0.5) + 0.01 * torch.randn(rows, generator=gen)
    loss, _ = total_loss(
        LossInputs(
            log_prob=log_prob.float(),
            old_log_prob=old,
            advantages=advantages,
            response_mask=response,
            entropies=entropy.float(),
            is_correct=is_correct,
        ),
        settings,
    )
    loss.backward()
    return log_prob.detach().float()


def ratio_spread(log_prob: torch.Tensor, old: torch.Tensor) -> dict[str, float]:
    """The on-policy ratio on the first step of a fresh rollout, before any update (1 everywhere in exact
    arithmetic): ``ratio_max``/``ratio_min`` of ``r = exp(log_prob - old_log_prob)`` and ``ppo_kl`` =
    mean(``old_log_prob - log_prob``) over the tokens, as the trainer logs them."""
    diff = log_prob.double() - old.double()
    ratio = diff.exp()
    return {"ratio_max": float(ratio.max()), "ratio_min": float(ratio.min()), "ppo_kl": float((-diff).mean())}


def build_optimizer(model, trainer: dict):
    """The optimizer the HF ``Trainer`` builds for the demo's settings (class, kwargs and decay groups)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=os.devnull,
        use_cpu=True,
        learning_rate=float(trainer["learning_rate"]),
        weight_decay=float(trainer["weight_decay"]),
        report_to=[],
    )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # an instance method that reads only `model`
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return cls(groups, **kwargs), float(trainer["max_grad_norm"])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_phases(
    model, input_ids, mask, *, steps: int, micro_batch: int, settings, autocast: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """Wall seconds of prefill, decode, old_log_prob and one micro-batch's forward+backward (one run each), and
    :func:`ratio_spread` of that micro-batch (its old_log_prob from the no-grad pass, log_prob from training's)."""
    ctx: Callable[[], contextlib.AbstractContextManager] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    )
    seconds: dict[str, float] = {}
    model.eval()
    with torch.no_grad(), ctx():
        # warm-up on 2 rows (first-call costs: kernel selection, allocations), not timed
        logits, cache = prefill(model, input_ids[:2], mask[:2])
        decode(model, logits, cache, mask[:2], 2)
        seconds["prefill"], (logits, kv) = timed(lambda: prefill(model, input_ids, mask))
        seconds["decode"], completion = timed(lambda: decode(model, logits, kv, mask, steps))
    ids = torch.cat([input_ids, completion], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(completion)], dim=1)
    with ctx():
        old_log_prob(model, ids[:2], full_mask[:2], steps, micro_batch)
        seconds["old_log_prob"], old = timed(lambda: old_log_prob(model, ids, full_mask, steps, micro_batch))
        model.train()
        pick = micro_batch_rows(ids.size(0), micro_batch)
        mb, mb_mask, mb_old = ids[pick], full_mask[pick], old[pick].float()
        for shared in (False, True):  # warm-up of each path on 2 rows
            train_step(model, mb[:2], mb_mask[:2], steps, mb_old[:2], settings, shared_prompt=shared)
        model.zero_grad(set_to_none=True)
        seconds["train fwd+bwd"], log_prob = timed(lambda: train_step(model, mb, mb_mask, steps, mb_old, settings))
        model.zero_grad(set_to_none=True)
        seconds[SHARED_PHASE], _ = timed(
            lambda: train_step(model, mb, mb_mask, steps, mb_old, settings, shared_prompt=True)
        )
    return seconds, ratio_spread(log_prob, mb_old)


def micro_batch_rows(rows: int, micro_batch: int) -> torch.Tensor:
    """The rows of the timed training micro-batch: ``micro_batch`` of the rollout's rows drawn at random (seed 0),
    as TRL shuffles a rollout batch before cutting it into micro-batches (so about 14 distinct prompts in 32 rows
    of 16 prompts x 8)."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:micro_batch]


def optimizer_seconds(model, trainer: dict, repeats: int = 3) -> float:
    """Best of ``repeats`` (clip + AdamW step) on the gradients left by the training phase, then ``zero_grad``."""
    optimizer, max_norm = build_optimizer(model, trainer)
    params = [p for p in model.parameters() if p.grad is not None]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    return best


def table_rows(
    shapes: dict[str, str], flops: dict[str, float], seconds: dict[str, float], peak: float
) -> Iterator[tuple[str, str, float, float, float, float]]:
    for phase, shape in shapes.items():
        s = seconds[phase]
        yield phase, shape, s, flops[phase] / 1e9, flops[phase] / s / 1e9, 100 * flops[phase] / s / 1e9 / peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 prompts x 8 rows, 8 decode steps, micro-batch 8 (< 1 min)")
    p.add_argument("--model", default="embedded", help="'embedded' or a checkpoint directory")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 peak and phases even with amx_bf16")
    args = p.parse_args()

    from klear.models.embedded import resolve_model_path
    from klear.precision import cpu_native_bf16
    from klear.rl.losses import LossSettings
    from klear.rl.shared_prompt import distinct_prompts

    began = time.perf_counter()
    print(machine_line("start"), flush=True)
    prompts, steps, micro_batch, repeats = (2, 8, 8, 10) if args.quick else (16, 32, 32, 20)
    bf16 = cpu_native_bf16() and not args.no_bf16
    torch.manual_seed(0)

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16} if bf16 else {"fp32": torch.float32}
    peak = measure_peaks(dtypes, repeats, "start")
    if not bf16:
        print("no amx_bf16: bf16 peak and phases not measured" if not args.no_bf16 else "bf16 skipped (--no-bf16)")

    model, input_ids, mask, demo = build_workload(resolve_model_path(args.model), prompts, 8)
    from trl.trainer.utils import add_fused_lm_head

    trainer = demo["trainer"]
    add_fused_lm_head(model, temperature=float(trainer["temperature"]), outputs=("log_probs", "entropy"))
    settings = LossSettings(**{k: trainer[k] for k in LossSettings.__dataclass_fields__ if k in trainer})
    rows, width = input_ids.shape
    config = model.config
    flops: dict[str, float] = dict(
        step_flops(config, rows=rows, prompt=width, completion=steps, decode_steps=steps, micro_batch=micro_batch)
    )
    pick = micro_batch_rows(rows, micro_batch)
    distinct = distinct_prompts(input_ids[pick], mask[pick])[0].numel()
    flops[SHARED_PHASE] = shared_train_flops(
        config, distinct=distinct, micro_batch=micro_batch, prompt=width, completion=steps
    )
    n_params = sum(p.numel() for p in model.parameters())
    flops["optimizer"] = (ADAMW_FLOPS_PER_PARAM + CLIP_FLOPS_PER_PARAM) * n_params
    shapes = {
        "prefill": f"{rows} x {width}",
        "decode": f"{rows} x {steps} steps",
        "old_log_prob": f"{rows} x {width + steps} (micro-batches of {micro_batch})",
        "train fwd+bwd": f"{micro_batch} x {width + steps}",
        SHARED_PHASE: f"{distinct} x {width - 1} + {micro_batch} x {steps + 1}",
        "optimizer": f"{n_params / 1e6:.1f} M params",
    }
    print(
        f"model {config.model_type} {n_params / 1e6:.1f} M params, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, vocab {config.vocab_size}; {rows} rows, prompts padded to {width} tokens "
        f"({int(mask.sum(1).min())}-{int(mask.sum(1).max())} real), {steps} completion tokens",
        flush=True,
    )

    seconds, spread = {}, {}
    seconds["fp32"], spread["fp32"] = run_phases(
        model, input_ids, mask, steps=steps, micro_batch=micro_batch, settings=settings, autocast=False
    )
    seconds["fp32"]["optimizer"] = optimizer_seconds(model, trainer)
    print(f"fp32 phases done ({sum(seconds['fp32'].values()):.0f} s)", flush=True)
    if bf16:
        seconds["bf16"], spread["bf16"] = run_phases(
            model, input_ids, mask, steps=steps, micro_batch=micro_batch, settings=settings, autocast=True
        )
        model.zero_grad(set_to_none=True)
        print(f"bf16 phases done ({sum(seconds['bf16'].values()):.0f} s)", flush=True)

    end = measure_peaks(dtypes, repeats, "end")
    peak = {name: max(peak[name], end[name]) for name in peak}
    print(machine_line("end"))
    print(
        f"\npeak (best of start and end): fp32 {peak['fp32']:.0f} GFLOPS"
        + (f", bf16 {peak['bf16']:.0f} GFLOPS" if bf16 else "")
    )
    header = "| phase | shape | fp32 wall s | GFLOP | fp32 GFLOPS | % fp32 peak |"
    rule = "|---|---|---|---|---|---|"
    if bf16:
        header += " bf16 wall s | bf16 GFLOPS | % bf16 peak |"
        rule += "---|---|---|"
    print(header + "\n" + rule)
    for phase, shape, s, gflop, rate, share in table_rows(shapes, flops, seconds["fp32"], peak["fp32"]):
        line = f"| {phase} | {shape} | {s:.2f} | {gflop:.0f} | {rate:.1f} | {share:.1f}% |"
        if bf16:
            if phase in seconds["bf16"]:
                rate = flops[phase] / seconds["bf16"][phase] / 1e9
                line += f" {seconds['bf16'][phase]:.2f} | {rate:.1f} | {100 * rate / peak['bf16']:.1f}% |"
            else:
                line += " (fp32 state) | | |"
        print(line)
    for name, secs in seconds.items():
        unshared, shared = secs["train fwd+bwd"], secs[SHARED_PHASE]
        effective = flops["train fwd+bwd"] / shared / 1e9
        print(
            f"\n{name} training pass with each distinct prompt computed once ({distinct} prompts in "
            f"{micro_batch} rows): {unshared / shared:.2f}x the whole-row pass; the whole-row pass's FLOPs in its "
            f"time: {effective:.1f} GFLOPS effective, {100 * effective / peak[name]:.1f}% of the {name} peak "
            "(same log-probs and gradients)"
        )
    gbs = OPTIMIZER_BYTES_PER_PARAM * n_params / seconds["fp32"]["optimizer"] / 1e9
    print(f"\noptimizer memory traffic >= {gbs:.1f} GB/s ({OPTIMIZER_BYTES_PER_PARAM} bytes per parameter)")
    print("\non-policy ratio on the first step (training forward vs the no-grad old_log_prob pass, one micro-batch):")
    for name, stats in spread.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.6g}" for k, v in stats.items()))
    print(f"whole run {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
