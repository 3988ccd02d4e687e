"""Held-out evaluation: greedy generation and scoring, compared before/after with :mod:`klear.stats`.

Typical use (before and after RL, on the SAME held-out problems)::

    before = evaluate(base_model, tok, heldout, max_new_tokens=128)
    after = evaluate(rl_model, tok, heldout, max_new_tokens=128)
    stats = klear.stats.paired_difference(before["correct"], after["correct"])

``evaluate`` scores with ``klear.rewards.compute_scores`` unless a ``scorer`` is given. A
problem counts as correct when its reward equals the "correct" score, 1.0 (paper Sec. 3.2.4:
correct = +1, wrong = -1). ``klear rl`` and ``klear sft`` both evaluate with it.

Greedy decoding is :func:`greedy_generate`, the one greedy generator of klear: ``model.generate``
keeps every sequence of a batch until the LAST one stops, so one response that runs to the token
budget makes the whole batch pay for it (on the SFT demo's held-out set, 3-4x more decoding than
needed, and decoding is compute-bound on a CPU). :func:`greedy_generate` prefills the batch once
and removes each sequence from the batch (and from the KV cache,
``DynamicCache.batch_select_indices``) as soon as it emits an end-of-sequence token. The tokens are
the greedy argmax of the same model on the same left-padded inputs as ``model.generate``; only the
floating-point rounding of batched matrix products can differ when the batch shrinks, which flips
a near-tie argmax very rarely.

The paper reports avg@n with temperature 0.6 (Sec. 4.2); on a small demo model we use greedy
decoding (one deterministic sample per problem), so a before/after difference is a paired
difference over problems, tested with McNemar's exact test.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from klear.rewards.correctness import is_correct

Scorer = Callable[..., list]


def _as_messages(prompt: Any) -> list[dict]:
    """Normalise one prompt to a list of chat messages (a plain string becomes one user message)."""
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
    model, tokenizer, prompts: Sequence, *, max_new_tokens: int, batch_size: int = 128, show_progress: bool = True
) -> list[str]:
    """Greedy completions of chat prompts, dropping each sequence from the batch when it ends.

    Each prompt (a list of ``{"role", "content"}`` messages, or a string = one user message) is
    rendered with the chat template (``add_generation_prompt=True``); prompts are batched in order
    of length with LEFT padding, and the token prefix a whole batch shares (a system prompt, few-shot
    turns) is prefilled once and repeated in the KV cache (the rest of each prompt is left-padded
    after it; attention masks the gap, positions skip it). A sequence ends at the first token in the end-of-sequence set
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

    The model's training flag is restored afterwards.
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
    texts = [
        tokenizer.apply_chat_template(_as_messages(p), tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(texts)), key=lambda i: (len(ids[i]), i))
    eos = torch.tensor(_eos_ids(model, tokenizer))
    device = next(model.parameters()).device
    eos = eos.to(device)
    results: list[list[int]] = [[] for _ in texts]
    from klear.models.cache import cache_kwarg

    cache_kw = cache_kwarg(model.forward)

    def forward(cache, input_ids, position_ids, attention_mask=None):  # extends *cache*; last position's logits
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: cache},
        )

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    bar = tqdm(total=len(texts), desc="generate (greedy)", unit="seq", disable=not show_progress)
    try:
        model.eval()
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                rows = [ids[i] for i in idx]
                # the batch's common token prefix (system prompt, few-shot turns) is prefilled once
                shared = _common_prefix_length(rows, limit=len(rows[0]) - 1) if len(rows) > 1 else 0
                cache = DynamicCache(config=model.config)
                if shared:
                    forward(
                        cache,
                        torch.tensor([rows[0][:shared]], device=device),
                        torch.arange(shared, device=device)[None],
                    )
                    cache.batch_repeat_interleave(len(rows))
                width = max(len(r) for r in rows) - shared
                suffix = torch.tensor([[pad_id] * (width - len(r) + shared) + r[shared:] for r in rows], device=device)
                suffix_mask = (
                    torch.arange(width, device=device)[None]
                    >= torch.tensor([width - len(r) + shared for r in rows], device=device)[:, None]
                ).long()
                attn = torch.cat([suffix_mask.new_ones((len(rows), shared)), suffix_mask], dim=1)
                pos = (shared + suffix_mask.cumsum(-1) - 1).masked_fill(suffix_mask == 0, 1)
                out = forward(cache, suffix, pos, attn)
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
                    out = forward(cache, token[:, None], last_pos, attn)
    finally:
        bar.close()
        model.train(was_training)
    return tokenizer.batch_decode(results, skip_special_tokens=True)


