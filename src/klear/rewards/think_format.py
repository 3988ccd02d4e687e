"""The response format rule shared by every reward (Klear-Reasoner, paper Sec. 3.2.4).

Klear's long-CoT rewards (``is_longcot=True``) accept a response only when its reasoning sits in
ONE closed think block and the answer comes after it::

    [<think>] reasoning </think> answer

The opening ``<think>`` is optional because many chat templates put it in the prompt. This module
is the only place that rule is written; the math and code rewards both call :func:`answer_region`,
and :func:`requires_think` decides, from the data source, whether the think block is mandatory.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def requires_think(data_source: str, require_think: bool | None = None) -> bool:
    """Whether a response must have a think block: *require_think* when given, else whether the
    data source's name contains ``"longcot"`` (Klear's ``math_longcot_*``, ``coder1_longcot``...)."""
    if require_think is not None:
        return bool(require_think)
    return isinstance(data_source, str) and "longcot" in data_source


def answer_region(response: str, *, require_think: bool = False) -> tuple[str | None, str | None]:
    """Split off the part of *response* that may hold the final answer.

    Returns ``(region, None)``, or ``(None, reason)`` when the format rule fails:

    - one ``</think>`` (and at most one ``<think>``, before it): the region is the text after it;
    - no think tags at all: the whole response, unless ``require_think`` (then ``"missing_think"``);
    - ``"unclosed_think"``: a ``<think>`` is never closed (no ``</think>``, or the last ``<think>``
      comes after the last ``</think>``): the response was cut off while thinking;
    - ``"multiple_think"``: more than one ``<think>`` or ``</think>`` (several think blocks, or a
      stray tag in the answer).

    The rule is the same in every mode: ``require_think`` only makes the block mandatory.
    """
    n_close = response.count(THINK_CLOSE)
    n_open = response.count(THINK_OPEN)
    if n_close == 0:
        if n_open:
            return None, "unclosed_think"
        return (None, "missing_think") if require_think else (response, None)
    close_idx = response.rfind(THINK_CLOSE)
    if response.rfind(THINK_OPEN) > close_idx:
        return None, "unclosed_think"
    if n_close > 1 or n_open > 1:
        return None, "multiple_think"
    return response[close_idx + len(THINK_CLOSE) :], None
