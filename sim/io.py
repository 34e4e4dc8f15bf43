"""Atomic file writes: a reader (or a crash) never sees a half-written result, ledger or checkpoint."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np


def cache_root() -> Path:
    """Where generated phantoms, prepared datasets and simulated worlds are cached:
    ``$FEDPATE_CACHE``, or ``~/.cache/fedpate`` when it is unset or empty."""
    env = os.environ.get("FEDPATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fedpate"


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(handle)`` on a temporary file in the same folder, fsync, then rename onto ``path``.

    Streams (no copy of the content in memory), so large arrays can be written with ``np.save``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write_with`)."""
    return atomic_write_with(path, lambda handle: handle.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def atomic_save_torch(path: str | os.PathLike, obj: Any) -> Path:
    # torch only here: sim.io is imported by the torch-free modules (reports, world building, results)
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
