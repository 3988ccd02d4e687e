"""klear's own procedural tasks, registered with reasoning-gym so every task path (``data.tasks``) takes them.

``sums_code``: a code problem with several tests. The problem lists ``n_sums`` additions; the model writes a
Python function ``f(i)`` that returns the ``i``-th sum. The ground truth is the code reward's ``call`` layout
(:mod:`klear.rewards.code.layouts`), one test per sum, so a program with some sums wrong passes some tests:
the soft reward (passed / total) and the hard reward (+-1, paper Sec. 3.2.4) differ, which is what paper
Fig. 3 compares. An entry::

    question: "Write a Python function f(i) that returns the i-th of these sums.\\n0: 47+85\\n1: 12+39"
    answer:   '{"format": "call", "fn_name": "f", "inputs": [[0], [1]], "outputs": [132, 51]}'
    metadata: {"source_dataset": "sums_code", "source_index": idx, "expressions": ["47+85", "12+39"],
               "sums": [132, 51], "difficulty": {...}}

The answer is the ground truth's JSON text, so a row built from it
(:func:`klear.data.rl_data.make_reasoning_gym_dataset` with a ``code_*`` data source) is scored by running the
program in the sandbox. Its worked solution is :func:`klear.sft.teacher.teacher_response`'s.

Config (``data.tasks[i].config``): ``n_sums`` (>= 1, default 3), ``min_digits`` / ``max_digits`` (digits of
each operand, 1-6, default 2). Entry ``idx`` of seed ``s`` is drawn from ``random.Random(s + idx)``, as
reasoning-gym's own tasks do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from random import Random
from typing import Any

__all__ = ["SUMS_CODE", "SUMS_CODE_FN", "register_klear_tasks", "sums_code_ground_truth"]

SUMS_CODE = "sums_code"
#: The function a ``sums_code`` program defines.
SUMS_CODE_FN = "f"
_QUESTION = "Write a Python function f(i) that returns the i-th of these sums."


def sums_code_ground_truth(sums: list[int]) -> str:
    """The ``call``-layout ground truth (JSON text) of a ``sums_code`` problem: ``f(i) == sums[i]`` per test."""
    return json.dumps(
        {"format": "call", "fn_name": SUMS_CODE_FN, "inputs": [[i] for i in range(len(sums))], "outputs": list(sums)}
    )


_registered = False


def register_klear_tasks() -> None:
    """Register klear's tasks with reasoning-gym (idempotent; reasoning-gym is imported here, not at import)."""
    global _registered
    if _registered:
        return
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    @dataclass
    class SumsCodeConfig:
        n_sums: int = 3
        min_digits: int = 2
        max_digits: int = 2
        seed: int | None = None
        size: int = 500

        def validate(self) -> None:
            for name, low, high in (("n_sums", 1, 20), ("min_digits", 1, 6), ("max_digits", 1, 6)):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                    raise ValueError(f"sums_code: {name} must be an integer in [{low}, {high}], got {value!r}")
            if self.min_digits > self.max_digits:
                raise ValueError(f"sums_code: min_digits {self.min_digits} > max_digits {self.max_digits}")

    class SumsCodeDataset(ProceduralDataset):
        def __init__(self, config: SumsCodeConfig):
            super().__init__(config=config, seed=config.seed, size=config.size)

        def _operand(self, rng: Random) -> int:
            digits = rng.randint(self.config.min_digits, self.config.max_digits)
            return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

        def __getitem__(self, idx: int) -> dict[str, Any]:
            rng = Random(self.seed + idx)
            pairs = [(self._operand(rng), self._operand(rng)) for _ in range(self.config.n_sums)]
            expressions = [f"{a}+{b}" for a, b in pairs]
            sums = [a + b for a, b in pairs]
            lines = "\n".join(f"{i}: {e}" for i, e in enumerate(expressions))
            return {
                "question": f"{_QUESTION}\n{lines}",
                "answer": sums_code_ground_truth(sums),
                "metadata": {
                    "source_dataset": SUMS_CODE,
                    "source_index": idx,
                    "expressions": expressions,
                    "sums": sums,
                    "difficulty": {
                        "n_sums": self.config.n_sums,
                        "digits": (self.config.min_digits, self.config.max_digits),
                    },
                },
            }

        def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
            """1.0 when ``answer`` is the sums as a JSON list (the teacher's check; RL scores run the program)."""
            try:
                return 1.0 if json.loads(answer or "") == entry["metadata"]["sums"] else 0.0
            except (ValueError, TypeError):
                return 0.0

    if SUMS_CODE not in DATASETS:
        register_dataset(SUMS_CODE, SumsCodeDataset, SumsCodeConfig)
    _registered = True
