"""Device and precision: the one rule every stage follows (``klear rl``, ``klear sft``, ``klear eval``).

``bf16: auto`` (the default everywhere) means bfloat16 mixed precision on a CUDA GPU with NATIVE
bf16 (compute capability >= 8.0: A100, H100, L4, RTX 30xx and newer), and float32 otherwise. A GPU below
8.0 (V100 7.0, T4 7.5) only emulates bf16 (``torch.cuda.is_bf16_supported()`` counts that as support; this
rule does not): no bf16 tensor cores, and vLLM refuses bfloat16 there. On such a GPU ``bf16: auto`` is
float32; float16 is used only when the recipe asks (``fp16: true``).

On a CPU ``bf16: auto`` is float32. An explicit ``bf16: true`` (bf16 autocast over float32 weights, as on a
GPU) is allowed on a CPU with native bf16 matmul, i.e. AMX (``amx_bf16`` in ``/proc/cpuinfo``: Intel Xeon
Sapphire Rapids and newer), where the model's matmul-heavy phases run 3-9x faster than in float32
(``benchmarks/roofline.py``). Without AMX (e.g. AMD EPYC) CPU bf16 is emulated and slow (3.5x slower per RL
step measured), so it is refused. It stays opt-in: on an AMX CPU the whole ``make demo`` in bf16 (sampling and
evaluation through klear's decode loop in bf16 autocast) kept its held-out gain and ran 1.17x faster than in
float32 over 3 seeds, within their spread (docs/performance.md, with the first-step on-policy ratio).

An explicit ``bf16: true`` without a CUDA GPU of capability >= 8.0 (the message names the GPU and its
capability) or an AMX CPU, or ``fp16: true`` without a CUDA GPU, is an error raised before any model loads.

:func:`resolve_precision` decides; :func:`resolve_trainer_precision` applies the decision to a
TRL/transformers ``TrainingArguments`` section; :func:`torch_dtype` gives the dtype for loading a
model (``klear eval``'s ``--dtype auto``); :func:`cuda_device` is the one place the GPU is asked.

The CPU runtime's one rule lives here too: how OpenMP threads wait (:func:`set_cpu_runtime_defaults`, chosen by
the CLI before torch loads: sleep at once, or spin ~0.1 ms on a machine idle at start) and the watch that puts
torch on one thread while other work shares a CPU on which threads spin (:class:`CpuShareGuard`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Precision",
    "resolve_precision",
    "resolve_trainer_precision",
    "torch_dtype",
    "cuda_device",
    "check_attention_implementation",
    "BF16_MIN_CAPABILITY",
    "DTYPE_CHOICES",
    "set_cpu_runtime_defaults",
    "cpu_wait_settings",
    "cpu_busy_cores",
    "cpu_runtime_record",
    "CpuShareGuard",
    "cpu_flags",
    "cpu_native_bf16",
]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: CUDA compute capability from which a GPU has native bf16 (Ampere, sm_80); below it bf16 is emulated.
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Precision:
    """A resolved device/precision decision.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        dtype: compute dtype name, ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        requested: what the recipe asked for (``"auto"``, ``True``, ``False``; for a dtype, its name).
    """

    device: str
    dtype: str
    requested: Any = "auto"

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def fp16(self) -> bool:
        return self.dtype == "float16"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the start of a run naming the setting as a recipe writes it, e.g. ``precision: float32 on
        cpu (bf16: auto)``."""
        asked = "fp16: true" if self.requested == "fp16" else f"bf16: {str(self.requested).lower()}"
        return f"precision: {self.dtype} on {self.device} ({asked})"


@dataclass(frozen=True)
class CudaDevice:
    """The visible CUDA device this process computes on (``torch.cuda``'s current device).

    Attributes:
        name: e.g. ``"Tesla V100-SXM2-32GB"``.
        capability: compute capability ``(major, minor)``, e.g. ``(7, 0)``.
    """

    name: str
    capability: tuple[int, int]

    @property
    def native_bf16(self) -> bool:
        """Whether the GPU computes in bf16 natively (capability >= :data:`BF16_MIN_CAPABILITY`)."""
        return self.capability >= BF16_MIN_CAPABILITY

    def describe(self) -> str:
        """E.g. ``"this GPU (Tesla T4) has compute capability 7.5"``."""
        return f"this GPU ({self.name}) has compute capability {self.capability[0]}.{self.capability[1]}"


