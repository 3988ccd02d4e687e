"""The difficulty-dependent correctness policy of SFT data (paper Sec. 5.1.1, Table 2): one home.

A prompt's difficulty comes from a model's pass rate on it: ``easy`` when the pass rate is at least
``easy_min``, ``hard`` when it is below ``hard_below``, ``medium`` in between. Table 2's finding:
for easy prompts, training only on correct responses is best; for hard prompts, keeping incorrect
responses too (mixed data) is best. So a response is kept when it is correct or its prompt's
label is in ``mixed_for`` (default: ``hard`` only, so ``medium`` follows ``easy``).

Used by ``klear data filter difficulty`` / ``sft-correct`` (:mod:`klear.data.filters`) and by
``klear sft``'s ``filter: by_difficulty`` (:mod:`klear.sft.data`). Correctness itself is
:func:`klear.rewards.correctness.is_correct`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DIFFICULTY_LABELS", "MIXED_FOR", "check_labels", "difficulty_label", "keep_response"]

DIFFICULTY_LABELS = ("easy", "medium", "hard")
#: Labels whose incorrect responses are kept (Table 2: mixed data for hard prompts).
MIXED_FOR = ("hard",)


def difficulty_label(pass_rate: float, easy_min: float = 0.5, hard_below: float = 0.5) -> str:
    """``"easy"`` if ``pass_rate >= easy_min``, ``"hard"`` if ``pass_rate < hard_below``, else ``"medium"``.

    Args:
        pass_rate: a model's pass rate on the prompt, in [0, 1].
        easy_min, hard_below: thresholds, ``0 <= hard_below <= easy_min <= 1`` (equal: two labels only).

    Raises:
        ValueError: thresholds out of order or outside [0, 1].
    """
    if not 0.0 <= hard_below <= easy_min <= 1.0:
        raise ValueError(f"difficulty thresholds need 0 <= hard_below ({hard_below}) <= easy_min ({easy_min}) <= 1")
    if pass_rate >= easy_min:
        return "easy"
    if pass_rate < hard_below:
        return "hard"
    return "medium"


def check_labels(labels: Sequence[str], what: str = "mixed_for") -> tuple[str, ...]:
    """``labels`` as a tuple after checking each is one of :data:`DIFFICULTY_LABELS`.

    Raises:
        ValueError: an unknown label (named, with ``what``).
    """
    out = tuple(labels)
    bad = [m for m in out if m not in DIFFICULTY_LABELS]
    if bad:
        raise ValueError(f"{what} has unknown labels {bad} (expected some of {DIFFICULTY_LABELS})")
    return out


def keep_response(label: str, correct: bool, mixed_for: Sequence[str] = MIXED_FOR) -> bool:
    """Table 2's policy: keep a response when it is correct or its prompt's label is in ``mixed_for``.

    Raises:
        ValueError: ``label`` is not one of :data:`DIFFICULTY_LABELS`.
    """
    if label not in DIFFICULTY_LABELS:
        raise ValueError(f"difficulty label {label!r} is not one of {DIFFICULTY_LABELS}")
    return bool(correct) or label in mixed_for
