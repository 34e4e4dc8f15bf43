"""A run folder is resumed only with the settings it was started with.

``fedpate compare`` skips finished cells and ``fedpate central`` continues from its checkpoint: both take what
is already in ``--out`` as part of this run. Started again with another seed, preset, δ, data or noise, they
would put cells (or epochs) of two different runs under one header. Each records the settings that decide its
results when it starts (:func:`refuse_other_settings` compares them on every later start) and refuses, in one
line naming every setting that differs, anything else. Settings that change no result (progress bars, the
number of worker processes, the device) may differ.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Collection, Mapping

from task.errors import UserError

#: the command-line flag that sets each recorded setting (a setting without one is named as recorded)
FLAGS = {
    "task": "--task", "preset": "--preset", "seed": "--seed", "noise": "--reproducible-noise", "delta": "--delta",
    "data": "--data", "layout": "--layout", "partition_file": "--partition-file", "hospitals": "--hospitals",
    "teachers_per_hospital": "--teachers-per-hospital", "init": "--init", "engine": "--engine",
    "precision": "--precision", "lifetime_epsilon_given": "--lifetime-epsilon", "method": "--method",
    "name": "the method name",
    "epsilon": "--epsilon", "training": "the training options", "dpsgd": "the DP-SGD options",
    "selection": "--selection", "selection_config": "the selection options",
}


def _plain(value: Any) -> Any:
    """The value as JSON stores it (tuples are lists, paths strings), so a saved and a new setting compare."""
    return json.loads(json.dumps(value, default=str))


def _shown(value: Any, key: str = "") -> str:
    if value is None:   # a seed left out because it drives reproducible noise; an option not given
        return "unpublished (reproducible noise)" if key == "seed" else "not given"
    return value if isinstance(value, str) else json.dumps(value, default=str)


def read_settings(path: Path) -> dict | None:
    """The settings saved at ``path`` (None when there are none yet); an unreadable file is a one-line error."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc.__class__.__name__}); expected the settings this folder was "
                        "run with, or a new --out folder") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not the settings of a run; expected a new --out folder")
    return saved


def refuse_other_settings(path: Path, settings: Mapping[str, Any], *, hidden: Collection[str] = ()) -> None:
    """Refuse (one line, every differing setting and its flag) when the settings saved at ``path`` by an earlier
    start differ from ``settings``. A setting the file does not hold (written before it was recorded) is not
    compared. ``hidden``: settings whose values may not be printed (the seed under reproducible noise drives
    the noise and is published nowhere): only their names are."""
    saved = read_settings(path)
    if saved is None:
        return
    differ = []
    for key, value in settings.items():
        if key not in saved or _plain(saved[key]) == _plain(value):
            continue
        flag = FLAGS.get(key, key)
        differ.append(flag if key in hidden else f"{flag} {_shown(saved[key], key)} there, {_shown(value, key)} now")
    if differ:
        raise UserError(f"--out {path.parent}: holds a run with other settings ({'; '.join(differ)}); "
                        "resume it with the same settings, or use a new --out folder")


def refuse_other_world(path: Path, world: Mapping[str, Any]) -> None:
    """Refuse when the world recorded at ``path`` (``task.world.describe_world``: who holds how many patients
    from which source, split by which seed) is not the world these settings build: another data folder, or
    the same one changed. Names the parts that differ, not their values (the split's seed is among them)."""
    saved = read_settings(path)
    if saved is None:
        return
    new = _plain(dict(world))
    differ = sorted(key for key in set(saved) | set(new) if saved.get(key) != new.get(key))
    if differ:
        raise UserError(f"--out {path.parent}: holds a run on another world ({', '.join(differ)} of {path.name} "
                        "differ: other data, another split or other hospitals); resume it with the same settings "
                        "and data, or use a new --out folder")


def merged(saved: list | None, new: list) -> list:
    """``saved`` then what ``new`` adds (a resume may add methods or budgets: each cell is its own folder)."""
    out = list(saved or [])
    return out + [item for item in new if item not in out]


def set_aside_interrupted(path: Path, counted_in: str = "the hospitals' ledgers") -> Path | None:
    """A cell folder with a ledger but no results was interrupted after releasing: keep it (renamed
    ``<cell>.interrupted-<time>``), so the cell can run again in a fresh folder. Its ledger is never deleted:
    its releases stay counted (``counted_in`` says where, for the line printed). Returns the new folder, or
    None when nothing was released there (an empty or missing ledger) or the cell finished."""
    ledger = path / "ledger.jsonl"
    if (path / "results.json").exists() or not ledger.exists() or ledger.stat().st_size == 0:
        return None
    aside = path.with_name(f"{path.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}")
    path.rename(aside)
    print(f"compare: {path} was interrupted after releasing; kept as {aside.name} and run again "
          f"(its releases stay counted in {counted_in})", flush=True)
    return aside
