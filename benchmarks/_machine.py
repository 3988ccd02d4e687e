"""What the benchmarks print about the machine they ran on (CPU model and flags), shared by the scripts here.

Run from ``benchmarks/`` as scripts (``python benchmarks/X.py``), they import it as ``_machine``.
"""

from __future__ import annotations

from klear import precision  # cpu_flags: /proc/cpuinfo is read in one place

SUMMARY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> str:
    """Which of avx2, avx512f, avx512_bf16 and amx_bf16 the CPU has, as one line."""
    flags = precision.cpu_flags()
    if not flags:
        return "unknown"
    return " ".join(f for f in SUMMARY_FLAGS if f in flags) or "none of avx2/avx512"


def vector_flags() -> str:
    """Every ``avx512*`` and ``amx*`` flag of the CPU, sorted, as one line."""
    flags = precision.cpu_flags()
    if not flags:
        return "unknown"
    return " ".join(sorted(f for f in flags if f.startswith(("avx512", "amx")))) or "no avx512/amx"


def cpu_model() -> str:
    """The ``model name`` line of ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line for line in f if line.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration, IndexError):
        import platform

        return platform.processor() or "unknown"
