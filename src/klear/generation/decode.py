"""A CPU decode loop for grouped rollouts and held-out evaluations (rows not in groups too): preallocated KV
buffers, finished rows leave the batch, cheap sampling.

On a CPU, transformers' ``generate`` at the demo's rollout batch (128 rows, SmolLM2-135M, float32) spends most of a
decode step outside the model's matrix products (profile in :mod:`benchmarks.rollout`, ``--mode hf-decode``):

* ``DynamicCache`` concatenates every layer's keys and values into new tensors at every step, and the ``sdpa``
  attention copies them again to repeat the grouped key/value heads (``repeat_kv``): hundreds of MB of fresh
  allocations (page faults) per step;
* ``torch.multinomial`` draws one exponential variate per VOCABULARY entry per row (49K x 128 per step) and
  ``softmax`` writes the probabilities once more;
* finished rows keep decoding until the longest row ends.

:func:`grouped_decode` keeps the model's own forward (embeddings, norms, rotary embeddings, MLPs, ``lm_head``) and
replaces only the attention's key/value handling, through transformers' ``AttentionInterface``: each layer writes its
new keys and values into buffers allocated once. Each prompt is prefilled once per group. When the prompt is long
against ``max_new_tokens`` (:data:`SHARED_PROMPT_MIN_LENGTH`), its keys and values are kept once per group, not
copied to each row: a decode step attends over them with one matrix product per group (the group's queries stacked,
:func:`_shared_prompt_attention`), so a prompt's keys are read once per step instead of once per row (at the demo's
batch, ~100-token prompts, 8 samples each and 32 new tokens, most of what attention reads). Otherwise (and for rows
not in groups) each row's buffer holds its prompt's keys and then its new tokens' (``rows x kv_heads x (prompt +
max_new_tokens) x head_dim``), attended with ``scaled_dot_product_attention(enable_gqa=True)``. Rows leave the batch
(and the buffers) once enough of them have finished. The logits processors are transformers' own (built by
``generate``'s helpers), applied to the same scores; the one difference is how a token is drawn from the processed
distribution: :func:`sample_from_scores` draws it by inverting the cumulative distribution (first over blocks of
tokens, then within one) with one uniform variate per row, instead of ``torch.multinomial`` (one exponential variate
per vocabulary entry). The sampled DISTRIBUTION is the same (``tests/test_decode.py`` tests it); the RNG stream, and
so a seeded run's samples, differ.
Greedy decoding (``do_sample=False``) gives ``generate``'s tokens (up to the rounding of batched products).

Measured (``benchmarks/rollout.py --mode hf-decode``, 2 CPU cores with AVX-512, load average 1.1-1.8, the demo's 16 x 8
rows, 32 tokens, medians of 3 alternating rounds): forced to 32 tokens, ``generate`` 282 tok/s (322 excluding the
prefill) vs this loop 478 (571), 1.69x (1.77x); with natural lengths (rows end at end-of-sequence), 177 vs 373 tok/s,
2.10x (2.28x excluding the prefill). Keeping each group's prompt once (this release; ``--baseline-rev 37b0f38``, Intel
Xeon with AMX, load average 0.6-1.7, forced to 32 tokens): ``generate`` 212 tok/s, the loop with a prompt copy per
row 337, with shared prompts 375 (1.11x the former, 1.77x ``generate``; docs/performance.md).

Precision: float32 weights, computed in float32, or in the caller's bf16 autocast region (``torch.autocast("cpu",
dtype=torch.bfloat16)``, as ``trainer.bf16: true`` runs on an AMX CPU; the trainer enters it around each rollout). There
the loop computes what ``generate`` computes under the same autocast (bf16 matrix products, the keys and values
rounded to bf16 as autocast's ``sdpa`` rounds them, so they are stored in bf16; bf16 logits, scored in float32) with
each weight cast to bf16 once per region instead of once per forward (autocast's cast cache), and without shared
prompts (tried: float32 attention over the bf16-rounded shared keys was no faster than autocast's bf16 ``sdpa`` over a
copy per row, 6.0-6.3 s against 5.7 s for the demo's rows). accelerate's mixed-precision wrapper of ``forward`` is
accepted inside such a region (it enters the same autocast again).

Only for decoder-only models whose attention is plain full causal attention over ``sdpa`` (Llama, Qwen2 without a
sliding window, Qwen3, Mistral without a sliding window), on a CPU, and for generation settings whose logits
processors and stopping criteria are among those handled here (temperature, top-k, top-p, minimum length;
``max_new_tokens``, which must be set, and end-of-sequence tokens); everything else keeps transformers' ``generate``
(:func:`klear.generation.prefill.grouped_prefill_generate` decides).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["decode_supported", "grouped_decode", "sample_from_scores"]

ATTENTION_NAME = "klear_grouped_decode"
#: Groups keep one copy of their prompt's keys (:func:`_shared_prompt_attention`) when the prompt has at least this
#: many tokens per new token allowed (``max_new_tokens``); shorter prompts keep a copy per row and ``sdpa``. Measured
#: (2 idle cores, one layer's attention at 128 rows): at the 16th of 32 new tokens after 100-token prompts (the demo)
#: the shared attention took 1.08 ms against sdpa's 1.68; at the 48th-90th new token after 38-token prompts (the
#: bench) 0.67-1.00 ms against 0.66-0.84, and a bench run's rollouts took 16% longer.
SHARED_PROMPT_MIN_LENGTH = 0.5
#: :func:`sample_from_scores`' block of tokens (the first level of its inverse-CDF search).
SAMPLE_BLOCK = 256
_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_PROCESSORS = (
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
)


def sample_from_scores(scores, *, workspace=None, generator=None):
    """One token per row from ``softmax(scores)`` (``scores``: ``(B, V)`` float32, ``-inf`` = impossible).

    Inverse-CDF sampling in two levels, with one uniform variate per row: ``exp(scores - max)`` is summed in blocks of
    :data:`SAMPLE_BLOCK` tokens (float32, pairwise), the block sums are accumulated in float64 and the variate picks a
    block; within it, the variate's place in the block's mass picks the first token whose cumulative weight (float64)
    exceeds it. Each token's probability is its weight over the total to float32 rounding (as ``softmax`` in float32
    computes it); a token of weight 0 is never drawn. The distribution is the same as
    ``torch.multinomial(softmax(scores), 1)``, with ``B`` uniform draws instead of ``B * V`` exponential ones, and one
    float64 cumulative sum over ``V / SAMPLE_BLOCK`` block sums and one over a block instead of one over ``V``
    (7x faster at 128 x 49 152).

    ``scores`` is left as it is; the weights are written to ``workspace``, a float32
    ``(B, sample_workspace_width(V))`` buffer, allocated when None.

    Raises:
        ValueError: ``workspace`` of another shape or dtype; a row with NaN or +inf, or with every score -inf
            (``torch.multinomial`` refuses these too).
    """
    import torch

    rows, vocab = scores.shape
    block, width = min(SAMPLE_BLOCK, vocab), sample_workspace_width(vocab)
    blocks = width // block
    if workspace is None:
        workspace = scores.new_empty((rows, width))
    elif workspace.shape != (rows, width) or workspace.dtype != torch.float32:
        raise ValueError(f"workspace must be float32 {(rows, width)}, got {workspace.dtype} {tuple(workspace.shape)}")
    peak = scores.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(peak).all()):  # NaN or +inf propagate to the row's maximum; all -inf: nothing to draw
        bad = int((~torch.isfinite(peak)).nonzero()[0, 0])
        raise ValueError(
            f"sample_from_scores: row {bad}'s scores hold NaN or +inf, or every token is -inf (max {peak[bad, 0]}): "
            "not a distribution to sample from"
        )
    torch.sub(scores, peak, out=workspace[:, :vocab]).exp_()
    workspace[:, vocab:].zero_()
    weights = workspace.view(rows, blocks, block)
    cum = weights.sum(-1).cumsum(-1, dtype=torch.float64)  # (B, blocks)
    total = cum[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=scores.device, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: never past the last block
    b = torch.searchsorted(cum, u, right=True)  # the first block whose cumulative mass exceeds u: (B, 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = weights.gather(1, b[:, :, None].expand(rows, 1, block)).squeeze(1).cumsum(-1, dtype=torch.float64)
    # u's place in the block; below the block's float64 total, which its float32 sum may exceed by rounding
    inner_total = inner[:, -1:]
    v = torch.minimum(u - before, torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    return (b * block + torch.searchsorted(inner, v, right=True)).squeeze(-1)


def sample_workspace_width(vocab: int) -> int:
    """Columns of :func:`sample_from_scores`' workspace for ``vocab`` tokens: ``ceil(V / K) * K``,
    ``K = min(SAMPLE_BLOCK, V)`` (whole blocks, the last one padded with zero weights)."""
    block = min(SAMPLE_BLOCK, vocab)
    return -(-vocab // block) * block


def in_groups(input_ids, attention_mask, group_size: int) -> bool:
    """Whether the ``(N, L)`` rows are groups of ``group_size`` identical prompts (rows ``g*G .. g*G+G-1`` the same
    ids and mask); ``group_size`` 1: any rows. False for ``group_size`` < 1 or one that does not divide ``N``."""
    n, length = input_ids.shape
    if not isinstance(group_size, int) or group_size < 1 or n % group_size:
        return False
    ids = input_ids.reshape(n // group_size, group_size, length)
    mask = attention_mask.reshape(n // group_size, group_size, length)
    return bool((ids == ids[:, :1]).all()) and bool((mask == mask[:, :1]).all())


def _process(processors, scores, length: int, eos, dummy):
    """transformers' logits processors on ``scores``: temperature and minimum length in place (the same arithmetic:
    ``scores / t``, end-of-sequence tokens set to ``-inf``), the others as transformers calls them."""
    for p in processors:
        name = type(p).__name__
        if name == "TemperatureLogitsWarper":
            scores.div_(p.temperature)
        elif name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
            shortest = p.min_length if name == "MinLengthLogitsProcessor" else p.min_new_tokens
            if length - getattr(p, "prompt_length_to_skip", 0) < shortest:
                eos = p.eos_token_id
                # transformers masks the vocabulary entries equal to an end-of-sequence id: ids outside it match none
                scores[:, eos[(eos >= 0) & (eos < scores.shape[1])]] = -float("inf")
        else:
            scores = p(dummy.expand(scores.shape[0], length), scores)
    return scores


class _State:
    """The decode buffers, written in place.

    Without ``prompt_bias``: per layer ``(rows, kv_heads, capacity, head_dim)`` keys and values, the prompt's at
    ``0 .. L-1`` (the prefill writes each prompt into its ``group`` rows) and each new token's after them.

    With ``prompt_bias`` (shared prompts, groups of ``G = group`` rows with the same prompt): the prompt's keys and
    values are kept once per group
    (``prompt_keys[i]``: ``(groups, kv_heads, L, head_dim)``, as the prefill computed them) and the new tokens' per row
    (``keys[i]``: ``(rows, kv_heads, capacity - L, head_dim)``); :func:`_shared_prompt_attention` attends over both.
    ``slot`` ``(rows,)`` int64 places each batch row in a ``(groups x G)`` grid (its group's place among the groups
    still decoding, times ``G``, plus its place in the group); None while the grid is the batch itself.
    """

    def __init__(self, layers: int, rows: int, capacity: int, group: int, prompt_bias=None, kv_dtype=None) -> None:
        self.keys: list[Any] = [None] * layers
        self.values: list[Any] = [None] * layers
        self.prompt_keys: list[Any] = [None] * layers
        self.prompt_values: list[Any] = [None] * layers
        self.prompt_bias = prompt_bias  # shared prompts: (groups, 1, 1, L) float32, 0 on prompt tokens, -inf on padding
        self.rows = rows
        self.capacity = capacity
        self.group = group  # during the prefill: each batch row stands for `group` consecutive rows
        self.slot = None
        self.pos = 0  # the position of the current forward's first key (prompt, then new tokens)
        self.offset = 0  # the position of the buffers' first entry (shared prompts: the first new token's)
        self.prefill = True
        self.kv_dtype = kv_dtype  # None: the keys' and values' own dtype; under autocast its dtype (what sdpa casts to)

    @property
    def shared(self) -> bool:
        """Whether each group's prompt is kept once (``prompt_bias`` given)."""
        return self.prompt_bias is not None

    def start_decoding(self, pos: int) -> None:
        """After the prefill: the next keys are those of position ``pos`` (the first new token) of every row."""
        self.prefill, self.pos = False, pos
        if self.shared:
            self.offset = pos

    def advance(self) -> None:
        self.pos += 1

    def select(self, kept, kept_rows) -> None:
        """Keep only the batch rows ``kept`` (a copy of each buffer); ``kept_rows``: their indices into the output
        (row ``r`` is in group ``r // G``). Shared prompts: only the groups with a row left keep their prompt."""
        import torch

        filled = self.pos - self.offset  # entries written so far; the rest of the capacity is never read before written

        def keep(buf):  # fresh buffers: their unwritten pages are never touched, whatever max_new_tokens is
            out = buf.new_empty((len(kept), *buf.shape[1:]))
            torch.index_select(buf[:, :, :filled], 0, kept, out=out[:, :, :filled])
            return out

        self.keys = [keep(k) for k in self.keys]
        self.values = [keep(v) for v in self.values]
        self.rows = len(kept)
        if not self.shared:
            return
        group = self.group
        left, rank = torch.unique(torch.div(kept_rows, group, rounding_mode="floor"), return_inverse=True)
        if len(left) < self.prompt_bias.shape[0]:  # some groups finished: drop their prompts
            old_slot = kept if self.slot is None else self.slot[kept]
            place = torch.zeros_like(left).scatter_(0, rank, torch.div(old_slot, group, rounding_mode="floor"))
            self.prompt_keys = [k.index_select(0, place) for k in self.prompt_keys]
            self.prompt_values = [v.index_select(0, place) for v in self.prompt_values]
            self.prompt_bias = self.prompt_bias.index_select(0, place)
        slot = rank * group + kept_rows % group
        self.slot = None if len(kept) == len(left) * group else slot  # None: every slot taken, in order


