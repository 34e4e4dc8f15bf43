"""Converting between numpy / plain dicts and Flower records (the only Flower types on the wire).

Both apps use these so the wire format is defined once. Arrays travel in ``ArrayRecord`` under
string keys; scalars and strings in ``ConfigRecord`` (ConfigRecord cannot hold None or nested dicts:
nested values are JSON-encoded under the key ``"json"``). A nested message that mixes both -- the secure
sum's stages: lists, dicts, bytes (keys, ciphertexts, shares) and integer arrays -- is split by
:func:`pack_nested` into a JSON skeleton and named arrays (bytes as uint8 arrays), and rebuilt by
:func:`unpack_nested`; nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

#: the query message's config key naming the codec state meant (its :func:`arrays_digest`): the Flower transport
#: ships a codec once per hospital, and a node that does not hold that state answers ``codec-missing`` (checked
#: before the request itself, so the server re-sends the state)
CODEC_DIGEST = "codec_digest"


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Pack named numpy arrays (0-d arrays included) into one ArrayRecord, preserving names."""
    packed: "OrderedDict[str, Array]" = OrderedDict()
    for name, value in arrays.items():
        array = np.asarray(value)
        if array.dtype.kind in "US":  # strings travel as UTF-8 bytes
            array = np.frombuffer(str(array.item()).encode("utf-8"), dtype=np.uint8).copy()
            name = f"{name}::str"
        elif array.ndim == 0:  # Flower stores 0-d arrays as shape (1,): mark them to restore the shape
            array = array.reshape(1)
            name = f"{name}::0d"
        packed[name] = Array(np.ascontiguousarray(array))
    return ArrayRecord(packed)


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for name, value in record.items():
        array = value.numpy()
        if name.endswith("::str"):
            arrays[name[: -len("::str")]] = np.array(array.astype(np.uint8).tobytes().decode("utf-8"))
        elif name.endswith("::0d"):
            arrays[name[: -len("::0d")]] = array.reshape(())
        else:
            arrays[name] = array
    return arrays


def config_to_record(config: Mapping[str, Any]) -> ConfigRecord:
    """A plain (possibly nested) dict as a ConfigRecord: the whole dict JSON-encoded under "json"."""
    return ConfigRecord({"json": json.dumps(dict(config), default=_json_default)})


def record_to_config(record: ConfigRecord) -> dict[str, Any]:
    return json.loads(str(record["json"]))


def metrics_to_record(metrics: Mapping[str, float]) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in metrics.items() if v is not None})


def make_content(config: Mapping[str, Any] | None = None, **arrays: Mapping[str, np.ndarray]) -> RecordDict:
    """A message body: ``config`` as a ConfigRecord, every keyword as an ArrayRecord of that name."""
    content = RecordDict()
    content["config"] = config_to_record(config or {})
    for name, value in arrays.items():
        content[name] = arrays_to_record(value)
    return content


def read_content(content: RecordDict) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """Inverse of :func:`make_content`: (config, {record name: {array name: array}})."""
    config = record_to_config(content["config"]) if "config" in content else {}
    arrays = {name: record_to_arrays(record) for name, record in content.array_records.items()}
    return config, arrays


_BYTES, _ARRAY = "$bytes", "$array"


def pack_nested(value: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """(JSON-able skeleton, named arrays) of a nested message: dicts with string keys, lists and tuples (both
    come back as lists), str / int / float / bool / None, numpy scalars, numpy arrays and bytes. Each array
    and each bytes value is replaced in the skeleton by a one-key reference dict to its entry in the arrays
    (bytes as a uint8 array); the skeleton travels in a ConfigRecord (:func:`make_content`), the arrays in an
    ArrayRecord. Raises ValueError / TypeError for what cannot travel (a key starting with ``$``, an object)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, (bytes, bytearray, memoryview)):
            name = f"b{len(arrays)}"
            arrays[name] = np.frombuffer(bytes(item), dtype=np.uint8).copy()
            return {_BYTES: name}
        if isinstance(item, np.ndarray):
            name = f"a{len(arrays)}"
            arrays[name] = item
            return {_ARRAY: name}
        if isinstance(item, Mapping):
            packed = {}
            for key, entry in item.items():
                if not isinstance(key, str) or key.startswith("$"):
                    raise ValueError(f"pack_nested: key {key!r} cannot travel (string keys not starting with $)")
                packed[key] = walk(entry)
            return packed
        if isinstance(item, (list, tuple)):
            return [walk(entry) for entry in item]
        if isinstance(item, np.generic):
            return item.item()
        if item is None or isinstance(item, (str, int, float, bool)):
            return item
        raise TypeError(f"pack_nested: a value of type {type(item).__name__} cannot travel")

    return walk(value), arrays


def unpack_nested(skeleton: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Inverse of :func:`pack_nested`. A reference to a missing array, or bytes that are not a uint8 vector,
    raises KeyError / ValueError (a malformed message)."""

    def walk(item: Any) -> Any:
        if isinstance(item, dict):
            if len(item) == 1 and _BYTES in item:
                raw = np.asarray(arrays[str(item[_BYTES])])
                if raw.dtype != np.uint8 or raw.ndim != 1:
                    raise ValueError(f"unpack_nested: bytes {item[_BYTES]!r} are not a uint8 vector")
                return raw.tobytes()
            if len(item) == 1 and _ARRAY in item:
                return arrays[str(item[_ARRAY])]
            return {key: walk(entry) for key, entry in item.items()}
        if isinstance(item, list):
            return [walk(entry) for entry in item]
        return item

    return walk(skeleton)


def arrays_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """Content digest of named arrays (to ship a compressor state once and detect stale copies)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(np.asarray(arrays[name]))
        digest.update(name.encode())
        digest.update(str(array.dtype).encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"config value of type {type(value).__name__} cannot travel in a ConfigRecord")
