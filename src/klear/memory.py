"""Per-GPU memory plan of a training run, and the KV cache of an evaluation: pure functions of numbers.

A low layer: imports nothing from klear (and no torch at module top); the run guard
(:func:`klear.runs.check_memory_plan`), ``klear rl|sft --dry-run`` and the HF evaluation's batch cap use it.

All sizes are bytes; ``N`` is the parameter count (:func:`parameter_count`), ``P`` the number of training
processes (one per GPU). Per GPU, by strategy, under bf16 mixed precision (``mixed_precision=True``):

=========  =====================  =====================  ============================================
strategy   parameters             gradients              optimizer (AdamW: m and v, fp32 master)
=========  =====================  =====================  ============================================
ddp        4N (the fp32 model)    4N                     8N  (m, v; the fp32 parameters are the master)
zero1      2N (bf16 copy)         2N                     12N/P (fp32 master + m + v, partitioned)
zero2      2N                     2N/P                   12N/P
zero3      2N/P (bf16 shards)     2N/P                   12N/P
fsdp2      4N/P (fp32 shards)     4N/P                   8N/P (the fp32 shards are the master)
=========  =====================  =====================  ============================================

(ddp: TRL 1.16 loads a model given as a path in float32 and autocast computes in bf16.) In float32 every
parameter/gradient entry is 4 bytes and the optimizer 8 bytes per parameter. ZeRO-3 and FSDP2 also hold the
gathered parameters of the unit being computed and the next one (prefetch): 2 x the largest unit (a decoder
layer, or the embedding) at the compute dtype.

Activations of one micro-batch of ``T`` tokens (compute dtype, ``b`` bytes; FlashAttention/SDPA kernels, so
no T x T score matrix): a decoder layer saves per token ``4h + 2 q + 2 kv + 4 I`` values (the norm input and
output before attention and MLP, the query and attention output, the key and value, gate, up, act(gate),
act(gate) * up), ``h`` hidden, ``q`` = heads x head_dim, ``kv`` = kv heads x head_dim, ``I`` intermediate. With
gradient checkpointing only each layer's input (``h`` per token per layer) is kept, plus one layer's full
activations while it is recomputed in the backward pass.

Logits: a full ``T x V`` logit tensor costs ``T V (b + 4 + b)`` bytes (logits, their fp32 log-softmax kept
for backward, the logits' gradient): 40 GB for one 32K-token sequence and Qwen3's 151,936-token vocabulary
in bf16. TRL 1.16's GRPO and SFT trainers never materialise it (``add_fused_lm_head``,
``trl/kernels/chunked_logprob.py``: [4096 tokens x 32768 vocabulary] tiles): ``fused_lm_head=True`` counts
two fp32 tiles instead.

The colocated vLLM engine takes ``vllm_gpu_memory_utilization x device memory`` (its weights, KV cache and
activations). With TRL's ``vllm_enable_sleep_mode`` the engine sleeps at level 2 during training (weights and
KV cache released, ``trl/generation/vllm_generation.py``), so the peak is the larger of the training phase
(without the engine) and the generation phase (parameters, gradients, optimizer state, engine).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "GIB",
    "PLAN_MARGIN_SHARE",
    "RUNTIME_BYTES",
    "EVAL_MEMORY_SHARE",
    "STRATEGIES",
    "ModelShape",
    "MemoryPlan",
    "model_shape",
    "parameter_count",
    "kv_cache_bytes",
    "eval_batch_size",
    "activation_bytes",
    "logits_bytes",
    "plan_memory",
]

GIB = 2**30
#: Share of the device's memory a plan leaves free (allocator fragmentation, NCCL buffers, other tenants of a
#: shared machine): a plan fits when its peak is at most ``(1 - PLAN_MARGIN_SHARE) x`` device memory.
PLAN_MARGIN_SHARE = 0.10
#: Per process: CUDA context, cuBLAS/NCCL workspaces, allocator slack.
RUNTIME_BYTES = 3 * GIB
#: A sleeping (level 2) colocated vLLM engine still holds its CUDA graphs and allocator pools.
VLLM_SLEEP_RESIDUAL_BYTES = 1 * GIB
#: Share of the free device memory an evaluation's KV cache and logits may take (:func:`eval_batch_size`);
#: the rest is the model's activations, the allocator's slack and other processes on a shared machine.
EVAL_MEMORY_SHARE = 0.5
#: TRL 1.16's fused LM head tile (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE; trainer/utils.py chunk size).
FUSED_TOKEN_TILE = 4096
FUSED_VOCAB_TILE = 32768
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that the estimates need (read by :func:`model_shape`)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qk_norm: bool = False
    attention_bias: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """One decoder layer: q, k, v, o projections (+ biases), gated MLP (3 h I), two RMSNorms (+ q/k norms)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attention = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attention += q + 2 * kv
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + 3 * h * self.intermediate + norms


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_shape(config: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers config (a multimodal config: its text config).

    ``head_dim`` defaults to hidden / heads and ``num_key_value_heads`` to the heads; Qwen3 has q/k norms,
    Qwen2 biases on q, k, v (``attention_bias`` elsewhere).

    Raises:
        ValueError: a config without ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads`` or ``intermediate_size`` (one line).
    """
    text = _text_config(config)
    try:
        hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
        vocab, layers, inter = int(text.vocab_size), int(text.num_hidden_layers), int(text.intermediate_size)
    except (AttributeError, TypeError):
        raise ValueError(
            f"model config {type(config).__name__}: lacks vocab_size, hidden_size, num_hidden_layers, "
            "num_attention_heads or intermediate_size (a decoder-only transformer is expected)"
        ) from None
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    model_type = str(getattr(text, "model_type", ""))
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    bias = model_type == "qwen2" or bool(getattr(text, "attention_bias", False))
    return ModelShape(vocab, hidden, layers, heads, kv_heads, head_dim, inter, tied, model_type == "qwen3", bias)


def parameter_count(config: Any) -> int:
    """Parameters of a decoder-only transformer from its config, no weights:
    ``V h`` (embedding) + ``L x`` :meth:`ModelShape.layer_parameters` + ``h`` (final norm) + ``V h`` (an untied
    ``lm_head``). Checked against transformers' own model built on the meta device (tests).

    Raises:
        ValueError: see :func:`model_shape`.
    """
    s = model_shape(config)
    embedding = s.vocab * s.hidden
    return embedding + s.layers * s.layer_parameters() + s.hidden + (0 if s.tied else embedding)


def kv_cache_bytes(config: Any, tokens: int, dtype_bytes: int) -> int:
    """KV cache of ``tokens`` tokens, bytes: a key and a value (kv heads x head_dim) per layer per token."""
    s = model_shape(config)
    return 2 * s.layers * s.kv_dim * int(dtype_bytes) * int(tokens)


def eval_batch_size(
    config: Any,
    *,
    tokens: int,
    batch_size: int,
    free_bytes: int,
    dtype_bytes: int,
    share: float = EVAL_MEMORY_SHARE,
) -> int:
    """The largest batch ``<= batch_size`` whose generation state fits ``share x free_bytes``.

    Per sequence of ``tokens`` tokens (prompt + new tokens): its KV cache (:func:`kv_cache_bytes`) and one
    position's logits over the vocabulary in fp32 (HF ``generate`` upcasts the last position's logits).

    Returns:
        An int in ``[1, batch_size]`` (at least 1: a single sequence that does not fit is left to fail loudly).
    """
    per_sequence = kv_cache_bytes(config, tokens, dtype_bytes) + model_shape(config).vocab * 4
    fitting = int(share * max(0, int(free_bytes))) // max(1, per_sequence)
    return max(1, min(int(batch_size), fitting))


def activation_bytes(shape: ModelShape, *, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Activations saved for backward by one micro-batch of ``tokens`` tokens (module docstring), bytes."""
    per_layer = 4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + 4 * shape.intermediate
    if checkpointing:
        per_token = shape.layers * shape.hidden + per_layer
    else:
        per_token = shape.layers * per_layer
    return (per_token + 2 * shape.hidden) * int(tokens) * int(dtype_bytes)


