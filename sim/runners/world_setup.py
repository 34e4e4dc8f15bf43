"""The simulated world on disk: which data, prepared at which grid, split how.

``world.json`` + ``split.json`` in a folder every party of a simulation reads (the server for the
public sets, each simulated hospital for its own teacher partitions). The prepared cases themselves
stay in the shared preparation cache; ``world.json`` says where.

In a deployment there is no shared world: each hospital prepares its own folder (clients/node.py) and
the server's world holds only public data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sim.io import atomic_write_json, cache_root


def materialise_world(preset, data: str | Path | None, seed: int, progress: bool = True,
                      root: str | Path | None = None) -> Path:
    """Prepare the data and the split for ``preset`` (hospitals x teachers already applied); return the folder."""
    from sim.runners.inprocess import build_world

    prepared, split = build_world(preset, data, seed, progress)
    key = json.dumps({"prepared": str(prepared.path), "hospitals": preset.hospitals,
                      "teachers": preset.teachers_per_hospital, "scheme": preset.split_scheme, "seed": seed,
                      "sizes": [preset.n_query, preset.n_reference, preset.n_validation, preset.n_test]},
                     sort_keys=True)
    folder = Path(root) if root else cache_root() / "worlds" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    split.to_json(folder / "split.json")
    atomic_write_json(folder / "world.json", {
        "prepared": str(prepared.path), "data": str(data) if data else None, "grid": list(preset.grid),
        "preset": preset.name, "seed": seed, "hospitals": sorted(split.hospitals),
    })
    return folder


def open_world(folder: str | Path):
    """(prepared dataset, split) of a world folder written by :func:`materialise_world`."""
    from sim.data.partitions import Split
    from sim.data.preprocess import PreparedDataset

    folder = Path(folder)
    meta = json.loads((folder / "world.json").read_text())
    return PreparedDataset.open(meta["prepared"]), Split.from_json(folder / "split.json")
