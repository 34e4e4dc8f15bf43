"""The single accountants (every one but the split accountant) by the names ledgers and results record."""

from __future__ import annotations

from privacy.accountants.base import ACCOUNTANTS, Accountant
from privacy.accountants.gdp import GaussianGDPAccountant
from privacy.accountants.pld import PLDAccountant
from privacy.accountants.pure_dp import PureDPAccountant
from privacy.accountants.rdp import RDPAccountant, RDPFilterAccountant
from privacy.accountants.zcdp import ZCDPAccountant
from privacy.errors import PrivacyError

_FACTORIES = {
    "gdp-exact": GaussianGDPAccountant,
    "pld": PLDAccountant,
    "rdp": RDPAccountant,
    "rdp-filter": RDPFilterAccountant,
    "zcdp": ZCDPAccountant,
    "basic": PureDPAccountant,
}


def make_family_accountant(name: str, **options) -> Accountant:
    """A fresh single accountant by name (one of ``ACCOUNTANTS``)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise PrivacyError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")
    return factory(**options)