def logits_bytes(shape: ModelShape, *, tokens: int, dtype_bytes: int, fused: bool) -> int:
    """Logits of ``tokens`` scored tokens, bytes: full (``T V (b + 4 + b)``) or TRL's fused tiles (two fp32
    ``min(T, 4096) x min(V, 32768)`` tiles); module docstring."""
    if fused:
        return 2 * min(int(tokens), FUSED_TOKEN_TILE) * min(shape.vocab, FUSED_VOCAB_TILE) * 4
    return int(tokens) * shape.vocab * (2 * int(dtype_bytes) + 4)


def _state_bytes(strategy: str, n: int, processes: int, mixed_precision: bool) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) per GPU, bytes (module docstring table)."""
    p = max(1, int(processes))
    if not mixed_precision:
        shard = {"ddp": (1, 1, 1), "zero1": (1, 1, p), "zero2": (1, p, p)}.get(strategy, (p, p, p))
        return 4 * n / shard[0], 4 * n / shard[1], 8 * n / shard[2]
    return {
        "ddp": (4 * n, 4 * n, 8 * n),
        "zero1": (2 * n, 2 * n, 12 * n / p),
        "zero2": (2 * n, 2 * n / p, 12 * n / p),
        "zero3": (2 * n / p, 2 * n / p, 12 * n / p),
        "fsdp2": (4 * n / p, 4 * n / p, 8 * n / p),
    }[strategy]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A per-GPU memory estimate.

    Attributes:
        components: ``{name: bytes}`` of the training phase, in table order (the vLLM engine included when it
            does not sleep).
        generation: bytes of the generation phase with a sleeping engine (``None`` otherwise).
        device_bytes: the device's memory. strategy, processes: as planned.
        margin_share: :data:`PLAN_MARGIN_SHARE`.
    """

    components: dict[str, int]
    device_bytes: int
    strategy: str
    processes: int
    generation: int | None = None
    margin_share: float = PLAN_MARGIN_SHARE

    @property
    def training(self) -> int:
        return sum(self.components.values())

    @property
    def peak(self) -> int:
        """The larger of the training and (sleep mode) generation phases, bytes."""
        return max(self.training, self.generation or 0)

    @property
    def limit(self) -> int:
        """What a plan may use: the device memory less the margin, bytes."""
        return int(self.device_bytes * (1 - self.margin_share))

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit

    def table(self) -> str:
        """The plan as text: one line per component (GiB), the phases, the device and the verdict."""
        rows = [f"memory plan per GPU ({self.strategy}, {self.processes} process(es)):"]
        rows += [f"  {name:<40} {value / GIB:8.1f} GiB" for name, value in self.components.items()]
        rows.append(f"  {'total (training phase)':<40} {self.training / GIB:8.1f} GiB")
        if self.generation is not None:
            rows.append(f"  {'total (generation phase, vLLM awake)':<40} {self.generation / GIB:8.1f} GiB")
        rows.append(
            f"  {'device memory':<40} {self.device_bytes / GIB:8.1f} GiB (usable {self.limit / GIB:.1f} GiB after "
            f"a {self.margin_share:.0%} margin)"
        )
        rows.append(f"  {'verdict':<40} {'fits' if self.fits else 'does NOT fit'}")
        return "\n".join(rows)


