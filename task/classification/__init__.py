"""The other seed systems on classification tasks: DP-MAC, AdLM/ILM, classic PATE (GNMax), DP-SGD.

Every method here trains a small fully connected classifier on a :class:`task.classification.tasks.ClassificationTask` and
returns a :class:`SeedResult`. All noisy releases go through ``privacy.guard.BudgetGuard.charge`` (ledger
record first, then noise, then release); the epsilon a result reports is what the ledger says.

Privacy unit (docs/PRIVACY.md, "The unit of privacy"): one unit of ``task.unit_records()`` at one hospital — an MNIST
digit, or on the slice task one **patient** with all of its slices. Every method works on units, not slices:

* DP-MAC and DP-SGD (user-level DP, the per-user clipping of McMahan, Ramage, Talwar & Zhang 2018, "Learning
  Differentially Private Recurrent Language Models", Alg. 1): Poisson sampling over patients; a patient's
  slices' contributions are *summed, then clipped* to C (DP-MAC's coefficients, its DP-PCA
  second-moment matrix, DP-SGD's per-sample gradient), so adding or removing a patient moves each sum by at
  most C whatever the number of slices (add/remove-one patient).
* AdLM/ILM perturb records one by one, so a patient's budget depends on how many records it has: each
  patient contributes exactly ``records_per_patient`` slices (evenly spaced; repeated when it has fewer) and
  every sensitivity is taken for that group, i.e. each record's noise is sized for ε/k (replace-one patient;
  the k records' pure-ε Laplace releases compose to ε per patient).
* PATE-GNMax: teachers partition whole patients, so a patient changes one teacher's vote (replace-one patient).

The centralised methods train on the pooled private records of all hospitals, so every hospital is a ledger
owner with the same events; PATE's teachers sit at the hospitals (disjoint partitions).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from task.errors import UserError


class PrivacyUnit(StrEnum):
    """What one ε protects on a task (docs/PRIVACY.md, "The unit of privacy"): one record, or one patient with
    all of its records (slices)."""
    RECORD = "record"
    PATIENT = "patient"


@dataclass(frozen=True)
class SeedRun:
    """What one training run of a seed system is given: the task, the budget it may spend and where it is
    charged, and its randomness. Each trainer (``train_dpmac``, ``train_adlm``, ``train_pate_gnmax``,
    ``train_dpsgd``) takes one, beside its own settings.

    Args:
        task: the :class:`task.classification.tasks.ClassificationTask` (its pooled private records).
        epsilon: the budget (> 0); None = no noise and nothing charged (a non-private or noise-free run).
        delta: the δ of the budget (in [0, 1)).
        guard: the ``privacy.guard.BudgetGuard`` every release is charged through before its noise is drawn.
        owners: the ledger owners charged (every hospital whose records are pooled).
        seed: the run's non-private randomness (initialisation, batch order, partitions; see each trainer).
        noise: the ``privacy.mechanisms.NoiseSource`` of the releases and private sampling (secure when None).
        progress: per-epoch (or summary) lines.
        release_prefix: the prefix of the release ids, which also name the noise streams (None = the
            trainer's own: its method's name).
    """

    task: Any
    epsilon: float | None
    delta: float
    guard: Any
    owners: Sequence[str]
    seed: int = 0
    noise: Any = None
    progress: bool = False
    release_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise UserError(f"epsilon: expected a positive budget (or None: no noise), got {self.epsilon}")
        if not 0 <= self.delta < 1:
            raise UserError(f"delta: expected a number in [0, 1), got {self.delta}")

    @property
    def private(self) -> bool:
        """Whether the run spends a budget (releases noise, charged to ``owners``)."""
        return self.epsilon is not None

    def prefix(self, default: str) -> str:
        """The release ids' prefix: the run's own, else ``default``."""
        return self.release_prefix or default


@dataclass(frozen=True)
class PlainTraining:
    """Plain (non-private) Adam / cross-entropy training of a :func:`build_mlp` net (:func:`train_nonprivate`).

    Args:
        hidden: the hidden layers' widths.
        epochs: passes over the data.
        batch_size: examples per Adam step (each epoch in a seeded random order).
        lr: Adam's learning rate.
        weight_decay: Adam's weight decay.
    """

    hidden: tuple[int, ...] = (128,)
    epochs: int = 20
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if any(int(h) < 1 for h in self.hidden):
            raise UserError(f"hidden: expected positive layer widths, got {self.hidden}")
        if self.epochs < 0:
            raise UserError(f"epochs: expected 0 or more, got {self.epochs}")
        if self.batch_size < 1:
            raise UserError(f"batch_size: expected at least 1, got {self.batch_size}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise UserError(f"lr / weight_decay: expected lr > 0 and weight_decay >= 0, got {self.lr}, "
                            f"{self.weight_decay}")


@dataclass
class SeedResult:
    method: str
    accuracy: float
    epsilon_budget: float | None
    delta: float
    relation: str | None
    sigma: float | None = None
    teachers: int | None = None
    queries: int | None = None
    bytes_up_per_query_per_teacher: int | None = None
    details: dict = field(default_factory=dict)
    model: object = None


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def build_mlp(input_dim: int, hidden: tuple[int, ...], classes: int):
    """Fully connected ReLU net (the nets of DP-MAC's classifier experiment: one hidden layer of 300)."""

    layers, width = [], input_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def accuracy(model, x: np.ndarray, y: np.ndarray, transform=None) -> float:
    if len(y) == 0:
        return float("nan")
    model.eval()
    with torch.no_grad():
        inputs = torch.as_tensor(x, dtype=torch.float32)
        if transform is not None:
            inputs = transform(inputs)
        pred = model(inputs).argmax(dim=1).numpy()
    return float((pred == np.asarray(y)).mean())


def predict(model, x: np.ndarray) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=torch.float32)).argmax(dim=1).numpy()


