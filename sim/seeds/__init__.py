"""The other seed systems on classification tasks (issue 7): DP-MAC, AdLM/ILM, classic PATE (GNMax), DP-SGD.

Every method here trains a small fully connected classifier on a :class:`sim.tasks.ClassificationTask` and
returns a :class:`SeedResult`. All noisy releases go through ``privacy.guard.BudgetGuard.charge`` (ledger
record first, then noise, then release); the epsilon a result reports is what the ledger says.

Privacy unit: one record (an MNIST digit, or a tumour *slice*) at one hospital. The centralised methods
(DP-MAC, AdLM/ILM, DP-SGD) train on the pooled private records of all hospitals, so every hospital is a
ledger owner with the same events; PATE's teachers sit at the hospitals (disjoint partitions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

METHODS = ("dp-mac", "adlm", "ilm", "pate-gnmax", "dp-sgd", "dp-sgd-scheduled", "nonprivate")


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
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def build_mlp(input_dim: int, hidden: tuple[int, ...], classes: int):
    """Fully connected ReLU net (the nets of DP-MAC's classifier experiment: one hidden layer of 300)."""
    import torch.nn as nn

    layers, width = [], input_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def accuracy(model, x: np.ndarray, y: np.ndarray, transform=None) -> float:
    import torch

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
    import torch

    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=torch.float32)).argmax(dim=1).numpy()


def train_nonprivate(x: np.ndarray, y: np.ndarray, classes: int, hidden=(128,), epochs: int = 20,
                     batch_size: int = 64, lr: float = 1e-3, seed: int = 0, weight_decay: float = 0.0):
    """Plain Adam/cross-entropy training (the non-private baseline, PATE teachers and students)."""
    import torch

    set_seed(seed)
    model = build_mlp(x.shape[1], tuple(hidden), classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    xt, yt = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    n = len(yt)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    return model


def owners_of(task) -> list[str]:
    return list(task.hospitals)


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