def _shared_prompt_attention(query, prompt_key, prompt_value, prompt_bias, key, value, slot, group: int, scale: float):
    """Attention of one new token per row over its group's prompt and its own new tokens.

    Args:
        query: ``(rows, heads, 1, head_dim)`` float32.
        prompt_key, prompt_value: ``(groups, kv_heads, L, head_dim)``, one prompt per group of ``group`` rows.
        prompt_bias: ``(groups, 1, 1, L)`` float32, 0 on the prompt's tokens and ``-inf`` on its padding.
        key, value: ``(rows, kv_heads, T, head_dim)``, the row's new tokens (``T >= 1``: the current one included).
        slot: ``(rows,)`` int64, each row's place in the ``(groups x group)`` grid; None: row ``r`` is slot ``r``.
        group: rows per group.
        scale: the scores' factor (``head_dim ** -0.5``).

    Returns:
        ``(rows, heads, 1, head_dim)``: ``softmax(q [K_prompt; K_new]^T * scale + mask) [V_prompt; V_new]``, what
        ``scaled_dot_product_attention`` gives over each row's concatenated keys (float32 rounding aside). A group's
        prompt keys and values are read once for all its rows: one matrix product per group and key/value head, the
        query heads that share a key/value head stacked as more rows, instead of one matrix-vector product per row.
    """
    import torch

    rows, heads, _, dim = query.shape
    groups, kv_heads, length, _ = prompt_key.shape
    rep = heads // kv_heads

    def to_grid(x):  # (rows, kv_heads, rep, n) -> (groups, kv_heads, group * rep, n): a group's rows stacked
        n = x.shape[-1]
        if slot is not None:
            x = x.new_zeros(groups * group, kv_heads, rep, n).index_copy_(0, slot, x)
        return x.view(groups, group, kv_heads, rep, n).transpose(1, 2).reshape(groups, kv_heads, group * rep, n)

    def from_grid(x):  # the inverse of to_grid
        n = x.shape[-1]
        x = x.view(groups, kv_heads, group, rep, n).transpose(1, 2).reshape(groups * group, kv_heads, rep, n)
        return x if slot is None else x.index_select(0, slot)

    q = query.reshape(rows, kv_heads, rep, dim)
    prompt_scores = torch.matmul(to_grid(q), prompt_key.transpose(-1, -2)).mul_(scale).add_(prompt_bias)
    new_scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (rows, kv_heads, rep, T)
    probs = torch.cat([from_grid(prompt_scores), new_scores], dim=-1).softmax(dim=-1)
    out = torch.matmul(probs[..., length:], value)  # (rows, kv_heads, rep, dim)
    out += from_grid(torch.matmul(to_grid(probs[..., :length]), prompt_value))
    return out.view(rows, heads, 1, dim)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``AttentionInterface`` function: store ``key``/``value`` in the buffers and attend over them (sdpa with GQA,
    or :func:`_shared_prompt_attention` when the rows' prompts are shared by groups)."""
    import torch

    state: _State = kwargs["klear_decode_state"]
    if attention_mask is None:  # a mask transformers did not pass through as-is would be dropped: refuse
        raise RuntimeError("grouped_decode's attention got no mask")
    i, length = module.layer_idx, key.shape[2]
    if state.prefill:
        if state.shared:  # the prompt's keys once per group, the new tokens' buffers per row
            state.prompt_keys[i], state.prompt_values[i] = key.contiguous(), value.contiguous()  # one copy
            shape = (state.rows, key.shape[1], state.capacity - length, key.shape[3])
            state.keys[i], state.values[i] = key.new_empty(shape), value.new_empty(shape)
        else:
            if state.keys[i] is None:
                shape = (state.rows, key.shape[1], state.capacity, key.shape[3])
                state.keys[i] = key.new_empty(shape, dtype=state.kv_dtype or key.dtype)
                state.values[i] = value.new_empty(shape, dtype=state.kv_dtype or value.dtype)
            for buf, new in ((state.keys[i], key), (state.values[i], value)):
                view = buf.view(key.shape[0], state.group, *buf.shape[1:])
                view[:, :, :, state.pos : state.pos + length].copy_(new[:, None])
        k, v = key, value
    else:
        end = state.pos - state.offset + length
        state.keys[i][:, :, end - length : end].copy_(key)
        state.values[i][:, :, end - length : end].copy_(value)
        k, v = state.keys[i][:, :, :end], state.values[i][:, :, :end]
        if state.shared:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = _shared_prompt_attention(
                query,
                state.prompt_keys[i],
                state.prompt_values[i],
                state.prompt_bias,
                k,
                v,
                state.slot,
                state.group,
                scale,
            )
            return out.transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k, v, attn_mask=attention_mask, scale=scaling, enable_gqa=k.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention_implementation(model):
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    config = model.config
    old = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = old


def _forward_wrapped(model, under_autocast: bool) -> bool:
    """Whether ``model.forward`` is wrapped by something that may change the computation (accelerate's
    mixed-precision autocast outside an autocast region of the caller, an unknown wrapper): then ``generate`` keeps
    the decoding.

    Not a wrapper in this sense: TRL's fused-LM-head patch (``trl.trainer.utils.add_fused_lm_head``, applied by
    ``GRPOTrainer``), an instance ``forward`` made with ``functools.wraps(type(model).forward)`` that calls the original
    forward unchanged unless ``fused_lm_head=True`` is passed (which the decode loop never does); and, inside the
    caller's bf16 autocast region (``under_autocast``), accelerate's wrapper, which enters that same autocast again
    (a no-op when nested) and returns float32 outputs."""
    if "_original_forward" in vars(model):  # accelerate keeps the unwrapped forward here when it wraps one
        return not under_autocast
    forward = vars(model).get("forward")
    if forward is None:
        return False
    func = getattr(forward, "__func__", forward)
    return getattr(func, "__wrapped__", None) is not type(model).forward


def _plan(model, input_ids, generation_config, kwargs):
    """``(config, processors, max_new, eos, pad)`` when :func:`grouped_decode` can run this generation, else None."""
    import torch

    under_autocast = torch.is_autocast_enabled("cpu")
    if (
        kwargs
        or input_ids.device.type != "cpu"
        or under_autocast
        and torch.get_autocast_dtype("cpu") != torch.bfloat16
        or any(p.dtype != torch.float32 for p in model.parameters())
        or _forward_wrapped(model, under_autocast)
    ):
        return None  # float32 weights, computed in float32 or under the caller's bf16 autocast
    config = getattr(model, "config", None)  # None: not a transformers model
    if (
        getattr(config, "model_type", None) not in _MODEL_TYPES
        or getattr(config, "is_encoder_decoder", False)
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True)
        or any(t != "full_attention" for t in (getattr(config, "layer_types", None) or []))
        or tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5)  # sdpa's enable_gqa
    ):
        return None
    try:
        gen, model_kwargs = model._prepare_generation_config(generation_config)
        if model_kwargs:
            return None
        model._prepare_special_tokens(gen, True, device=input_ids.device, batch_size=input_ids.shape[0])
        processors = model._get_logits_processor(
            generation_config=gen,
            input_ids_seq_length=input_ids.shape[1],
            encoder_input_ids=input_ids,
            device=input_ids.device,
        )
    except Exception:  # transformers' private helpers changed: keep generate
        return None
    if (
        any(type(p).__name__ not in _PROCESSORS for p in processors)
        or getattr(gen, "stop_strings", None)
        or getattr(gen, "max_time", None)
        or (getattr(gen, "num_beams", 1) or 1) != 1
        or (getattr(gen, "num_return_sequences", 1) or 1) != 1
        or getattr(gen, "return_dict_in_generate", False)
        or getattr(gen, "cache_implementation", None)
        or getattr(gen, "assistant_model", None) is not None
        or getattr(gen, "prompt_lookup_num_tokens", None)
        or getattr(gen, "penalty_alpha", None)
    ):
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or model.get_decoder() is model:
        return None
    eos = gen.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if eos else None)
    max_new = gen.max_new_tokens  # None: generate's own length rules (max_length and its defaults) apply
    if pad is None or max_new is None or max_new < 1:
        return None
    return gen, processors, int(max_new), eos, int(pad)


