"""Shared fixtures: the embedded model's converted checkpoint (converted once per machine) and tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