def _common_prefix_length(rows: Sequence[Sequence[int]], limit: int) -> int:
    """Length of the longest token prefix all ``rows`` share, at most ``limit``; 0 when under 16 tokens."""
    first, n = rows[0], 0
    while n < limit and all(len(r) > n and r[n] == first[n] for r in rows):
        n += 1
    return n if n >= 16 else 0


def generate(
    model,
    tokenizer,
    prompts: Sequence,
    *,
    max_new_tokens: int,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    group_size: int = 1,
    show_progress: bool = True,
) -> list[str]:
    """Generate one completion per chat prompt: greedy (:func:`greedy_generate`) or sampled
    (:func:`klear.generation.hf.generate_token_ids`).

    Each prompt (a list of ``{"role", "content"}`` messages, or a plain string treated as one
    user message) is rendered with the tokenizer's chat template (``add_generation_prompt=True``),
    batched with LEFT padding, and sampled under ``torch.no_grad()`` in eval mode (on a CPU, in
    float32 or in a bf16 autocast region, by klear's decode loop, :mod:`klear.generation.decode`; else
    ``model.generate``).
    Prompts are batched in order of length (less padding) and the results are returned in the
    input order. Only the new tokens are decoded, with ``skip_special_tokens=True``. Greedy
    decoding (the default) is :func:`greedy_generate`.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``).
        tokenizer: its tokenizer; must have a chat template and a pad token (falls back to eos).
        prompts: chat prompts (list of message lists, or strings).
        max_new_tokens: generation budget per completion.
        batch_size: prompts per ``generate`` call.
        do_sample: sample instead of greedy decoding (default greedy).
        temperature: sampling temperature (used only when ``do_sample``).
        top_p: nucleus sampling threshold (used only when ``do_sample``).
        group_size: sampling only: ``prompts`` holds each prompt ``group_size`` times in a row; each
            group's prompt is prefilled once (:func:`klear.generation.prefill.grouped_prefill_generate`). Keep
            ``batch_size`` a multiple of it.
        show_progress: show a tqdm progress bar over batches.

    Returns:
        The completion texts, one per prompt, in the order of ``prompts``.

    Raises:
        ValueError: ``batch_size`` or ``max_new_tokens`` is not positive.

    The tokenizer's ``padding_side`` is restored afterwards (even on error); the model is
    left in eval mode only if it was already, i.e. its training flag is restored too.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not do_sample:
        return greedy_generate(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, show_progress=show_progress
        )
    prompts = list(prompts)
    if not prompts:
        return []

    texts = [
        tokenizer.apply_chat_template(_as_messages(p), tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    import copy

    from klear.generation.hf import generate_token_ids

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = copy.deepcopy(model.generation_config)
    config.update(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        pad_token_id=pad_id,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
    )
    with tqdm(total=len(texts), desc="generate", unit="seq", disable=not show_progress) as bar:
        ids = generate_token_ids(
            model,
            tokenizer,
            texts,
            generation_config=config,
            batch_size=batch_size,
            group_size=group_size,
            on_batch=bar.update,
        )
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def _default_scorer() -> Scorer:
    from klear.rewards import compute_scores  # lazy: optional at import time

    return compute_scores


def eval_batches(tokenizer, prompts: Sequence, batch_size: int) -> list[list[int]]:
    """The decoding batches of ``prompts``: their indices sorted by (prompt tokens after the chat template,
    index) and cut every ``batch_size``, the order :func:`greedy_generate` and :func:`generate` batch in.

    They depend on the prompts and ``batch_size`` only, never on the number of processes, so a batch decodes
    the same way whichever process decodes it (:func:`evaluate`).
    """
    texts = [
        tokenizer.apply_chat_template(_as_messages(p), tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@contextlib.contextmanager
def compute_precision(model, dtype: str | None):
    """Run the block's forward passes in ``dtype``: ``"bfloat16"``/``"float16"`` under ``torch.autocast`` on the
    model's device type; ``"float32"`` or ``None``: as the model's weights are (no autocast).

    The held-out evaluations of a training run use the training's mixed precision (S1 of issue 22): the same
    autocast accelerate wraps the prepared module's ``forward`` in (``Accelerator.prepare_model`` with native AMP),
    entered explicitly, so the evaluation before ``train()`` (module not prepared yet) computes exactly as the
    ones after (prepared: the nested autocast of the same dtype changes nothing).
    """
    import torch

    if dtype in (None, "float32"):
        yield
        return
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"compute dtype {dtype!r}: expected bfloat16, float16 or float32")
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type=device_type, dtype=getattr(torch, dtype)):
        yield


@contextlib.contextmanager
def private_rng():
    """Restore the CPU RNG and EVERY visible CUDA device's RNG on exit (``torch.manual_seed`` inside reseeds them
    all; ``fork_rng(devices=[])`` would restore the CPU one only, S2 of issue 22)."""
    import torch

    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def batch_seed(seed: int, batch: int) -> int:
    """The sampling seed of decoding batch ``batch`` of an evaluation seeded ``seed`` (numpy ``SeedSequence``:
    distinct streams for distinct ``(seed, batch)``, whatever process decodes the batch)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, batch]).generate_state(1, dtype=np.uint64)[0] >> 1)


