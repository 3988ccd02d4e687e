"""How close klear's float32 decode step can come to 3x ``generate``'s: the step's matrix products timed alone.

Issue 25 asks for decode at >= 3x ``generate``'s tokens/s at the demo's batch (128 rows) in float32. This script
measures, in one process and alternating rounds (``--repeats``), on the demo's workload (the embedded
SmolLM2-135M-Instruct in float32, 16 reasoning-gym prompts x 8 samples, temperature 0.7, every row forced to
``--tokens`` new tokens, as ``benchmarks/rollout.py --mode hf-decode``):

- **generate** and **loop**: ms per decode step of transformers' ``generate`` and of klear's decode loop
  (:func:`klear.generation.decode.grouped_decode`): the call's time less a 1-token call's (the prefill), over
  ``tokens - 1`` steps;
- **products, streamed**: one step's matrix products alone, ``torch.mm`` of a 128 x 576 activation with each
  decoder layer's q, k, v, o, gate, up and down weights (the model's own, 30 layers: each read from memory once
  per step, as in the loop) and the 49 152-word head;
- **products, in cache**: the same products with layer 0's weights for every layer (cache-resident: the GEMM
  kernel's own ceiling at these shapes);
- **products, fused**: q/k/v and gate/up concatenated into one weight each (4 products a layer, not 7).

It prints the 3x budget (``generate``'s step / 3) and what it leaves for everything but the products (attention,
norms, rotary, activations, sampling, Python): the loop's step less its products is today's figure for that.

``--compile`` adds transformers' static KV cache with the model's forward under ``torch.compile`` (inductor,
``dynamic=False``) against the same forward eager, ms per decode step (median over the steps after the first 3;
greedy; 128 rows copied from the 16 prompts, no grouped prefill; the compile time is printed apart), and one
layer's norm + MLP + residual (layer 0's modules, 128 rows) eager against compiled.
Prints load average and CPU flags at start and end. OpenMP threads wait as under ``klear``'s commands
(:func:`klear.precision.set_cpu_runtime_defaults`, printed): with the library's default spinning, other work on the
machine inflated the timed-alone products 2-3x (a helper's run beside a CI run: products above the whole loop step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from klear.precision import set_cpu_runtime_defaults

WAIT_POLICY = set_cpu_runtime_defaults()  # before torch loads OpenMP: the threads wait as under klear's CLI

import torch  # noqa: E402

from _machine import cpu_flags  # noqa: E402
from rollout import hf_generate  # noqa: E402


def _workload():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klear.config import load_config
    from klear.data.rl_data import make_reasoning_gym_dataset
    from klear.models.embedded import resolve_model_path

    path = resolve_model_path("embedded")
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    demo, _ = load_config("rl_demo")
    data, trainer = demo["data"], demo["trainer"]
    group = int(trainer["num_generations"])
    n_prompts = trainer["per_device_train_batch_size"] * trainer["steps_per_generation"] // group
    dataset = make_reasoning_gym_dataset(data["tasks"], size=n_prompts, seed=0, system_prompt=data.get("system_prompt"))
    ids = [tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True) for row in dataset]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tok, ids, group, float(trainer["temperature"])


def _weights(model, fused: bool, same_layer: bool) -> list[torch.Tensor]:
    """Each decode step's weights in the order the loop uses them, as ``(out, in)`` float32 matrices."""
    out = []
    layers = model.model.layers
    for layer in layers:
        src = layers[0] if same_layer else layer
        a, m = src.self_attn, src.mlp
        if fused:
            out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight]
            out += [torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
        else:
            out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight]
            out += [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    out.append(model.get_output_embeddings().weight)
    return [w.detach().contiguous() for w in out]


def _products_ms(weights: list[torch.Tensor], rows: int, calls: int = 5) -> float:
    """ms for one pass of ``rows x in`` @ ``in x out`` over ``weights`` (mean of ``calls`` passes)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    outs = [torch.empty(rows, w.shape[0]) for w in weights]
    with torch.no_grad():
        for w, o in zip(weights, outs, strict=True):  # warm-up
            torch.mm(inputs[w.shape[1]], w.t(), out=o)
        t0 = time.perf_counter()
        for _ in range(calls):
            for w, o in zip(weights, outs, strict=True):
                torch.mm(inputs[w.shape[1]], w.t(), out=o)
    return (time.perf_counter() - t0) / calls * 1e3


def _step_ms(model, tok, ids, group, tokens, temperature, fast: bool) -> float:
    t0 = time.perf_counter()
    hf_generate(model, tok, ids, group, 1, temperature, fast_decode=fast)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_generate(model, tok, ids, group, tokens, temperature, fast_decode=fast)
    return (time.perf_counter() - t0 - prefill) / (tokens - 1) * 1e3


def _compiled_static_cache(model, tok, ids, group: int, tokens: int) -> None:
    """``--compile``: ms per decode step with a static cache, eager vs ``torch.compile``."""
    from transformers import StaticCache

    rows = [r for r in ids for _ in range(group)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for name in ("eager", "compiled"):
        cache = StaticCache(config=model.config, max_cache_len=width + tokens)

        def step(token, position, cache_position, attention_mask, cache=cache):
            return model(
                input_ids=token,
                position_ids=position,
                attention_mask=attention_mask,
                past_key_values=cache,
                cache_position=cache_position,
                use_cache=True,
            ).logits

        fn = torch.compile(step, dynamic=False) if name == "compiled" else step
        times = []
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = input_ids[:, -1:].clone()
            full_mask = torch.cat([mask, torch.ones(len(rows), tokens, dtype=mask.dtype)], dim=1)
            position = mask.sum(1, keepdim=True)
            for s in range(tokens - 1):
                t0 = time.perf_counter()
                cp = torch.tensor([width + s])
                logits = fn(token, position + s, cp, full_mask)
                token = logits[:, -1].argmax(-1, keepdim=True).contiguous()
                times.append(time.perf_counter() - t0)
        print(
            f"  static cache, {name}: first step {times[0]:.1f} s (compile included), median after 3: "
            f"{statistics.median(times[3:]) * 1e3:.0f} ms a step, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )


def _compiled_mlp_block(model, rows: int, calls: int = 200) -> None:
    """``--compile``: one layer's norm + MLP + residual (layer 0's modules) at ``rows`` rows, eager vs compiled."""
    layer = model.model.layers[0]

    def block(x):
        return x + layer.mlp(layer.post_attention_layernorm(x))

    compiled = torch.compile(block, dynamic=False)
    x = torch.randn(rows, model.config.hidden_size)
    result = {}
    with torch.no_grad():
        for _ in range(3):  # warm-up (compiles)
            compiled(x)
        for r in range(4):
            for name, fn in (
                (("eager", block), ("compiled", compiled)) if r % 2 == 0 else (("compiled", compiled), ("eager", block))
            ):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(x)
                result.setdefault(name, []).append((time.perf_counter() - t0) / calls * 1e3)
    eager, comp = (statistics.median(result[k]) for k in ("eager", "compiled"))
    print(
        f"  one layer's norm + MLP at {rows} rows: eager {eager:.2f} ms, compiled {comp:.2f} ms ({eager / comp:.2f}x; "
        f"x {model.config.num_hidden_layers} layers: {(eager - comp) * model.config.num_hidden_layers:.1f} ms a step)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per row, forced (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--compile", action="store_true", help="also static cache + torch.compile vs eager")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (one decode step after the prefill's token)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model, tok, ids, group, temperature = _workload()
    rows = len(ids) * group
    print(
        f"load average {os.getloadavg()}, {os.cpu_count()} CPUs, flags: {cpu_flags()}, torch threads "
        f"{torch.get_num_threads()}, OpenMP wait: {WAIT_POLICY or 'set by the user'}; {len(ids)} prompts x {group} = "
        f"{rows} rows, {args.tokens} tokens forced",
        flush=True,
    )
    plain, in_cache, fused = (_weights(model, f, s) for f, s in ((False, False), (False, True), (True, False)))
    hf_generate(model, tok, ids[:2], group, 2, temperature, fast_decode=True)  # warm-up
    kinds = ("generate", "loop", "products, streamed", "products, in cache", "products, fused")
    ms: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            if kind in ("generate", "loop"):
                value = _step_ms(model, tok, ids, group, args.tokens, temperature, fast=kind == "loop")
            else:
                weights = {"products, streamed": plain, "products, in cache": in_cache, "products, fused": fused}
                value = _products_ms(weights[kind], rows)
            ms[kind].append(value)
            print(f"  round {r + 1}, {kind}: {value:.1f} ms a step, load {os.getloadavg()[0]:.2f}", flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"\nload average after {os.getloadavg()}")
    for kind in kinds:
        print(f"{kind:<22}{med[kind]:>8.1f} ms a step")
    budget = med["generate"] / 3
    products = med["products, streamed"]
    print(
        f"\nthe loop's speed-up over generate: {med['generate'] / med['loop']:.2f}x; 3x budget {budget:.1f} ms a step; "
        f"the products alone {products:.1f} ms ({products / budget:.0%} of it), leaving {budget - products:.1f} ms for "
        f"the rest, which takes {med['loop'] - products:.1f} ms in the loop today; fused projections "
        f"{products / med['products, fused']:.2f}x the separate ones; weights in cache "
        f"{products / med['products, in cache']:.2f}x streamed"
    )
    spread = max(max(v) / min(v) for v in ms.values())
    if spread > 1.25:
        print(
            f"WARNING: a measurement's rounds differ by up to {spread:.2f}x: the machine's load changed during the run"
        )
    if products >= med["loop"]:
        print(
            "WARNING: the products timed alone took longer than the loop's whole step: the machine's load changed "
            f"between the measurements (load average now {os.getloadavg()}); these figures cannot be compared, rerun "
            "on an idle machine"
        )
    if args.compile:
        _compiled_static_cache(model, tok, ids, group, args.tokens)
        _compiled_mlp_block(model, rows)
        print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