def cuda_device() -> CudaDevice | None:
    """The current CUDA device, or ``None`` without a visible CUDA GPU.

    The one place klear asks torch about the GPU's precision support: ``torch.cuda.is_bf16_supported()`` is
    not used because it also returns true where bf16 is only emulated (V100, T4).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return CudaDevice(str(torch.cuda.get_device_name()), (int(major), int(minor)))


def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty where there is none, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration, IndexError):
        return frozenset()


def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX, ``amx_bf16``); the one place klear asks."""
    return "amx_bf16" in cpu_flags()


def _bf16_refusal(what: str, gpu: CudaDevice | None, fix: str) -> str:
    """Why ``what`` (e.g. ``"trainer.bf16=true"``) cannot run on this machine, and ``fix``: one line."""
    found = "none is visible" if gpu is None else gpu.describe()
    return f"{what} needs a CUDA GPU with native bf16 (compute capability >= 8.0); {found} ({fix})"


def resolve_precision(bf16: Any = "auto", *, fp16: Any = False, where: str = "trainer") -> Precision:
    """Decide device and compute dtype from a recipe's ``bf16`` / ``fp16`` settings.

    Args:
        bf16: ``"auto"`` or ``None`` (bf16 on a CUDA GPU with native bf16, i.e. compute capability >= 8.0;
            float32 otherwise, including a 7.x GPU and every CPU), ``True`` (bf16; needs such a GPU or, without a
            GPU, an AMX CPU) or ``False`` (float32, or fp16 if ``fp16``).
        fp16: ``True`` for float16 mixed precision (needs a CUDA GPU, any capability; not with ``bf16: true``).
        where: the recipe section, for error messages (``"trainer"``).

    Returns:
        The :class:`Precision`.

    Raises:
        ValueError: a value other than true/false/auto, fp16 asked for without a CUDA GPU, bf16 asked for
            without a CUDA GPU on a CPU without AMX, or on a GPU below compute capability 8.0 (the message names
            the GPU and its capability), or both.
    """
    if bf16 is None:
        bf16 = "auto"
    if bf16 != "auto" and not isinstance(bf16, bool):
        raise ValueError(f"{where}.bf16={bf16!r} must be true, false or auto")
    if fp16 is None:
        fp16 = False
    if not isinstance(fp16, bool):
        raise ValueError(f"{where}.fp16={fp16!r} must be true or false")
    gpu = cuda_device()
    device = "cuda" if gpu else "cpu"
    if fp16:
        if bf16 is True:
            raise ValueError(f"{where}.bf16 and {where}.fp16 cannot both be true")
        if not gpu:
            raise ValueError(f"{where}.fp16=true needs a CUDA GPU; none is visible (float32 is used on CPU)")
        return Precision(device, "float16", requested="fp16")
    native_bf16 = gpu is not None and gpu.native_bf16
    if bf16 is True and gpu is None and cpu_native_bf16():
        return Precision(device, "bfloat16", requested=bf16)
    if bf16 is True and not native_bf16:
        if gpu is None:
            raise ValueError(
                f"{where}.bf16=true needs a CUDA GPU with native bf16 (compute capability >= 8.0) or a CPU with "
                "AMX (amx_bf16 in /proc/cpuinfo); none is visible and this CPU has no amx_bf16 (use bf16: auto, "
                "which means float32 here: bf16 on a CPU without AMX is emulated and slow)"
            )
        raise ValueError(
            _bf16_refusal(f"{where}.bf16=true", gpu, "use bf16: auto, which means float32 on it, or fp16: true")
        )
    use_bf16 = native_bf16 if bf16 == "auto" else bf16
    return Precision(device, "bfloat16" if use_bf16 else "float32", requested=bf16)


