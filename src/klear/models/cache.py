"""The name of the KV-cache argument of a transformers forward/generate, across transformers 5.x."""

from __future__ import annotations

import inspect

__all__ = ["cache_kwarg"]


def cache_kwarg(fn) -> str:
    """``"cache"`` (transformers >= 5.2x) or ``"past_key_values"`` (earlier 5.x), as ``fn`` (a forward) accepts it."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
