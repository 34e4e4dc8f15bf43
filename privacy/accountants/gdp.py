"""The gdp-exact accountant: un-subsampled Gaussians composed exactly in μ-GDP."""

from __future__ import annotations

import math

from privacy.accountants.base import Accountant, gdp_delta, gdp_epsilon, gdp_mu
from privacy.events import Event, GaussianEvent


class GaussianGDPAccountant(Accountant):
    """Exact accounting of un-subsampled Gaussians through μ-GDP (Dong, Roth & Su 2019, arXiv 1905.02383).

    Filter-valid: with σ_i chosen adaptively, stopping before ``sqrt(Σ μ_i²)`` exceeds μ keeps the run μ-GDP
    (Smith & Thakurta 2022, fully adaptive composition for Gaussian DP), and ε(μ) is increasing in μ.
    """

    name = "gdp-exact"
    filter_valid = True

    def __init__(self) -> None:
        super().__init__()
        self.mu_squared = 0.0

    def _supports_leaf(self, event: Event) -> bool:
        return isinstance(event, GaussianEvent)

    def _apply(self, event: Event) -> None:
        self.mu_squared += gdp_mu([event]) ** 2

    @property
    def mu(self) -> float:
        return math.sqrt(self.mu_squared)

    def get_epsilon(self, delta: float) -> float:
        return gdp_epsilon(self.mu, delta)

    def get_delta(self, epsilon: float) -> float:
        return gdp_delta(self.mu, epsilon)
