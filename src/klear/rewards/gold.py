"""Where a math problem's acceptable answers come from (one home for the rule; used by the reward,
``klear eval`` and ``klear.data``).

A math ground truth is ONE answer, unless several are given explicitly:

- a real list: ``reward_model.ground_truth`` is a list/tuple (a JSON array in a JSONL row, a list
  column in parquet, a 1-D array): every element is an acceptable answer;
- the field ``extra_info["acceptable_answers"]`` (:data:`ACCEPTABLE_ANSWERS_FIELD`): a list of
  answers accepted besides the ground truth (``klear.data.rl_data.load_rl_file`` stores a list
  ground truth this way, because an Arrow column holds one type: the first answer stays in
  ``ground_truth``).

A STRING is never split: ``"[1, 2]"`` is the closed interval, not the answers 1 and 2 (decoding a
string's JSON text made ``\\boxed{1}`` score +1 and the right ``\\boxed{[1, 2]}`` -1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ``extra_info`` key holding the answers accepted besides ``reward_model.ground_truth``.
ACCEPTABLE_ANSWERS_FIELD = "acceptable_answers"


def answer_list(value: Any) -> list | None:
    """The elements of *value* when it is a real list of answers (list, tuple or 1-D array such as
    a parquet list column read by pandas), else None. Strings and bytes are single answers, even
    when their text looks like JSON."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if not isinstance(value, (str, bytes)) and getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):
        return list(value.tolist())
    return None


def gold_alternatives(ground_truth: Any, extra_info: Mapping | None = None) -> list | None:
    """Every acceptable answer of a math problem, or None when there is just *ground_truth*.

    Args:
        ground_truth: ``reward_model.ground_truth``: one answer (str/number) or a real list of them.
        extra_info: the row's extra info; its ``acceptable_answers`` (a list, or one answer) adds
            answers; ``None`` or a missing key adds none.

    Returns:
        The answers in order (the ground truth's first, duplicates dropped), or None when neither a
        list nor the field is given. Elements are not checked here: an unusable one is reported by
        the judge as a data error (it scores -1; the other answers still count).
    """
    answers = answer_list(ground_truth)
    extra = extra_info.get(ACCEPTABLE_ANSWERS_FIELD) if isinstance(extra_info, Mapping) else None
    if extra is None:
        return answers
    base = answers if answers is not None else [ground_truth]
    more = answer_list(extra)
    out = list(base)
    for x in more if more is not None else [extra]:
        if not any(type(x) is type(y) and x == y for y in out):
            out.append(x)
    return out


__all__ = ["ACCEPTABLE_ANSWERS_FIELD", "answer_list", "gold_alternatives"]
