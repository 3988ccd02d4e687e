"""Shared fixtures: the embedded model's converted checkpoint (converted once per machine) and tiny models."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _stop_tracing_in_forked_child() -> None:
    """Untrace a forked child (the reward pools' workers): `make test` measures coverage in the pytest process
    only, and a forked worker inherits the tracer without saving its data (it ends with ``os._exit``); traced,
    it only runs slower and misses its time limits (1 s per math answer)."""
    sys.settrace(None)
    threading.settrace(None)


os.register_at_fork(after_in_child=_stop_tracing_in_forked_child)


def require_or_skip(module: str, reason: str) -> ModuleType:
    """Import ``module`` for a test file that needs it: skip the file when it is missing, FAIL when it is required.

    ``KLEAR_REQUIRE`` (comma-separated, set by ``make test-verl`` / ``make test-vllm``) names the libraries
    the run exists to test; there a failed import is an error of the run (pytest exits non-zero), not a skip
    that reports success.  Elsewhere (the main suite, a venv without the library) the file is skipped.

    Raises:
        ImportError: ``module`` is named in ``KLEAR_REQUIRE`` and cannot be imported (the message names both).
    """
    required = {m.strip() for m in os.environ.get("KLEAR_REQUIRE", "").split(",") if m.strip()}
    if module not in required:
        return pytest.importorskip(module, reason=reason)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"KLEAR_REQUIRE={os.environ['KLEAR_REQUIRE']} but `import {module}` failed: {e}") from e


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    """Directory of the converted SmolLM2-135M-Instruct checkpoint (real tokenizer + weights)."""
    from klear.models.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture()
def tiny_model(embedded_path):
    """(tiny random Llama, real SmolLM2 tokenizer with left padding)."""
    from klear.models.embedded import tiny_random_model

    model, tok = tiny_random_model(embedded_path)
    tok.padding_side = "left"
    return model, tok


@pytest.fixture()
def tiny_ckpt(tmp_path, tiny_model):
    """A saved checkpoint directory of :func:`tiny_model` (for job tests that take a model path)."""
    model, tok = tiny_model
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def shared_file(*parts: str) -> Path:
    """A file from ../shared/data; skips the test when it is absent (the product never needs it)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} not available")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` to ``path`` as JSON lines; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_rows(n: int, start: int = 0) -> list[dict]:
    """``n`` verl-layout math rows "What is i + 1?" (ground truth ``i + 1``) for i in ``start, start + n``."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
            "data_source": "math_test",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]