def decode_in_rounds(n_batches: int, work: Callable[[int], Any], *, process_index: int, num_processes: int, gather):
    """Run ``work(j)`` for every batch ``j < n_batches``, process ``p`` taking batches ``p, p + P, p + 2P, ...``;
    after each round (one batch per process) ``gather`` (``accelerate.utils.gather_object``) hands every process
    every result of the round, so no process waits on another for longer than one batch.

    Returns:
        ``[work(0), ..., work(n_batches - 1)]`` on every process.

    Raises:
        RuntimeError: on every process, when ``work`` raised on one (its error, and the process, named); with
            one process the error itself propagates.
    """
    if num_processes == 1:
        return [work(j) for j in range(n_batches)]
    results: list[Any] = [None] * n_batches
    for start in range(0, n_batches, num_processes):
        j = start + process_index
        item: tuple | None = None
        if j < n_batches:
            try:
                item = (j, work(j), None)
            except Exception as e:  # every process must reach the gather, then all raise
                item = (j, None, f"{type(e).__name__}: {e}")
        got = gather([item])
        errors = [f"batch {i}: {err}" for i, _, err in (g for g in got if g is not None) if err is not None]
        if errors:
            raise RuntimeError(f"held-out evaluation failed on process {process_index}'s round: {'; '.join(errors)}")
        for g in got:
            if g is not None:
                results[g[0]] = g[1]
    return results


