"""Greedy generation that drops finished sequences from the batch (for held-out evaluation on CPU).

``model.generate`` keeps every sequence of a batch until the LAST one stops, so one response that
runs to the token budget makes the whole batch pay for it: on the demo's held-out set (128 problems,
256 new tokens, most answers 30-150 tokens) that is 3-4x more decoding than needed, and decoding is
compute-bound on a CPU. :func:`greedy_generate` prefills the batch once and removes each sequence from
the batch (and from the KV cache, ``DynamicCache.batch_select_indices``) as soon as it emits an
end-of-sequence token, so the cost follows the tokens actually generated.

The tokens are the greedy argmax of the same model on the same left-padded inputs as
:func:`klear.eval.heldout.generate`; only the floating-point rounding of batched matrix products can
differ when the batch shrinks, which flips a near-tie argmax very rarely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["greedy_generate"]


def _as_messages(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise ValueError("greedy_generate needs an end-of-sequence token (generation_config or tokenizer)")
    return ids


def greedy_generate(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    max_new_tokens: int,
    batch_size: int = 128,
    show_progress: bool = True,
) -> list[str]:
    """Greedy completions of chat prompts, dropping each sequence from the batch when it ends.

    Each prompt (a list of ``{"role", "content"}`` messages, or a string = one user message) is
    rendered with the chat template (``add_generation_prompt=True``); prompts are batched in order
    of length with LEFT padding. A sequence ends at the first token in the end-of-sequence set
    (``model.generation_config.eos_token_id``, else ``tokenizer.eos_token_id``) or after
    ``max_new_tokens`` tokens. New tokens are decoded with ``skip_special_tokens=True``.

    Args:
        model: a causal LM whose forward accepts ``cache`` / ``past_key_values`` (a ``DynamicCache``),
            ``position_ids`` and ``logits_to_keep``.
        tokenizer: its tokenizer (chat template; pad token, else eos, for padding).
        prompts: the chat prompts.
        max_new_tokens: token budget per completion (>= 1).
        batch_size: prompts prefilled together (>= 1).
        show_progress: a tqdm bar over generated tokens.

    Returns:
        One completion per prompt, in input order.

    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` < 1, or no end-of-sequence token.

    The model's training flag and the tokenizer's padding side are restored afterwards.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = list(prompts)
    if not prompts:
        return []
    texts = [tokenizer.apply_chat_template(_as_messages(p), tokenize=False, add_generation_prompt=True)
             for p in prompts]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    eos = torch.tensor(_eos_ids(model, tokenizer))
    device = next(model.parameters()).device
    eos = eos.to(device)
    results: list[list[int]] = [[] for _ in texts]
    # transformers >= 5.2x names the KV-cache argument ``cache`` (``past_key_values`` is deprecated)
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    old_side, was_training = tokenizer.padding_side, model.training
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    bar = tqdm(total=len(texts), desc="generate (greedy)", unit="seq", disable=not show_progress)
    try:
        tokenizer.padding_side = "left"
        model.eval()
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(device)
                attn = enc["attention_mask"]
                pos = attn.long().cumsum(-1) - 1
                pos = pos.masked_fill(attn == 0, 1)
                cache = DynamicCache(config=model.config)
                out = model(input_ids=enc["input_ids"], attention_mask=attn, position_ids=pos,
                            use_cache=True, logits_to_keep=1, **{cache_kw: cache})
                alive = torch.tensor(idx, device=device)
                last_pos = pos[:, -1:]
                for step in range(max_new_tokens):
                    token = out.logits[:, -1, :].argmax(dim=-1)
                    for row, tok in zip(alive.tolist(), token.tolist()):
                        results[row].append(tok)
                    keep = ~torch.isin(token, eos)
                    if step == max_new_tokens - 1 or not bool(keep.any()):
                        bar.update(len(alive))
                        break
                    if not bool(keep.all()):
                        bar.update(int((~keep).sum()))
                        kept = keep.nonzero().squeeze(-1)
                        cache.batch_select_indices(kept)
                        alive, token, attn, last_pos = alive[kept], token[kept], attn[kept], last_pos[kept]
                    attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
                    last_pos = last_pos + 1
                    out = model(input_ids=token[:, None], attention_mask=attn, position_ids=last_pos,
                                use_cache=True, **{cache_kw: cache})
    finally:
        bar.close()
        tokenizer.padding_side = old_side
        model.train(was_training)
    return tokenizer.batch_decode(results, skip_special_tokens=True)