def resolve_trainer_precision(trainer_cfg: dict[str, Any], where: str = "trainer") -> tuple[dict[str, Any], Precision]:
    """Apply :func:`resolve_precision` to a ``TrainingArguments``-style section.

    Returns a copy of ``trainer_cfg`` with ``bf16`` and ``fp16`` set explicitly (TRL's configs default
    to ``bf16=True``, which on a CPU silently means bf16 autocast) and, without a GPU, ``use_cpu=True``;
    ``gradient_checkpointing: auto`` becomes on with a GPU, off without. Also returns the decision.

    Raises:
        ValueError: see :func:`resolve_precision`; ``gradient_checkpointing`` not true/false/auto.
    """
    out = dict(trainer_cfg)
    precision = resolve_precision(out.get("bf16", "auto"), fp16=out.get("fp16", False), where=where)
    out["bf16"], out["fp16"] = precision.bf16, precision.fp16
    gc = out.get("gradient_checkpointing")
    if gc == "auto":
        out["gradient_checkpointing"] = precision.device == "cuda"
    elif gc is not None and not isinstance(gc, bool):
        raise ValueError(f"{where}.gradient_checkpointing={gc!r} must be true, false or auto")
    if precision.device == "cpu":
        out["use_cpu"] = True
    return out, precision


def torch_dtype(dtype: str = "auto", *, device: str | None = None):
    """The ``torch.dtype`` to load a model in for inference (``klear eval --dtype``).

    ``"auto"`` follows :func:`resolve_precision` (bf16 on a CUDA GPU with native bf16, compute capability
    >= 8.0; float32 otherwise, and whenever ``device`` is given and is not CUDA). An explicit ``"bfloat16"``
    needs such a GPU, as in training (vLLM refuses bfloat16 below 8.0); ``"float16"`` needs a CUDA GPU;
    ``"float32"`` is always allowed.

    Raises:
        ValueError: a name outside :data:`DTYPE_CHOICES`, bf16 without a GPU of capability >= 8.0 (naming the
            GPU's), or fp16 without a CUDA device.
    """
    import torch

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPE_CHOICES}")
    on_cpu = device is not None and not str(device).startswith("cuda")
    if dtype == "auto":
        name = "float32" if on_cpu else resolve_precision("auto").dtype
    elif dtype != "float32":
        gpu = None if on_cpu else cuda_device()
        if on_cpu or gpu is None:
            where = f"device {device!r} is not one" if on_cpu else "none is visible"
            raise ValueError(f"--dtype {dtype} needs a CUDA GPU; {where} (--dtype auto means float32 here)")
        if dtype == "bfloat16" and not gpu.native_bf16:
            fix = "--dtype auto means float32 on it; or --dtype float16"
            raise ValueError(_bf16_refusal("--dtype bfloat16", gpu, fix))
        name = dtype
    else:
        name = "float32"
    return getattr(torch, name)


# FlashAttention implementations transformers loads from a package: (package to import, pip name, minimum compute
# capability). FlashAttention 2 runs on Ampere and newer, FlashAttention 3 on Hopper.
_FLASH_ATTENTION = {
    "flash_attention_2": ("flash_attn", "flash-attn", (8, 0)),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3", (9, 0)),
}