def evaluate(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int,
    batch_size: int = 32,
    scorer: Scorer | None = None,
    n_samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    show_progress: bool = True,
    compute_dtype: str | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    gather=None,
    backend=None,
) -> dict:
    """Decode every problem of an RL dataset (greedy once, or ``n_samples`` samples) and score it.

    Greedy (``temperature=0``, the default): one completion per problem, ``correct[i]`` a bool.
    Sampled (``temperature > 0``): ``n_samples`` completions per problem at that temperature
    (top-p 1, full vocabulary, as the rollouts sample), ``correct[i]`` the problem's fraction of
    correct samples (its avg@n, paper Sec. 4.2) and ``accuracy`` their mean. Each decoding batch
    (:func:`eval_batches`) samples from the RNG seeded with :func:`batch_seed` ``(seed, batch)`` inside
    :func:`private_rng`, so the same model gives the same samples (on any number of processes), a
    before/after comparison uses common random numbers, and the caller's RNG streams (e.g. training's,
    CPU and CUDA) are left untouched.

    Several processes (``num_processes > 1``) share the work: the batches are dealt round-robin
    (:func:`decode_in_rounds`), ``gather`` exchanges the completions after every round, each process
    scores the samples it decoded and ``gather`` exchanges the rewards; every process returns the whole
    result, in dataset order, equal to a 1-process evaluation's (a batch decodes the same way on any
    process).

    Args:
        model: causal LM to evaluate.
        tokenizer: its tokenizer (with chat template).
        dataset: rows in the verl RL layout (see :mod:`klear.data.rl_data`): ``prompt``
            (chat messages), ``data_source``, ``reward_model.ground_truth``, optional
            ``extra_info`` and ``prompt_id``. A ``datasets.Dataset`` or a list of dicts.
        max_new_tokens: generation budget per problem.
        batch_size: prompts per generate call.
        scorer: ``scorer(data_sources, solution_strs, ground_truths, extra_infos) -> list[float]``
            (same signature as ``klear.rewards.compute_scores``), called once per process on the samples it
            decoded (dataset order); default that function, imported lazily.
        n_samples: completions per problem (> 1 needs ``temperature > 0``).
        temperature: 0 for greedy decoding, else the sampling temperature.
        seed: sampling seed.
        show_progress: tqdm progress bar while generating.
        compute_dtype: forward passes under :func:`compute_precision` (``None``: the weights' dtype).
        process_index, num_processes: this process and the number of processes sharing the evaluation.
        gather: with ``num_processes > 1``, ``fn(list) -> list`` concatenating every process's list
            (``accelerate.utils.gather_object``).
        backend: generate with this instead of ``model`` (:class:`klear.eval.backends.ColocatedEval`):
            ``backend.complete(prompts, prompt_ids, n_samples=, temperature=, seed=, max_new_tokens=)`` returns
            the problem-major completions (``batch_size`` unused). Every process calls it once (its weight sync
            is a collective); each group of ``backend.group_size`` processes (one tensor-parallel engine) gets
            its share of the problems, the same share on every process of the group.

    Returns:
        ``{"accuracy": float, "n": int, "correct": list, "rewards": list[float],
        "completions": list[str], "prompt_ids": list[str], "samples_per_problem": int,
        "temperature": float}``. ``n``, ``correct`` and ``prompt_ids`` are per problem in dataset
        order; ``rewards`` and ``completions`` per sample, problem-major (the ``n_samples`` samples of
        problem 0 first). A sample is correct when its reward is 1.0. ``prompt_ids`` falls back to the
        row index (as a string) when the dataset has no ``prompt_id`` column. An empty dataset gives
        accuracy 0.0 and n 0.

    Raises:
        RuntimeError: the judge could not score a sample (``nan``, unscored; the paired comparison needs
            every verdict); with several processes, any error of one process's batch (on every process).
        ValueError: the scorer returned a different number of scores than samples; ``n_samples < 1``,
            ``temperature < 0``, or several samples with greedy decoding.
    """
    from klear.rewards import require_scored

    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an integer >= 1, got {n_samples!r}")
    if temperature < 0 or (n_samples > 1 and temperature == 0):
        raise ValueError(
            f"temperature={temperature!r}: must be > 0 to draw n_samples={n_samples} samples "
            "(0 means greedy decoding, one completion per problem)"
        )
    if num_processes > 1 and gather is None:
        raise ValueError(f"evaluate on {num_processes} processes needs gather (accelerate.utils.gather_object)")
    rows = [dataset[i] for i in range(len(dataset))]
    if scorer is None:
        scorer = _default_scorer()
    k = n_samples
    prompts = [r["prompt"] for r in rows for _ in range(k)]
    prompt_ids = [str(r.get("prompt_id", i)) for i, r in enumerate(rows)]
    data_sources = [r["data_source"] for r in rows for _ in range(k)]
    ground_truths = [r["reward_model"]["ground_truth"] for r in rows for _ in range(k)]
    extra_infos = [r.get("extra_info") for r in rows for _ in range(k)]
    rounds = {"process_index": process_index, "num_processes": num_processes, "gather": gather}
    if backend is not None:
        completions, shares = _complete_on_engine(
            backend,
            rows,
            prompt_ids,
            n_samples=k,
            temperature=temperature,
            seed=seed,
            max_new_tokens=max_new_tokens,
            **rounds,
        )
    else:
        completions, shares = _decode_with_model(
            model,
            tokenizer,
            prompts,
            batch_size=batch_size,
            n_samples=k,
            temperature=temperature,
            seed=seed,
            max_new_tokens=max_new_tokens,
            compute_dtype=compute_dtype,
            show_progress=show_progress,
            **rounds,
        )

    # each process scores its share of the samples (dataset order), in one call
    def score(p: int) -> list[float]:
        idx = shares[p]
        if not idx:
            return []
        got = scorer(
            [data_sources[i] for i in idx],
            [completions[i] for i in idx],
            [ground_truths[i] for i in idx],
            [extra_infos[i] for i in idx],
        )
        scores = [float(x) for x in got]
        if len(scores) != len(idx):
            raise ValueError(f"scorer returned {len(scores)} scores for {len(idx)} samples")
        return scores

    rewards: list[float] = [math.nan] * len(prompts)
    for idx, scores in zip(shares, decode_in_rounds(num_processes, score, **rounds)):
        for i, x in zip(idx, scores):
            rewards[i] = x
    if num_processes > 1:
        print(
            f"held-out evaluation: process {process_index} of {num_processes} decoded "
            f"{len(shares[process_index]) // k} of {len(rows)} problems",
            flush=True,
        )
    # the per-problem results are compared pairwise (before/after), so every sample needs a verdict
    require_scored(rewards, lambda i: f"held-out problem {rows[i // k].get('prompt_id', i // k)} sample {i % k}")
    hits = [is_correct(r) for r in rewards]
    correct: list = hits if k == 1 else [sum(hits[i * k : (i + 1) * k]) / k for i in range(len(rows))]
    n = len(rows)
    return {
        "accuracy": (sum(correct) / n) if n else 0.0,
        "n": n,
        "correct": correct,
        "rewards": rewards,
        "completions": completions,
        "prompt_ids": prompt_ids,
        "samples_per_problem": k,
        "temperature": float(temperature),
    }


