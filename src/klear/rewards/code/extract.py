"""Program extraction: the Python program a response holds (paper Sec. 3.2.4 scores "the code").

The program is the last fenced code block tagged ``python`` / ``py`` / ``python3`` / ``py3`` (else
the last untagged block) in the answer region; a block tagged with another language
(```` ```text ````, ```` ```bash ````) is never taken. The answer region and the think-block rule
are :func:`klear.rewards.think_format.answer_region`'s, the one rule the math reward uses too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from klear.rewards.think_format import answer_region

_OPEN_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)")
_PY_TAGS = {"python", "py", "python3", "py3"}


def _fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """Yield ``(tag, content)`` for each closed fenced block, in order; one linear pass over the
    lines (a closing fence is a line of only the fence character, at least as long as the opening)."""
    marker: str | None = None
    tag = ""
    buf: list[str] = []
    for line in text.split("\n"):
        if marker is None:
            m = _OPEN_FENCE.match(line)
            if m:
                marker, tag, buf = m.group(1), m.group(2).lower(), []
            continue
        stripped = line.strip()
        if len(stripped) >= len(marker) and stripped == marker[0] * len(stripped):
            yield tag, ("\n".join(buf) + "\n") if buf else ""
            marker = None
        else:
            buf.append(line)


def extract_code(solution_str: str, *, require_think: bool = False) -> str | None:
    """The program in a response: the last ``python``-tagged fenced block after the think block.

    Args:
        solution_str: the decoded response.
        require_think: if True, a response without a think block has no program. A response that
            breaks the think format (:func:`~klear.rewards.think_format.answer_region`) never has one.

    Returns:
        The code (str) or ``None`` when there is no usable block (also for a non-str input).
        Untagged blocks are used only when no block is tagged Python; blocks tagged with another
        language never are.
    """
    if not isinstance(solution_str, str):
        return None
    region, _ = answer_region(solution_str, require_think=require_think)
    if region is None:
        return None
    tagged: str | None = None
    untagged: str | None = None
    for tag, content in _fenced_blocks(region):
        if tag in _PY_TAGS:
            tagged = content
        elif tag == "":
            untagged = content
    code = tagged if tagged is not None else untagged
    if code is None or not code.strip():
        return None
    return code