def plan_memory(
    config: Any,
    *,
    strategy: str,
    processes: int,
    device_bytes: int,
    micro_batch: int,
    seq_tokens: int,
    logit_tokens: int,
    checkpointing: bool,
    mixed_precision: bool = True,
    vllm_share: float | None = None,
    vllm_sleep: bool = False,
    fused_lm_head: bool = True,
    params: int | None = None,
) -> MemoryPlan:
    """Estimate one GPU's memory for training ``config``'s model (formulas: module docstring).

    Args:
        config: the model's transformers config (no weights).
        strategy: one of :data:`STRATEGIES`.
        processes: training processes (GPUs), P.
        device_bytes: the device's memory, bytes.
        micro_batch: sequences per forward/backward (``per_device_train_batch_size``).
        seq_tokens: tokens per sequence (prompt + completion: the run's context).
        logit_tokens: scored tokens per sequence (RL: the completion; SFT: the sequence).
        checkpointing: gradient (activation) checkpointing on.
        mixed_precision: bf16/fp16 mixed precision (else float32 throughout).
        vllm_share: the colocated vLLM engine's ``gpu_memory_utilization`` (``None``: no colocated engine).
        vllm_sleep: TRL's ``vllm_enable_sleep_mode``.
        fused_lm_head: logits in TRL's fused tiles (TRL >= 1.16 trainers) rather than in full.
        params: the parameter count when known (default :func:`parameter_count`).

    Raises:
        ValueError: an unknown strategy, ``processes``/``micro_batch``/``seq_tokens`` < 1, or a vLLM share
            outside (0, 1].
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} must be one of {', '.join(STRATEGIES)}")
    for name, value in (("processes", processes), ("micro_batch", micro_batch), ("seq_tokens", seq_tokens)):
        if int(value) < 1:
            raise ValueError(f"memory plan: {name}={value!r} must be >= 1")
    if vllm_share is not None and not 0 < float(vllm_share) <= 1:
        raise ValueError(f"memory plan: vllm_gpu_memory_utilization={vllm_share!r} must be in (0, 1]")
    shape = model_shape(config)
    n = parameter_count(config) if params is None else int(params)
    compute = 2 if mixed_precision else 4
    weights, grads, optimizer = _state_bytes(strategy, n, processes, mixed_precision)
    components = {
        "parameters": int(weights),
        "gradients": int(grads),
        "optimizer state (AdamW)": int(optimizer),
    }
    if strategy in ("zero3", "fsdp2"):
        unit = max(shape.layer_parameters(), shape.vocab * shape.hidden)
        components["gathered parameters (2 units)"] = 2 * unit * compute
    tokens = int(micro_batch) * int(seq_tokens)
    ckpt = "with" if checkpointing else "without"
    components[f"activations ({tokens} tokens, {ckpt} ckpt)"] = activation_bytes(
        shape, tokens=tokens, dtype_bytes=compute, checkpointing=checkpointing
    )
    scored = int(micro_batch) * int(logit_tokens)
    components[f"logits ({'fused tiles' if fused_lm_head else f'{scored} x {shape.vocab}'})"] = logits_bytes(
        shape, tokens=scored, dtype_bytes=compute, fused=fused_lm_head
    )
    components["CUDA runtime and workspaces"] = RUNTIME_BYTES
    generation = None
    if vllm_share is not None:
        engine = int(float(vllm_share) * int(device_bytes))
        if vllm_sleep:
            components["vLLM engine (asleep)"] = VLLM_SLEEP_RESIDUAL_BYTES
            generation = int(weights + grads + optimizer) + RUNTIME_BYTES + engine
        else:
            components[f"vLLM engine ({float(vllm_share):g} of the device)"] = engine
    return MemoryPlan(components, int(device_bytes), strategy, int(processes), generation)
