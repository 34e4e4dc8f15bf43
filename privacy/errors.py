"""Errors of the privacy core.

All are ``ValueError`` subclasses with a one-line message that names the parameter, owner or file and says
what was expected; ``sim/cli.py`` prints them as ``fedpate CMD: error: <message>`` and exits 2.
"""

from __future__ import annotations


class PrivacyError(ValueError):
    """A privacy parameter, event, ledger or budget problem the user can fix (one-line message)."""


class BudgetExceeded(PrivacyError):
    """A release would take a data owner past its privacy budget; nothing was recorded or released."""


class UnsupportedEvent(PrivacyError):
    """An accountant was asked to compose an event it cannot account exactly; its state is unchanged."""
