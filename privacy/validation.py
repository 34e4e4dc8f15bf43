"""Parameter checks shared by the privacy modules: one-line PrivacyError naming the parameter (and, where
given, what it belongs to: ``"GaussianEvent: sigma must be ..."``)."""

from __future__ import annotations

import math
from typing import Any

from privacy.errors import PrivacyError


def _named(name: str, owner: str | None) -> str:
    return f"{owner}: {name}" if owner else name


def positive_number(name: str, value: Any, owner: str | None = None, *, finite: bool = True) -> float:
    """``value`` as a float, or PrivacyError unless it is a positive (by default also finite) number.
    Booleans are refused: ``True`` is not a sensitivity."""
    what = "a positive finite number" if finite else "a positive number"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{_named(name, owner)} must be {what}, got {value!r}") from None
    if isinstance(value, bool) or math.isnan(number) or number <= 0 or (finite and math.isinf(number)):
        raise PrivacyError(f"{_named(name, owner)} must be {what}, got {value!r}")
    return number


def positive_integer(name: str, value: Any, owner: str | None = None) -> int:
    """``value`` as an int (an integral float is accepted), or PrivacyError unless it is >= 1."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or int(value) < 1:
        raise PrivacyError(f"{_named(name, owner)} must be a positive integer, got {value!r}")
    return int(value)


def non_negative_number(name: str, value: Any) -> float:
    """``value`` as a float >= 0 (infinity allowed), or PrivacyError."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{name} must be a non-negative number, got {value!r}") from None
    if not (number >= 0):   # also refuses NaN
        raise PrivacyError(f"{name} must be a non-negative number, got {value!r}")
    return number


def probability(name: str, value: Any) -> float:
    """``value`` as a float strictly inside (0, 1) -- a delta -- or PrivacyError."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{name} must be a number in (0, 1), got {value!r}") from None
    if isinstance(value, bool) or not (0 < number < 1):
        raise PrivacyError(f"{name} must be in (0, 1), got {value!r}")
    return number
