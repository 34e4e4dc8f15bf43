"""Atomic file writes: a reader (or a crash) never sees a half-written result, ledger or checkpoint.

Permissions: what a run publishes (reports, results, predictions, model bundles, plots) is created as any
program creates a file -- mode 0666 narrowed by the user's umask, so under umask 022 colleagues on a shared
machine can read it. What must stay with its owner (ledgers, checkpoints of models trained on patients without
a privacy guarantee, caches of patient volumes) is written with ``private=True``: owner-only, 0600, whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

try:  # POSIX advisory locks; where fcntl does not exist (Windows) no folder is locked
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms we run
    fcntl = None

import numpy as np


def cache_root() -> Path:
    """Where generated phantoms, prepared datasets and simulated worlds are cached:
    ``$FEDPATE_CACHE``, or ``~/.cache/fedpate`` when it is unset or empty."""
    env = os.environ.get("FEDPATE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fedpate"


#: mode bits asked for at creation; the kernel narrows them by the umask (a private file is 0600 under any umask)
PUBLIC_MODE, PRIVATE_MODE = 0o666, 0o600


def ensure_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the folder ``path`` (and its parents) for a command's output, before any work starts.

    A folder that cannot be created or written (under a regular file, in a read-only place) is refused in one
    line naming ``flag``, instead of a traceback after minutes of work.
    """
    from task.errors import UserError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {path}: exists and is not a folder") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: the folder is not writable")
    return path


@contextlib.contextmanager
def writing_folder(path: str | os.PathLike, flag: str = "--out") -> Iterator[Path]:
    """Hold ``path`` (an existing folder) as this run's for the block: a second run asked to write into it at the
    same time is refused in one line naming ``flag``, before it reads or writes anything there. An advisory
    ``flock`` of the folder itself: no lock file is left behind, and the lock ends with the process however it
    ends. Not re-entrant: take it once per folder, where a run starts."""
    from task.errors import UserError

    path = Path(path)
    if fcntl is None:
        yield path
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{flag} {path}: another run is writing this folder; wait for it to finish, or use "
                            "another folder") from None
        yield path
    finally:
        os.close(handle)   # closing the only descriptor releases the lock


@contextlib.contextmanager
def held_lock_file(path: str | os.PathLike) -> Iterator[None]:
    """Hold the exclusive ``flock`` of the lock file ``path`` for the block (processes that share a cache take
    turns); the file exists only while held. The holder removes it before unlocking, and a waiter that wakes
    up holding a removed file takes the one now at ``path``, so two processes never both hold it and no empty
    lock file is left behind (``privacy.ledger`` locks its ledgers the same way). Not re-entrant."""
    path = Path(path)
    if fcntl is None:
        yield
        return
    while True:
        handle = open(path, "a+b")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            mine = os.fstat(handle.fileno())
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
        except BaseException:
            handle.close()
            raise
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            break
        handle.close()
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            handle.close()   # closing the only descriptor releases the lock


def ensure_file_folder(path: str | os.PathLike, flag: str = "--out") -> Path:
    """For an output *file*: create its folder (:func:`ensure_folder`) and refuse a path that is a folder."""
    from task.errors import UserError

    path = Path(path)
    ensure_folder(path.parent, flag)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; expected a file name")
    return path


def _create_temporary(folder: Path, name: str, mode: int) -> tuple[int, str]:
    """A new, exclusively created file next to the target (``tempfile.mkstemp`` would force mode 0600)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(folder))


def atomic_write_with(path: str | os.PathLike, write: Callable[[BinaryIO], None], private: bool = False) -> Path:
    """Call ``write(handle)`` on a temporary file in the same folder, fsync, then rename onto ``path``.

    Streams (no copy of the content in memory), so large arrays can be written with ``np.save``. The file is
    created with the umask's mode, or 0600 when ``private`` (module docstring).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path.parent, path.name, PRIVATE_MODE if private else PUBLIC_MODE)
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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, private: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write_with`)."""
    return atomic_write_with(path, lambda handle: handle.write(data), private=private)


def atomic_write_text(path: str | os.PathLike, text: str, private: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), private=private)


def atomic_write_json(path: str | os.PathLike, obj: Any, private: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n",
                             private=private)


def atomic_save_torch(path: str | os.PathLike, obj: Any, private: bool = False) -> Path:
    # torch only here: task.io is imported by the torch-free modules (reports, world building, results)
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue(), private=private)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
