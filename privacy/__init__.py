"""fedpate's framework-free privacy core (its model: docs/PRIVACY.md; its place among the layers: docs/ARCHITECTURE.md).

events (what was released) → ledger (append-only, per owner) → accountants (ε from the events) →
guard (refuse before release); calibration (σ for a target ε), mechanisms (noise), sensitivity (S),
schedules (DP-SGD noise decay). Imports numpy, scipy and dp_accounting only (torch lazily in mechanisms).
"""

from privacy.accountants import (
    ACCOUNTANTS,
    Accountant,
    GaussianGDPAccountant,
    PLDAccountant,
    PureDPAccountant,
    RDPAccountant,
    RDPFilterAccountant,
    ZCDPAccountant,
    accountant_for,
    epsilon_per_relation,
    epsilon_spent,
    epsilon_under,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    make_accountant,
)
from privacy.calibration import (
    calibrate,
    dpsgd_noise_multiplier,
    paper_sigma,
    pate_sigma,
    shuffled_noise_multiplier,
)
from privacy.errors import BudgetExceeded, PrivacyError, UnsupportedEvent
from privacy.events import (
    ComposedEvent,
    Event,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    SampledGaussianEvent,
    ZCDPEvent,
    event_from_dict,
)
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger, Spent
from privacy.mechanisms import GaussianMechanism, LaplaceMechanism, make_generator

__all__ = [
    "ACCOUNTANTS", "Accountant", "GaussianGDPAccountant", "PLDAccountant", "PureDPAccountant", "RDPAccountant",
    "RDPFilterAccountant", "ZCDPAccountant", "accountant_for", "epsilon_per_relation", "epsilon_spent",
    "epsilon_under", "gdp_delta", "gdp_epsilon", "gdp_mu", "make_accountant",
    "calibrate", "dpsgd_noise_multiplier", "paper_sigma", "pate_sigma", "shuffled_noise_multiplier",
    "BudgetExceeded", "PrivacyError", "UnsupportedEvent",
    "ComposedEvent", "Event", "GaussianEvent", "LaplaceEvent", "PureDPEvent", "SampledGaussianEvent", "ZCDPEvent",
    "event_from_dict", "BudgetGuard", "Ledger", "Spent", "GaussianMechanism", "LaplaceMechanism", "make_generator",
]
