"""Accounting once: σ calibrations and comparison figures memoised on disk.

A DP-SGD noise multiplier calibrated for a target (ε, δ) is a pure function of its inputs -- ε, δ, the Poisson
rate and steps of every run, the accountant, the relation, PLD's discretisation -- and of the accounting code
(``privacy/``'s accountants, calibration and events, dp_accounting, scipy, numpy). A calibration takes seconds to
minutes (a PLD search composes the whole plan a dozen times), and comparisons repeat the same plan for every seed
and cell. So the answer is kept in the cache folder the rest of fedpate uses (``task.io.cache_root()``, i.e.
``$FEDPATE_CACHE``), under ``accounting/``, one JSON file per input set, written atomically; its name is the
sha256 of the inputs and of :func:`accounting_version`, so a change of the code or a library gives new files.

What is cached is only ever a *proposal*: a DP-SGD run still composes its whole plan once with the ledger's own
accountant before its first epoch (``privacy.guard.BudgetGuard.expect``), so a stale or tampered file can make a
run fail (the guard refuses a σ that overspends), never overspend. A file whose recorded inputs differ from the
asked ones, or that cannot be read, is ignored and rewritten. ``FEDPATE_ACCOUNTING_CACHE`` names another folder
for the memo, or turns it off (``off``: everything is computed afresh).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from privacy import calibration
from privacy.accountants import epsilon_per_relation, epsilon_spent
from task.io import atomic_write_json, cache_root
from task.learning.phases import phase

#: the ``privacy/`` sources whose code decides every calibrated σ and composed ε (a folder: each of its modules)
_ACCOUNTING_SOURCES = ("accountants", "calibration.py", "events.py", "options.py")


@functools.cache
def accounting_version() -> str:
    """sha256 of the accounting code and the libraries it computes with: part of every memo's key."""
    import dp_accounting
    import numpy
    import scipy

    import privacy

    digest = hashlib.sha256()
    root = Path(privacy.__file__).parent
    for name in _ACCOUNTING_SOURCES:
        source = root / name
        for path in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    for library in (dp_accounting, scipy, numpy):
        digest.update(f"{library.__name__}=={getattr(library, '__version__', '?')}".encode())
    return digest.hexdigest()


def memo_folder() -> Path | None:
    """``cache_root() / "accounting"``, or the folder ``FEDPATE_ACCOUNTING_CACHE`` names; None when it is ``off``."""
    setting = os.environ.get("FEDPATE_ACCOUNTING_CACHE", "").strip()
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    return Path(setting) if setting else cache_root() / "accounting"


def memoised(kind: str, inputs: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered on disk under (``kind``, ``inputs``, :func:`accounting_version`).

    ``inputs`` must be JSON (numbers, strings, lists): every input the result depends on. A file is used only when
    the kind, inputs and version it records equal the asked ones; an unreadable one is recomputed and replaced.
    """
    with phase("accounting"):
        return _memoised(kind, inputs, compute)


def _memoised(kind: str, inputs: dict[str, Any], compute: Callable[[], Any]) -> Any:
    record = {"kind": kind, "inputs": json.loads(json.dumps(inputs)), "version": accounting_version()}
    folder = memo_folder()
    if folder is None:
        return compute()
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    path = folder / f"{kind}-{key[:32]}.json"
    try:
        stored = json.loads(path.read_text())
        if {k: stored.get(k) for k in record} == record and "value" in stored:
            return stored["value"]
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**record, "value": value})
    except OSError:   # a read-only cache costs time, never the run
        pass
    return value


def dpsgd_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int, *,
                           accountant: str, relation: str) -> float:
    """``privacy.calibration.dpsgd_noise_multiplier``, memoised on disk.

    Args:
        epsilon / delta: the target (ε, δ).
        sampling_rate: the Poisson sampling rate q.
        steps: the number of DP-SGD steps T.
        accountant: ``pld`` or ``rdp`` (add/remove only).
        relation: ``add-remove`` or ``replace-one``.
    """
    return composed_dpsgd_noise_multiplier(epsilon, delta, [(sampling_rate, steps)], accountant=accountant,
                                           relation=relation)


def composed_dpsgd_noise_multiplier(epsilon: float, delta: float, runs: Sequence[tuple[float, int]], *,
                                    accountant: str = "pld", relation: str) -> float:
    """``privacy.calibration.composed_dpsgd_noise_multiplier``, memoised on disk (one run: the same answer as
    ``dpsgd_noise_multiplier``, which is that function with one run)."""
    runs = [[float(q), int(steps)] for q, steps in runs]
    inputs = {"epsilon": float(epsilon), "delta": float(delta), "runs": runs, "accountant": str(accountant),
              "relation": str(relation), "value_discretization_interval": None}
    return float(memoised("dpsgd-sigma", inputs, lambda: calibration.composed_dpsgd_noise_multiplier(
        epsilon, delta, [tuple(run) for run in runs], accountant=accountant, relation=relation)))


def _events_json(events) -> list:
    return [event.to_dict() for event in events]


def memoised_per_relation(events, delta: float, relation: str, epsilon: float) -> dict:
    """``privacy.accountants.epsilon_per_relation`` (the same mechanisms' ε under the other relation), memoised on
    disk: a figure for comparison, composed from the events alone."""
    inputs = {"events": _events_json(events), "delta": float(delta),
              "relation": None if relation is None else str(relation), "epsilon": float(epsilon)}
    return dict(memoised("per-relation", inputs, lambda: epsilon_per_relation(events, delta, relation, epsilon)))


def memoised_epsilon_spent(events, delta: float, accountant: str) -> float:
    """ε of ``events`` under a named accountant (``privacy.accountants.epsilon_spent``), memoised on disk: DP-SGD's
    RDP figure for comparison."""
    inputs = {"events": _events_json(events), "delta": float(delta), "accountant": str(accountant)}
    return float(memoised("epsilon", inputs, lambda: epsilon_spent(events, delta, accountant=accountant)[0]))