def _importable(package: str) -> bool:
    """Whether ``package`` can be imported (found on the path; not imported)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def check_attention_implementation(implementation: Any, *, where: str, gpu_only: bool = False) -> None:
    """Refuse, before any model loads, a FlashAttention implementation this machine cannot run.

    ``flash_attention_2`` needs a CUDA GPU of compute capability >= 8.0 and the ``flash_attn`` package;
    ``flash_attention_3`` capability >= 9.0 and ``flash_attn_interface``. Any other value (``sdpa``, ``eager``,
    a hub kernel, ``None``) is left to transformers. ``gpu_only=True`` (the recipe validators) skips the check
    without a CUDA GPU, so a GPU recipe still validates on a CPU machine.

    Args:
        implementation: the recipe's ``attn_implementation``.
        where: the setting's name for the message (``"trainer.model_init_kwargs.attn_implementation"``).
        gpu_only: check only where a CUDA GPU is visible.

    Raises:
        ValueError: one line naming the setting, the GPU (or its absence) and the fix.
    """
    if implementation not in _FLASH_ATTENTION:
        return
    package, pip_name, capability = _FLASH_ATTENTION[implementation]
    gpu = cuda_device()
    fix = f"set {where}=sdpa"
    if gpu is None:
        if gpu_only:
            return
        raise ValueError(f"{where}={implementation} needs a CUDA GPU; none is visible ({fix} to run here)")
    if gpu.capability < capability:
        raise ValueError(
            f"{where}={implementation} needs compute capability >= {capability[0]}.{capability[1]}; "
            f"{gpu.describe()} ({fix})"
        )
    if not _importable(package):
        raise ValueError(
            f"{where}={implementation}: the {pip_name} package is not installed "
            f"(pip install {pip_name} --no-build-isolation, or {fix})"
        )


#: ``GOMP_SPINCOUNT`` on a CPU found idle at start: GNU OpenMP's threads spin about 0.1 ms (libgomp counts ~100 000
#: spins a millisecond) before they sleep, which bridges the gaps between a small model's operations.
IDLE_SPIN_COUNT = 10_000
#: A machine whose other work takes less CPU than this many cores counts as idle (:func:`cpu_busy_cores`).
IDLE_BUSY_CORES = 0.25
#: The OpenMP variables klear chooses (unless the user set one) and records in ``run.json``.
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def _stat_ticks(stat_path: str) -> tuple[int, int, int]:
    """``(total, busy, cpus)`` from ``/proc/stat``: the ``cpu`` line's ticks summed, those not idle or iowait, and
    the number of ``cpuN`` lines. Raises OSError, ValueError or IndexError where the file is not that."""
    with open(stat_path) as f:
        lines = f.read().splitlines()
    if not lines[0].startswith("cpu "):
        raise ValueError(f"{stat_path}: the first line is not the cpu line")
    fields = [int(x) for x in lines[0].split()[1:]]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    # user nice system idle iowait irq softirq steal (guest time is counted in user and nice already)
    total = sum(fields[:8])
    return total, total - fields[3] - (fields[4] if len(fields) > 4 else 0), cpus


def _busy_cores(before: tuple[int, int, int], after: tuple[int, int, int], own_ticks: float = 0.0) -> float | None:
    """Cores' worth of busy time between two :func:`_stat_ticks` readings, less ``own_ticks`` (None: no tick
    passed, or no cpu lines)."""
    (total0, busy0, cpus), (total1, busy1, _) = before, after
    if total1 <= total0 or cpus < 1:
        return None
    return cpus * (busy1 - busy0 - own_ticks) / (total1 - total0)


def cpu_busy_cores(window_s: float = 0.2, stat_path: str = "/proc/stat", sleep=None) -> float | None:
    """Cores' worth of CPU time the whole machine spent busy over ``window_s`` seconds (two reads of the ``cpu``
    line of ``/proc/stat``: everything but idle and iowait), e.g. 1.0 for one process spinning; None where the file
    cannot be read or parsed (not Linux)."""
    import time

    try:
        before = _stat_ticks(stat_path)
        (sleep or time.sleep)(window_s)
        return _busy_cores(before, _stat_ticks(stat_path))
    except (OSError, ValueError, IndexError):
        return None


def cpu_wait_settings(environ, busy_cores: float | None) -> dict[str, str]:
    """The OpenMP variables :func:`set_cpu_runtime_defaults` adds to ``environ`` (a mapping it only reads), given
    the machine's other work in cores (:func:`cpu_busy_cores`; None: unknown).

    ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it: threads that spin while they wait made generation on 2
    busy cores 5x slower. On a machine found idle (``busy_cores`` below :data:`IDLE_BUSY_CORES`) and with neither
    variable set by the user, also ``GOMP_SPINCOUNT`` = :data:`IDLE_SPIN_COUNT`, which GNU OpenMP (torch's Linux
    wheels) takes over the policy: a run of the 0.9M-parameter bench model on 2 idle cores took 67-73 s instead of
    100-104 s (docs/performance.md). Work that starts beside the run later would make it 1.8x slower than sleeping
    waits do, which :class:`CpuShareGuard` prevents; ``GOMP_SPINCOUNT=0`` never spins."""
    out: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in environ:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
        if "GOMP_SPINCOUNT" not in environ and busy_cores is not None and busy_cores < IDLE_BUSY_CORES:
            out["GOMP_SPINCOUNT"] = str(IDLE_SPIN_COUNT)
    return out


def set_cpu_runtime_defaults() -> dict[str, str]:
    """Set the OpenMP wait policy of :func:`cpu_wait_settings` in ``os.environ`` (call before torch is imported;
    the CLI does) and return what was set. Measures the machine's load for 0.2 s unless the user set the policy.
    GPUs are unaffected."""
    import os

    if "OMP_WAIT_POLICY" in os.environ:
        return {}
    busy = None if "GOMP_SPINCOUNT" in os.environ else cpu_busy_cores()
    settings = cpu_wait_settings(os.environ, busy)
    os.environ.update(settings)
    return settings


#: While OpenMP threads spin, other work of at least this many cores puts klear on one thread (:class:`CpuShareGuard`).
CONTENDED_BUSY_CORES = 0.5


class CpuShareGuard:
    """One intra-op thread while other work shares a CPU on which OpenMP threads spin (``GOMP_SPINCOUNT`` > 0).

    :func:`cpu_wait_settings` lets threads spin on a machine idle at start; work that starts beside the run later
    would then slow it (a bench run: 221 s against 122 s with sleeping waits, one busy core beside it). Call
    :meth:`check` between steps from the thread that runs torch (the setting is per thread): at most every
    ``min_interval_s`` seconds it measures the other work since the last measurement (``/proc/stat``'s busy ticks
    minus this process's CPU time, :func:`os.times`) and sets torch to one thread while that is at least
    :data:`CONTENDED_BUSY_CORES`, back to ``threads`` once it is below :data:`IDLE_BUSY_CORES`.

    Args:
        threads: torch's intra-op threads to return to.
        min_interval_s: shortest measurement window (default :attr:`MIN_INTERVAL_S`).
        stat_path, clock, own_cpu_s, set_threads: ``/proc/stat``, a monotonic clock, this process's CPU seconds and
            ``torch.set_num_threads`` (replaceable in tests).
    """

    #: Default shortest measurement window, seconds.
    MIN_INTERVAL_S = 2.0

    def __init__(
        self,
        threads: int,
        *,
        min_interval_s: float | None = None,
        stat_path: str = "/proc/stat",
        clock=None,
        own_cpu_s=None,
        set_threads=None,
    ) -> None:
        import os
        import time

        self.threads = threads
        self.current = threads
        self.min_interval_s = self.MIN_INTERVAL_S if min_interval_s is None else min_interval_s
        self._stat_path = stat_path
        self._clock = clock or time.monotonic
        self._own = own_cpu_s or (lambda: (lambda t: t.user + t.system)(os.times()))
        self._set = set_threads
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self._last = self._read()

    @classmethod
    def for_this_process(cls) -> CpuShareGuard | None:
        """A guard when it can act: torch on more than one thread, ``GOMP_SPINCOUNT`` > 0 (set by
        :func:`set_cpu_runtime_defaults` or the user) and ``/proc/stat`` readable; else None."""
        import os

        import torch

        try:
            spin = int(os.environ.get("GOMP_SPINCOUNT", "0"))
        except ValueError:
            return None
        threads = torch.get_num_threads()
        if spin <= 0 or threads < 2:
            return None
        guard = cls(threads)
        return guard if guard._last is not None else None

    def _read(self) -> tuple[float, tuple[int, int, int], float] | None:
        try:
            ticks = _stat_ticks(self._stat_path)
        except (OSError, ValueError, IndexError):
            return None
        return self._clock(), ticks, self._own()

    def check(self) -> int | None:
        """Measure and, where needed, change torch's threads; returns the new count, or None when unchanged."""
        if self._last is None or self._clock() - self._last[0] < self.min_interval_s:
            return None
        now = self._read()
        if now is None:
            return None
        (_, ticks0, own0), (_, ticks1, own1) = self._last, now
        self._last = now
        others = _busy_cores(ticks0, ticks1, own_ticks=(own1 - own0) / self._tick_s)
        if others is None:
            return None
        wanted = 1 if others >= CONTENDED_BUSY_CORES else self.threads if others < IDLE_BUSY_CORES else self.current
        if wanted == self.current:
            return None
        if self._set is None:
            import torch

            torch.set_num_threads(wanted)
        else:
            self._set(wanted)
        self.current = wanted
        return wanted


def cpu_runtime_record() -> dict[str, Any]:
    """This process's CPU threading, for ``run.json``: torch's intra-op threads and the OpenMP variables (None:
    unset). Imports torch."""
    import os

    import torch

    return {"torch_threads": torch.get_num_threads(), **{k: os.environ.get(k) for k in OPENMP_VARIABLES}}
