"""Prompt wordings, one home per benchmark: what the model is told in training and in evaluation.

* RL/SFT math problems (reasoning-gym and verl files built by klear): the question, a blank line,
  then :data:`DEFAULT_INSTRUCTION` (:func:`build_user_message`).
* Math benchmarks (``klear eval``): :data:`DEFAULT_MATH_TEMPLATE`, the DeepSeek-R1 evaluation
  wording (paper Sec. 4.2 evaluates with the R1-style sampling protocol).
* HumanEval, in RL training (:mod:`klear.data.code_data`) and in evaluation
  (:mod:`klear.eval.benchmarks`): :func:`humaneval_user_message` (:data:`HUMANEVAL_INSTRUCTION`,
  then the function stub in a fenced block), so RL trains on the wording the benchmark measures.
* LiveCodeBench: the LiveCodeBench/QwQ wording (:data:`LCB_TEMPLATE` with :data:`LCB_STDIN_FORMAT`
  or :data:`LCB_CALL_FORMAT`).

Templates use plain ``str.replace`` on ``{problem}``, ``{prompt}``, ``{question}``, ``{format}``
and ``{starter_code}``, so ``\\boxed{}`` needs no escaping.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_MATH_TEMPLATE",
    "HUMANEVAL_INSTRUCTION",
    "HUMANEVAL_TEMPLATE",
    "LCB_CALL_FORMAT",
    "LCB_STDIN_FORMAT",
    "LCB_TEMPLATE",
    "build_user_message",
    "humaneval_user_message",
]

DEFAULT_INSTRUCTION = "Put your final answer within \\boxed{}."
"""Instruction appended (after a blank line) to every RL/SFT math question (and to the few-shot demo's)."""

DEFAULT_MATH_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
"""The DeepSeek-R1 evaluation wording for math benchmarks (``{problem}``: the problem text)."""

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature and the imports it needs, in one ```python code block."
)
"""Instruction before a HumanEval function stub (training and evaluation)."""

LCB_TEMPLATE = (
    "You will be given a question (problem specification) and will generate a correct Python "
    "program that matches the specification and passes all tests.\n\nQuestion: {question}\n\n{format}"
)
LCB_STDIN_FORMAT = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
    "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when "
    "the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
    "```python\n# YOUR CODE HERE\n```\n\n"
)
LCB_CALL_FORMAT = (
    "You will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters.\n```python\n{starter_code}\n```\n\n"
)


def build_user_message(question: str, instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """The user message for one math problem: the question, a blank line, then the instruction.

    Args:
        question: the problem text (surrounding whitespace is stripped).
        instruction: appended after a blank line; ``None`` or ``""`` means the question alone.
    """
    question = question.strip()
    if not instruction:
        return question
    return f"{question}\n\n{instruction.strip()}"


def humaneval_user_message(prompt: str, instruction: str = HUMANEVAL_INSTRUCTION) -> str:
    """The user message for one HumanEval task: the instruction, a blank line, the stub in a fenced block.

    Args:
        prompt: the task's ``prompt`` (signature and docstring), verbatim.
        instruction: the text before the stub.
    """
    return f"{instruction}\n\n```python\n{prompt}```"


HUMANEVAL_TEMPLATE = humaneval_user_message("{prompt}")
""":func:`humaneval_user_message` with a ``{prompt}`` placeholder (recorded in eval summaries)."""