def decode_supported(model, input_ids, generation_config=None, **kwargs) -> bool:
    """Whether :func:`grouped_decode` handles this model, device and generation config (else use ``generate``)."""
    return _plan(model, input_ids, generation_config, kwargs) is not None


def grouped_decode(
    model,
    input_ids,
    attention_mask,
    *,
    group_size: int,
    generation_config=None,
    compact=0.125,
    log_probs: bool = False,
):
    """What ``model.generate(input_ids, attention_mask, generation_config=...)`` returns, decoded by klear's CPU loop.

    The model runs in eval mode (no dropout, unlike ``generate`` on a model in training mode with attention or
    hidden dropout); its training flag is restored afterwards.

    Args:
        model: a causal LM for which :func:`decode_supported` holds.
        input_ids: ``(N, L)`` LEFT-padded prompts, rows ``g*G .. g*G+G-1`` the same prompt (``G = group_size``;
            ``group_size=1``: any prompts).
        attention_mask: ``(N, L)`` 0/1.
        group_size: ``G``; each distinct prompt is prefilled once.
        generation_config: as for ``generate`` (merged with the model's the way ``generate`` merges it).
        compact: finished rows leave the batch once they are at least this fraction of it.
        log_probs: also return each new token's log-probability under ``log_softmax(logits / temperature)`` (the
            generation config's temperature; before top-k, top-p and minimum-length masking): the sampling policy's
            per-token log-prob as the trainer's log-prob pass computes it (``old_log_prob``), from the same forward
            (in float32; under bf16 autocast the KV-cached decode rounds differently from a full forward).

    Returns:
        ``(N, L + T)`` token ids: the prompts, then each row's new tokens, ``pad_token_id`` after its end-of-sequence
        token; ``T`` is the number of steps until every row finished (at most ``max_new_tokens``), as ``generate``.
        With ``log_probs``: ``(token_ids, log_probs)``, ``log_probs`` ``(N, T)`` float32, 0 after a row's end.

    Raises:
        ValueError: a model or generation config :func:`decode_supported` refuses (e.g. no ``max_new_tokens``), an
            ``attention_mask`` not shaped like ``input_ids``, a row not ending with a prompt token (right padding),
            rows that are not groups of ``group_size`` identical prompts (:func:`in_groups`), or a row whose scores
            cannot be sampled from (:func:`sample_from_scores`).
    """
    import torch

    plan = _plan(model, input_ids, generation_config, {})
    if plan is None:
        raise ValueError("grouped_decode does not support this model or generation config (see decode_supported)")
    gen, processors, max_new, eos_list, pad = plan
    n, length = input_ids.shape
    if attention_mask is None or tuple(attention_mask.shape) != (n, length):
        got = None if attention_mask is None else tuple(attention_mask.shape)
        raise ValueError(f"grouped_decode: attention_mask must be {(n, length)} like input_ids, got {got}")
    if not bool(attention_mask[:, -1].bool().all()):
        row = int((~attention_mask[:, -1].bool()).nonzero()[0, 0])
        raise ValueError(f"grouped_decode: row {row} does not end with a prompt token (prompts must be left-padded)")
    if not in_groups(input_ids, attention_mask, group_size):
        raise ValueError(
            f"grouped_decode: {n} rows are not groups of group_size={group_size} identical prompts (rows g*G .. "
            "g*G+G-1 the same prompt and mask)"
        )
    device = input_ids.device
    mask = attention_mask.bool()
    uniq_ids, uniq_mask = input_ids[::group_size], mask[::group_size]
    eos = torch.tensor(eos_list, dtype=torch.long, device=device)
    # under the caller's bf16 autocast: keys and values kept in bf16 (what its sdpa casts them to); autocast caches
    # each weight's bf16 copy while its region lasts (the whole call when the caller's region spans it)
    kv_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    prompt_bias = None
    if kv_dtype is None and group_size > 1 and length >= SHARED_PROMPT_MIN_LENGTH * max_new:  # shared prompts
        prompt_bias = torch.zeros((len(uniq_ids), 1, 1, length), dtype=torch.float32, device=device)
        prompt_bias.masked_fill_(~uniq_mask[:, None, None, :], -float("inf"))
    state = _State(model.config.num_hidden_layers, n, length + max_new - 1, group_size, prompt_bias, kv_dtype)
    # the attention mask over all buffer positions (prompt, then one column per generated token)
    key_mask = torch.zeros((n, 1, 1, state.capacity), dtype=torch.bool, device=device)
    key_mask[:, 0, 0, :length] = mask
    causal = torch.ones((length, length), dtype=torch.bool, device=device).tril()
    prefill_mask = (causal & uniq_mask[:, None, None, :]) | torch.eye(length, dtype=torch.bool, device=device)
    position = (uniq_mask.long().cumsum(-1) - 1).masked_fill(~uniq_mask, 1)
    tokens = torch.full((n, max_new), pad, dtype=torch.long, device=device)
    token_log_probs = torch.zeros((n, max_new), dtype=torch.float32, device=device) if log_probs else None
    temperature = float(gen.temperature) if gen.temperature is not None else 1.0
    rows = torch.arange(n, device=device)  # the batch's rows, as indices into the output
    unfinished = torch.ones(n, dtype=torch.bool, device=device)
    dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    # (B, V) workspaces, allocated once: fresh ones every step cost more in page faults than their arithmetic
    vocab = head.weight.shape[0]
    sample_buf = torch.empty((n, sample_workspace_width(vocab)), device=device) if gen.do_sample else None
    logits_buf = torch.empty((n, vocab), dtype=torch.float32, device=device)
    scaled_buf = torch.empty((n, vocab), dtype=torch.float32, device=device) if log_probs else None
    was_training = model.training
    steps = 0
    try:
        model.eval()
        with torch.no_grad(), _attention_implementation(model):
            out = model(
                input_ids=uniq_ids,
                attention_mask=prefill_mask,
                position_ids=position,
                use_cache=False,
                logits_to_keep=1,
                klear_decode_state=state,
            )
            logits_buf.view(len(uniq_ids), group_size, -1).copy_(out.logits[:, -1:].float())
            logits = logits_buf
            del out
            next_pos = position[:, -1:].repeat_interleave(group_size, dim=0) + 1
            state.start_decoding(length)
            for step in range(max_new):
                if token_log_probs is not None and scaled_buf is not None:  # before the in-place processing
                    scaled = torch.div(logits, temperature, out=scaled_buf[: len(rows)])
                    normaliser = torch.logsumexp(scaled, dim=-1)
                scores = _process(processors, logits, length + step, eos, dummy)
                if gen.do_sample:
                    token = sample_from_scores(
                        scores, workspace=None if sample_buf is None else sample_buf[: len(rows)]
                    )
                else:
                    token = scores.argmax(dim=-1)
                if token_log_probs is not None:
                    picked = scaled.gather(1, token[:, None]).squeeze(1) - normaliser
                    token_log_probs[rows, step] = torch.where(unfinished, picked, 0.0)
                token = torch.where(unfinished, token, pad)
                tokens[rows, step] = token
                steps = step + 1
                unfinished &= ~torch.isin(token, eos)
                if step == max_new - 1 or not bool(unfinished.any()):
                    break
                done = len(rows) - int(unfinished.sum())
                if done and done >= compact * len(rows):
                    kept = unfinished.nonzero().squeeze(-1)
                    state.select(kept, rows[kept])
                    rows, token, unfinished = rows[kept], token[kept], unfinished[kept]
                    key_mask, next_pos = key_mask[kept], next_pos[kept]
                key_mask[:, 0, 0, state.pos] = True
                hidden = decoder(
                    input_ids=token[:, None],
                    attention_mask=key_mask[:, :, :, : state.pos + 1],
                    position_ids=next_pos,
                    use_cache=False,
                    klear_decode_state=state,
                ).last_hidden_state[:, -1]
                if kv_dtype is None:
                    logits = torch.mm(hidden, head.weight.t(), out=logits_buf[: len(rows)])
                else:  # the head under autocast (bf16 logits, as generate's), scored in float32 as generate does
                    logits = logits_buf[: len(rows)].copy_(torch.nn.functional.linear(hidden, head.weight))
                state.advance()
                next_pos = next_pos + 1
    finally:
        model.train(was_training)
    ids = torch.cat([input_ids, tokens[:, :steps]], dim=1)
    return (ids, token_log_probs[:, :steps]) if token_log_probs is not None else ids