def train_nonprivate(x: np.ndarray, y: np.ndarray, classes: int, training: PlainTraining = PlainTraining(),
                     seed: int = 0):
    """Plain Adam/cross-entropy training (the non-private baseline, PATE teachers and students, AdLM's relevance
    network).

    Args:
        x: (n, d) features.
        y: (n,) integer labels.
        classes: the number of classes (the output width).
        training: the network and optimiser settings (:class:`PlainTraining`).
        seed: the network's initialisation and the batch order.
    """

    set_seed(seed)
    model = build_mlp(x.shape[1], training.hidden, classes)
    opt = torch.optim.Adam(model.parameters(), lr=training.lr, weight_decay=training.weight_decay)
    xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    n = len(yt)
    batch_size = training.batch_size
    for _ in range(training.epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    return model


def gather_units(units: list[np.ndarray], chosen) -> tuple[np.ndarray, np.ndarray]:
    """Records of the ``chosen`` units and, per record, the position of its unit among them (the groups that
    are clipped together). A unit is always taken whole."""
    parts = [units[int(u)] for u in chosen]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(parts), np.repeat(np.arange(len(parts)), [len(p) for p in parts])


def padded_units(x: np.ndarray, y: np.ndarray, units: list[np.ndarray]):
    """``(X, Y, mask)``: unit i's records in row i, ``X`` (U, S, d) float32, ``Y`` (U, S) int64 and ``mask``
    (U, S) float32 (1 = a real record, 0 = padding), S = the largest unit. Per-sample gradients over the first
    axis are then per-unit gradients (a patient's slices summed) — what user-level clipping needs."""

    width = max(len(r) for r in units)
    X = np.zeros((len(units), width, x.shape[1]), np.float32)
    Y = np.zeros((len(units), width), np.int64)
    mask = np.zeros((len(units), width), np.float32)
    for i, records in enumerate(units):
        X[i, :len(records)], Y[i, :len(records)], mask[i, :len(records)] = x[records], y[records], 1.0
    return torch.from_numpy(X), torch.from_numpy(Y), torch.from_numpy(mask)


def capped_units(units: list[np.ndarray], per_unit: int) -> np.ndarray:
    """(U, per_unit) record indices: exactly ``per_unit`` records of every unit, evenly spaced over the unit's
    records (slice order), repeating records when the unit has fewer. A function of each unit's own records,
    so a unit's contribution has a fixed size whatever its number of slices."""
    if per_unit < 1:
        raise UserError(f"records_per_patient: expected a positive integer, got {per_unit}")
    return np.stack([r[np.round(np.linspace(0, len(r) - 1, per_unit)).astype(np.int64)] for r in units])


def owners_of(task) -> list[str]:
    return list(task.hospitals)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
