"""Output locations checked before any work: a command that would fail writing its results fails at once."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_writable_folder"]


def check_writable_folder(folder: str | os.PathLike, what: str) -> None:
    """Check that files can be created in ``folder``, or, when it does not exist yet, in the nearest existing
    folder above it (where it would be created). A probe file is created there and removed at once.

    Args:
        folder: the folder the command writes into (it may not exist yet).
        what: how the error names the output, e.g. ``"--output runs/eval"`` or ``"out.jsonl"``.

    Raises:
        ValueError: one line naming ``what``: ``folder`` (or a folder above it) is an existing file, or the
            folder cannot be written (read-only, permissions, full disk: the OS reason is given).
    """
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise ValueError(f"{what}: is an existing file{where}; expected a folder or a path that does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".klear-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what}: cannot write to folder {existing} ({e.strerror or e})") from None
