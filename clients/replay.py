"""What a hospital has already answered: a request sent twice never buys a second noisy answer.

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

A request's key (:func:`request_key`) is a hash of a typed, length-prefixed encoding of all of it: two
different requests never share one, so no request is answered with another's answer.

A request whose answer was not kept (the book was cleared, or the answer was larger than ``max_bytes``) is
simply a new release: charged again, never free.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from task.errors import UserError
from task.io import atomic_write_bytes, atomic_write_json


def mint_nonce() -> str:
    """A fresh release nonce from the OS CSPRNG: no server can predict or repeat it."""
    return secrets.token_hex(8)


#: opens every key's byte stream, so that no stream of the current encoding is also one of the legacy encoding
_KEY_DOMAIN = b"fedpate request key/2\0"


def _field(tag: bytes, payload: bytes) -> bytes:
    """One value: a one-byte type tag, the payload's length (8 bytes, big-endian), the payload. Length-prefixed
    fields nest without separators, so a stream of them parses one way only."""
    return tag + len(payload).to_bytes(8, "big") + payload


def _encode_array(value: Any) -> bytes:
    array = np.ascontiguousarray(np.asarray(value))
    if array.dtype.hasobject:   # object arrays' bytes are pointers: neither stable nor the content
        raise UserError(f"a request carries an array of Python objects ({array.dtype}); expected numbers")
    descr = str(np.lib.format.dtype_to_descr(array.dtype))   # unlike dtype.str, names a structured dtype's fields
    return _field(b"a", _field(b"s", descr.encode()) + _encode_value(list(array.shape)) + _field(b"y", array.tobytes()))


def _encode_value(value: Any) -> bytes:
    """The canonical, typed encoding of one configuration value (a JSON-like tree of Flower config values)."""
    if value is None:
        return _field(b"n", b"")
    if isinstance(value, (bool, np.bool_)):
        return _field(b"b", b"1" if value else b"0")
    if isinstance(value, (int, np.integer)):
        return _field(b"i", str(int(value)).encode())
    if isinstance(value, (float, np.floating)):
        return _field(b"f", struct.pack(">d", float(value)))   # exact: 0.1 and 0.1000000001 differ
    if isinstance(value, str):
        return _field(b"s", value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _field(b"y", bytes(value))
    if isinstance(value, os.PathLike):
        return _field(b"p", os.fsencode(value))
    if isinstance(value, Mapping):   # keys of any type, ordered by their encoding
        items = sorted((_encode_value(k), _encode_value(v)) for k, v in value.items())
        return _field(b"d", b"".join(k + v for k, v in items))
    if isinstance(value, (list, tuple)):   # a tuple is the list it will be read as (Flower sends lists)
        return _field(b"l", b"".join(_encode_value(item) for item in value))
    if isinstance(value, (np.ndarray, np.generic)):
        return _encode_array(value)
    raise UserError(f"a request carries a {type(value).__name__} value the hospital cannot compare with "
                    "earlier requests; expected numbers, strings, bytes, lists or dicts of them")


def request_key(kind: str, arrays: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None) -> str:
    """sha256 over everything a request consists of: its kind, its arrays (names, dtypes, shapes, bytes) and
    its configuration. Two requests with the same key would make the same mechanism run on the same inputs.

    The encoding is canonical and unambiguous: every name, dtype, shape, byte string and configuration value
    is a typed, length-prefixed field (:func:`_field`), arrays are taken in name order and dict items in key
    order, so two different requests never make the same byte stream -- a server can neither have a new
    request answered with an old answer nor have an old one taken for new by choosing names that contain
    separators. Values that *are* the same input are encoded alike (a tuple as the list Flower would send, a
    NumPy scalar as its Python number): a retry must be recognised whatever container it came in.
    """
    stream = [_KEY_DOMAIN, _field(b"s", kind.encode())]
    names = sorted(arrays or {})
    stream.append(_field(b"i", str(len(names)).encode()))
    for name in names:
        stream.append(_field(b"s", str(name).encode("utf-8", "surrogatepass")) + _encode_array(arrays[name]))
    stream.append(_encode_value(dict(config or {})))
    return hashlib.sha256(b"".join(stream)).hexdigest()


def _json_native(value: Any) -> bool:
    """Whether ``value`` is made only of what :func:`json.dumps` writes one way only (no ``default=str``)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value) in (type(None), bool, int, float, str)
    if isinstance(value, list) and type(value) is list:
        return all(_json_native(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return all(isinstance(k, str) and _json_native(v) for k, v in value.items())
    return False


def legacy_request_key(kind: str, arrays: Mapping[str, Any] | None = None,
                       config: Mapping[str, Any] | None = None) -> str | None:
    """The key an earlier version of this module gave the request, where that key was unambiguous; else None.

    Why it is still read: answers kept before an upgrade are filed under it, and a hospital upgraded in the
    middle of a run must still recognise a genuine retry of a request it answered before the upgrade -- not
    train or answer again (that second release would be charged, but the lifetime budget would pay twice for
    one answer, and the run's own budget, spent exactly by its plan, would refuse the round).

    The earlier encoding joined fields with NUL bytes and serialised the configuration with
    ``json.dumps(default=str)``: an array name holding a NUL, or a value that JSON writes as another value's
    string (bytes, NumPy scalars, tuples, non-string keys), could make two requests share a key. So it is
    consulted only for requests outside those cases, where it still parses one way only: names free of NUL,
    plain numeric dtypes and JSON-native configuration (dicts with string keys, lists, strings, numbers,
    booleans, None). New answers are filed under :func:`request_key` only. What remains: an answer a server
    planted *before* the upgrade with a crafted NUL-bearing request could still be returned for the one clean
    request whose legacy key it shares -- an answer that server already holds, so nothing new is released.
    """
    arrays = dict(arrays or {})
    config = dict(config or {})
    for name, value in arrays.items():
        array = np.asarray(value)
        if not isinstance(name, str) or "\0" in name or array.dtype.fields is not None or array.dtype.hasobject:
            return None
    if not _json_native(config):
        return None
    digest = hashlib.sha256(kind.encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(np.asarray(arrays[name]))
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    return digest.hexdigest()


class AnswerBook:
    """The answers a hospital gave, by request key, on its own disk (``directory/<key>.npz`` + ``.json``).

    What is kept was already sent: DP-FedAvg's noised updates, and PATE's per-teacher encoded rows, which are not
    noised (a trusted aggregator averages and noises them). Those rows are outputs of teachers trained on the
    hospital's patients without a guarantee of their own, so, like the teachers, every file is owner-only (0600)
    whatever the umask: a colleague on the hospital's machine reads neither.
    """

    def __init__(self, directory: str | Path, max_bytes: int = 64 * 2**20) -> None:
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)

    def _owner_only_folder(self) -> None:
        """The folder itself owner-only (0700), so answers a version before this one kept with the umask's mode
        are no longer readable by others either."""
        if os.name == "posix" and self.directory.is_dir() and (self.directory.stat().st_mode & 0o077):
            os.chmod(self.directory, 0o700)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.directory / f"{key}.npz", self.directory / f"{key}.json"

    def lookup(self, key: str, *older_keys: str | None) -> tuple[dict[str, np.ndarray], dict] | None:
        """The arrays and metadata answered to request ``key`` before, or None. ``older_keys``: the keys the
        same request had under earlier encodings (:func:`legacy_request_key`; None where it had none), tried
        after ``key``, so that answers kept before an upgrade still count."""
        self._owner_only_folder()
        for candidate in (key, *older_keys):
            if candidate is None:
                continue
            arrays_path, meta_path = self._paths(candidate)
            if not (arrays_path.exists() and meta_path.exists()):   # meta is written last: both or not answered
                continue
            with np.load(arrays_path, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files}
            return arrays, json.loads(meta_path.read_text())
        return None

    def store(self, key: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> bool:
        """Keep an answer (atomically; arrays first, metadata last). False when it is too large to keep."""
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
            return False
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        arrays_path, meta_path = self._paths(key)
        atomic_write_bytes(arrays_path, buffer.getvalue(), private=True)
        self._owner_only_folder()
        atomic_write_json(meta_path, dict(meta), private=True)
        return True
