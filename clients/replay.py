"""What a hospital has already answered: a request sent twice never buys a second noisy answer (issue 26).

A release id in a ledger merges repeats (``privacy.ledger``): recording it twice counts once. That is only
sound when the mechanism behind the id does not run again. Ids built from what the *server* sends (run tag,
setting, round) break it: the same round sent twice would make the hospital train again, draw fresh noise and
return a second, independently noised update, charged nothing -- averaging M replays cuts the noise by √M.

So the hospital decides what a repeat is, on its own side:

- every mechanism it runs (a DP-FedAvg round, a local-DP teacher training, a PATE query batch) records its
  releases under ids that carry a **nonce the hospital mints** (:func:`mint_nonce`, from the OS CSPRNG), so a
  second run of the mechanism is always a second charge;
- a *genuine retry* -- the identical request (same weights, same configuration, byte for byte) -- gets the
  **identical earlier answer** from this book and draws no noise at all (:class:`AnswerBook`). Returning the
  same output twice releases nothing new (post-processing of one release).

A request whose answer was not kept (the book was cleared, or the answer was larger than ``max_bytes``) is
simply a new release: charged again, never free.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from sim.io import atomic_write_bytes, atomic_write_json


def mint_nonce() -> str:
    """A fresh release nonce from the OS CSPRNG: no server can predict or repeat it."""
    return secrets.token_hex(8)


def request_key(kind: str, arrays: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None) -> str:
    """sha256 over everything a request consists of: its kind, its arrays (names, dtypes, shapes, bytes) and
    its configuration (canonical JSON). Two requests with the same key would make the same mechanism run on
    the same inputs."""
    digest = hashlib.sha256(kind.encode())
    for name in sorted(arrays or {}):
        array = np.ascontiguousarray(np.asarray(arrays[name]))
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
    digest.update(json.dumps(dict(config or {}), sort_keys=True, default=str).encode())
    return digest.hexdigest()


class AnswerBook:
    """The answers a hospital gave, by request key, on its own disk (``directory/<key>.npz`` + ``.json``).

    Answers are noisy releases the server already holds (DP outputs): keeping them adds nothing private.
    """

    def __init__(self, directory: str | Path, max_bytes: int = 64 * 2**20) -> None:
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.npz", self.directory / f"{key}.json"

    def lookup(self, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """The arrays and metadata answered to request ``key`` before, or None."""
        arrays_path, meta_path = self._paths(key)
        if not (arrays_path.exists() and meta_path.exists()):   # meta is written last: both or not answered
            return None
        with np.load(arrays_path, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        return arrays, json.loads(meta_path.read_text())

    def store(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bool:
        """Keep an answer (atomically; arrays first, metadata last). False when it is too large to keep."""
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
            return False
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        arrays_path, meta_path = self._paths(key)
        atomic_write_bytes(arrays_path, buffer.getvalue())
        atomic_write_json(meta_path, dict(meta))
        return True
