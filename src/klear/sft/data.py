"""SFT datasets: chat files, prompt/response files, and the embedded teacher set.

Every dataset built here is a ``datasets.Dataset`` in TRL's conversational prompt-completion
layout, which :class:`klear.sft.trainer.KlearSFTTrainer` trains with the loss on the completion
only:

* ``prompt``: chat messages before the response, a list of ``{"role": str, "content": str}``;
* ``completion``: ``[{"role": "assistant", "content": response}]`` (the tokens that carry loss);
* ``data_source``: str (selects the scorer for correctness filtering; ``"math"`` by default);
* ``ground_truth``: str or None (the reference answer, when the file gives one);
* ``difficulty``: ``"easy"``, ``"hard"`` or None.

Sources:

* :func:`load_sft_file` reads JSONL / JSON / parquet with, per row, EITHER ``messages`` (a chat
  whose LAST message is the assistant response that is trained; earlier turns, including
  earlier assistant turns, are context only) OR ``prompt`` (a string or a chat list) plus
  ``response`` (a string; ``completion`` is accepted as an alias, also as a one-message list).
  Optional: ``ground_truth`` (or ``reward_model.ground_truth``), ``data_source``,
  ``difficulty`` (``easy``/``hard``) or ``pass_rate`` (a number in [0, 1]).
* :func:`make_teacher_sft_dataset` writes worked arithmetic solutions with the procedural
  teacher (:mod:`klear.sft.teacher`) for reasoning-gym problems, next to a disjoint held-out
  set in the RL layout (:mod:`klear.data.rl_data`) for evaluation.

Correctness/difficulty filtering (paper Sec. 5.1.1, Table 2), :func:`filter_sft_dataset`: easy prompts
keep only correct responses, hard prompts keep everything (``by_difficulty``, Klear's rule), or
every prompt keeps only correct responses (``correct``). Correctness is the math reward of
:mod:`klear.rewards` (last ``\\boxed{}`` after ``</think>`` checked with math-verify).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from klear.data.difficulty import DIFFICULTY_LABELS, MIXED_FOR, difficulty_label, keep_response
from klear.data.rows import read_rows
from klear.data.text import check_messages, short_repr

DEFAULT_SFT_DATA_SOURCE = "math"
FILTER_MODES = ("none", "correct", "by_difficulty")

__all__ = [
    "DEFAULT_SFT_DATA_SOURCE",
    "FILTER_MODES",
    "filter_sft_dataset",
    "load_sft_file",
    "make_teacher_sft_dataset",
]


def _row_to_example(where: str, rec: Any) -> dict:
    """Validate one file row and convert it to the prompt-completion layout of this module."""
    if rec.get("messages") is not None:
        messages = check_messages(where, "messages", rec["messages"], require_user=True)
        last = messages[-1]
        if last["role"] != "assistant":
            raise ValueError(
                f"{where}: field 'messages[{len(messages) - 1}].role' is {last['role']!r} (expected "
                f"the last message to be the assistant response that is trained)"
            )
        if len(messages) < 2:
            raise ValueError(
                f"{where}: field 'messages' holds only the assistant response (expected at least one "
                f"user message before it)"
            )
        prompt, response = messages[:-1], last["content"]
        response_field = f"messages[{len(messages) - 1}].content"
    elif rec.get("prompt") is not None:
        raw_prompt = rec["prompt"]
        if isinstance(raw_prompt, str):
            if not raw_prompt.strip():
                raise ValueError(f"{where}: field 'prompt' is an empty string (expected the question)")
            prompt = [{"role": "user", "content": raw_prompt}]
        else:
            prompt = check_messages(where, "prompt", raw_prompt, require_user=True)
        key = "response" if rec.get("response") is not None else "completion"
        response = rec.get(key)
        if response is None:
            raise ValueError(f"{where}: field 'response' is missing (a row with 'prompt' needs a 'response' string)")
        if isinstance(response, list):
            msgs = check_messages(where, key, response)
            if len(msgs) != 1 or msgs[0]["role"] != "assistant":
                raise ValueError(f"{where}: field '{key}' must be one assistant message, got {short_repr(response)}")
            response = msgs[0]["content"]
        if not isinstance(response, str):
            raise ValueError(
                f"{where}: field '{key}' is {type(response).__name__} {short_repr(response)} (expected a string)"
            )
        response_field = key
    else:
        raise ValueError(
            f"{where}: no 'messages' and no 'prompt' field (expected a chat 'messages' list, or 'prompt' + 'response')"
        )
    if not response.strip():
        raise ValueError(f"{where}: field '{response_field}' is empty (expected the response text)")

    gt = rec.get("ground_truth")
    gt_field = "ground_truth"
    if gt is None and isinstance(rec.get("reward_model"), Mapping):
        gt, gt_field = rec["reward_model"].get("ground_truth"), "reward_model.ground_truth"
    if gt is not None:
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)) or (isinstance(gt, str) and not gt.strip()):
            raise ValueError(f"{where}: field '{gt_field}' is {short_repr(gt)} (expected a non-empty string or number)")
        gt = str(gt)
    data_source = rec.get("data_source", DEFAULT_SFT_DATA_SOURCE)
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"{where}: field 'data_source' is {short_repr(data_source)} (expected a non-empty string)")
    difficulty = rec.get("difficulty")
    if difficulty is not None and difficulty not in DIFFICULTY_LABELS:
        raise ValueError(
            f"{where}: field 'difficulty' is {short_repr(difficulty)} (expected one of {DIFFICULTY_LABELS})"
        )
    pass_rate = rec.get("pass_rate")
    if pass_rate is not None and (
        isinstance(pass_rate, bool)
        or not isinstance(pass_rate, (int, float))
        or not (0.0 <= float(pass_rate) <= 1.0)
        or math.isnan(float(pass_rate))
    ):
        raise ValueError(f"{where}: field 'pass_rate' is {short_repr(pass_rate)} (expected a number in [0, 1])")
    return {
        "prompt": prompt,
        "completion": [{"role": "assistant", "content": response}],
        "data_source": data_source,
        "ground_truth": gt,
        "difficulty": difficulty,
        "pass_rate": None if pass_rate is None else float(pass_rate),
    }


def load_sft_file(path: str | os.PathLike):
    """Load and validate an SFT file (JSONL / JSON / parquet) into the prompt-completion layout.

    Each row needs ``messages`` (last message = the assistant response) or ``prompt`` +
    ``response`` (see the module docstring). Every row is validated; nothing is dropped.

    Args:
        path: ``.jsonl``, ``.json`` (JSON lines or one array) or ``.parquet`` file.

    Returns:
        A ``datasets.Dataset`` with ``prompt``, ``completion``, ``data_source``, ``ground_truth``,
        ``difficulty`` and ``pass_rate`` columns (one row per file row, in file order).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported type, empty file, invalid JSON, or an invalid row; the message names
            the file, the 0-based row and the field, e.g. ``sft.jsonl: row 3: field 'response' is missing``.
    """
    import datasets

    path = Path(path)
    rows = [_row_to_example(where, rec) for where, rec in read_rows(path)]
    return datasets.Dataset.from_list(rows)


# --------------------------------------------------------------------------- filtering


def filter_sft_dataset(dataset, mode: str = "none", *, easy_pass_rate: float = 0.5, max_workers: int | None = None):
    """Correctness filtering by difficulty (paper Sec. 5.1.1, Table 2; the rule is :mod:`klear.data.difficulty`).

    A response is correct by :func:`klear.rewards.correctness.is_correct` on the reward of
    :func:`klear.rewards.compute_scores` (``data_source`` selects the scorer; ``*longcot*`` sources
    also require a closed think block). A prompt's label is its ``difficulty`` (``easy``/``medium``/
    ``hard``), or, without one, :func:`klear.data.difficulty.difficulty_label` of its ``pass_rate``
    with ``easy_pass_rate`` as the threshold (easy or hard).

    Modes:
        ``none``: keep every row.
        ``correct``: keep only correct responses.
        ``by_difficulty``: Klear's rule (:func:`klear.data.difficulty.keep_response`): easy and medium
        prompts keep only correct responses, hard prompts keep every response (correct or not).

    Args:
        dataset: rows in this module's layout.
        mode: one of :data:`FILTER_MODES`.
        easy_pass_rate: pass-rate threshold for "easy", in [0, 1].
        max_workers: scoring threads (``None``: the scorer's default).

    Returns:
        ``(filtered_dataset, stats)`` with ``stats = {"mode", "n_in", "n_out", "removed_wrong",
        "n_easy", "n_hard", "n_correct"}`` (``n_correct`` counts the scored rows only).

    Raises:
        ValueError: an unknown mode, a bad threshold, a row that must be scored but has no
            ``ground_truth``, or a ``by_difficulty`` row with neither ``difficulty`` nor ``pass_rate``
            (the message names the row).
    """
    if mode not in FILTER_MODES:
        raise ValueError(f"unknown filter mode {mode!r} (expected one of {FILTER_MODES})")
    if not 0.0 <= float(easy_pass_rate) <= 1.0:
        raise ValueError(f"easy_pass_rate must be in [0, 1], got {easy_pass_rate!r}")
    n = len(dataset)
    stats: dict[str, Any] = {
        "mode": mode,
        "n_in": n,
        "n_out": n,
        "removed_wrong": 0,
        "n_easy": 0,
        "n_hard": 0,
        "n_correct": 0,
    }
    if mode == "none":
        return dataset, stats
    rows = dataset.to_list()
    if mode == "correct":
        labels = ["easy"] * n
    else:
        labels = []
        for i, row in enumerate(rows):
            if row.get("difficulty") is not None:
                if row["difficulty"] not in DIFFICULTY_LABELS:
                    raise ValueError(
                        f"row {i}: field 'difficulty' is {row['difficulty']!r} (expected one of {DIFFICULTY_LABELS})"
                    )
                labels.append(row["difficulty"])
            elif row.get("pass_rate") is not None:
                labels.append(difficulty_label(float(row["pass_rate"]), easy_pass_rate, easy_pass_rate))
            else:
                raise ValueError(
                    f"row {i}: filter 'by_difficulty' needs field 'difficulty' ('easy'/'medium'/'hard') "
                    f"or 'pass_rate' (a number in [0, 1])"
                )
        stats["n_hard"] = sum(lab in MIXED_FOR for lab in labels)
        stats["n_easy"] = n - stats["n_hard"]
    to_score = [i for i in range(n) if labels[i] not in MIXED_FOR]
    for i in to_score:
        if rows[i].get("ground_truth") is None:
            raise ValueError(f"row {i}: filter {mode!r} needs field 'ground_truth' to judge the response")
    keep = [True] * n
    if to_score:
        from klear.rewards import compute_scores, is_correct, require_scored

        scores = compute_scores(
            [rows[i]["data_source"] for i in to_score],
            [rows[i]["completion"][-1]["content"] for i in to_score],
            [rows[i]["ground_truth"] for i in to_score],
            [None] * len(to_score),
            max_workers=max_workers,
        )
        require_scored(scores, lambda j: f"row {to_score[j]}")  # an unscored response is not a wrong one
        for i, score in zip(to_score, scores):
            ok = is_correct(float(score))
            stats["n_correct"] += int(ok)
            keep[i] = keep_response(labels[i], ok)
    kept = [i for i in range(n) if keep[i]]
    stats["n_out"], stats["removed_wrong"] = len(kept), n - len(kept)
    if not kept:
        raise ValueError(f"filter {mode!r} removed all {n} rows (no correct response among the rows it judged)")
    return dataset.select(kept), stats


# --------------------------------------------------------------------------- teacher set


def make_teacher_sft_dataset(
    tasks: Sequence[Mapping[str, Any]],
    *,
    train_size: int,
    heldout_size: int,
    seed: int,
    system_prompt: str | None = None,
    instruction: str | None = None,
    data_source: str = "math_reasoning_gym",
    slip_rate: float | Sequence[float] = 0.0,
):
    """Worked teacher solutions for reasoning-gym problems, plus a disjoint held-out set.

    The problems come from :func:`klear.data.rl_data.make_train_and_heldout` (no few-shot turn; the
    held-out questions are excluded from the training problems). For each training problem the
    reasoning-gym entry is regenerated from its ``(rg_seed, rg_index)`` (its question is checked
    against the stored one) and :func:`klear.sft.teacher.teacher_response` writes the verified
    worked solution.

    Args:
        tasks: reasoning-gym task mix (``[{"name", "config", "weight"}]``); every task must give
            integer ``+ - *`` expressions in ``metadata["expression"]``.
        train_size: number of SFT examples.
        heldout_size: number of held-out problems.
        seed: data seed (held-out: ``seed + 1``).
        system_prompt: optional system message (both sets).
        instruction: appended to each question (default: rl_data's ``DEFAULT_INSTRUCTION``).
        data_source: ``data_source`` of both sets (the held-out scorer).
        slip_rate: a flawed teacher's chance of a slip in each column fact (:mod:`klear.sft.teacher`), drawn per
            example from ``random.Random(f"{seed}:{index}")``; 0: every solution is correct. A list gives one rate
            per task (each task a "source" of known quality, paper Sec. 5.1.2).

    Returns:
        ``(sft_train, heldout)``: the SFT set in this module's layout (``ground_truth`` = the
        reasoning-gym answer, ``difficulty`` None) and the held-out set in the RL layout.

    Raises:
        ValueError: bad tasks/sizes (as rl_data), a task the teacher cannot solve, a ``slip_rate`` outside [0, 1),
            or a list of rates whose length is not the number of tasks.
        klear.sft.teacher.TeacherMismatch: the teacher disagrees with reasoning-gym (never emitted).
    """
    import datasets

    from klear.data import rl_data
    from klear.sft.teacher import check_slip_rate, teacher_response

    if isinstance(slip_rate, (list, tuple)):
        rates = list(slip_rate)
        if len(rates) != len(tasks):
            raise ValueError(f"slip_rate: {len(rates)} rates for {len(tasks)} tasks (one rate per task, or one number)")
    else:
        rates = [slip_rate] * len(tasks)
    for rate in rates:
        check_slip_rate(rate)  # every rate, before any work
    kwargs: dict[str, Any] = {"few_shot": None, "system_prompt": system_prompt, "data_source": data_source}
    if instruction is not None:
        kwargs["instruction"] = instruction
    train, heldout = rl_data.make_train_and_heldout(
        tasks, train_size=train_size, heldout_size=heldout_size, seed=seed, **kwargs
    )
    entries = rl_data.regenerate_entries(tasks, seed, train["extra_info"])
    task_of = rl_data.task_indices(tasks, seed, train["extra_info"])
    rows = []
    for index, (row, (entry, gen)) in enumerate(zip(train, entries)):
        info = row["extra_info"]
        rate = rates[task_of[index]]
        rng = random.Random(f"{seed}:{index}") if rate else None
        response = teacher_response(entry, dataset=gen, slip_rate=rate, rng=rng)
        rows.append(
            {
                "prompt": row["prompt"],
                "completion": [{"role": "assistant", "content": response}],
                "data_source": data_source,
                "ground_truth": row["reward_model"]["ground_truth"],
                "difficulty": None,
                "pass_rate": None,
                "task": info["task"],
            }
        )
    return datasets.Dataset.from_list(rows), heldout