def _decode_with_model(
    model,
    tokenizer,
    prompts: list,
    *,
    batch_size: int,
    n_samples: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    compute_dtype: str | None,
    show_progress: bool,
    process_index: int,
    num_processes: int,
    gather,
) -> tuple[list[str], list[list[int]]]:
    """:func:`evaluate`'s HF decoding: ``(completions, shares)``, ``shares[p]`` the sample indices process ``p``
    decoded (and scores). Batches (:func:`eval_batches`) are dealt round-robin (:func:`decode_in_rounds`)."""
    from tqdm.auto import tqdm

    k = n_samples
    # sampled: each batch holds whole groups of k (the sort keeps a problem's k copies together)
    batches = eval_batches(tokenizer, prompts, batch_size if temperature == 0 else max(k, batch_size // k * k))
    bar = tqdm(total=len(prompts), desc="held-out", unit="seq", disable=not show_progress)

    def decode(j: int) -> list[str]:
        sub = [prompts[i] for i in batches[j]]
        with compute_precision(model, compute_dtype):
            if temperature == 0:
                texts = generate(
                    model, tokenizer, sub, max_new_tokens=max_new_tokens, batch_size=len(sub), show_progress=False
                )
            else:
                import torch

                with private_rng():
                    torch.manual_seed(batch_seed(seed, j))
                    texts = generate(
                        model,
                        tokenizer,
                        sub,
                        max_new_tokens=max_new_tokens,
                        batch_size=len(sub),
                        do_sample=True,
                        temperature=temperature,
                        group_size=k,
                        show_progress=False,
                    )
        bar.update(len(sub))
        return texts

    rounds = {"process_index": process_index, "num_processes": num_processes, "gather": gather}
    try:
        decoded = decode_in_rounds(len(batches), decode, **rounds)
    finally:
        bar.close()
    completions: list[str] = [""] * len(prompts)
    for idx, texts in zip(batches, decoded):
        for i, text in zip(idx, texts):
            completions[i] = text
    shares = [
        sorted(i for j in range(p, len(batches), num_processes) for i in batches[j]) for p in range(num_processes)
    ]
    return completions, shares


def _complete_on_engine(
    backend,
    rows: list,
    prompt_ids: list[str],
    *,
    n_samples: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    process_index: int,
    num_processes: int,
    gather,
) -> tuple[list[str], list[list[int]]]:
    """:func:`evaluate` on a generation backend: ``(completions, shares)`` as :func:`_decode_with_model` gives them.

    Engine group ``g`` (processes ``g * G ... g * G + G - 1``, ``G = backend.group_size``) completes the problems
    ``i`` with ``i % (P // G) == g``; the first process of each group hands its texts to every process. Scoring is
    shared by problem: process ``p`` scores the problems ``i`` with ``i % P == p``.
    """
    k = n_samples
    group = max(1, int(getattr(backend, "group_size", 1) or 1))
    n_groups = max(1, num_processes // group)
    mine = [i for i in range(len(rows)) if i % n_groups == process_index // group]
    texts = backend.complete(
        [rows[i]["prompt"] for i in mine],
        [prompt_ids[i] for i in mine],
        n_samples=k,
        temperature=temperature,
        seed=seed,
        max_new_tokens=max_new_tokens,
    )
    if len(texts) != len(mine) * k:
        raise ValueError(f"{type(backend).__name__}.complete returned {len(texts)} texts for {len(mine) * k} samples")
    got = gather([(process_index % group == 0, mine, texts)]) if num_processes > 1 else [(True, mine, texts)]
    completions: list[str] = [""] * (len(rows) * k)
    for leader, idx, part in got:
        if leader:
            for pos, i in enumerate(idx):
                completions[i * k : (i + 1) * k] = part[pos * k : (pos + 1) * k]
    shares = [[i * k + j for i in range(p, len(rows), num_processes) for j in range(k)] for p in range(num_processes)]
    return completions, shares
