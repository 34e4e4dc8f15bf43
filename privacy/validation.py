"""Parameter checks shared by the privacy modules (one-line PrivacyError naming the parameter)."""

from __future__ import annotations

import math

from privacy.errors import PrivacyError


def positive_number(name: str, value) -> float:
    """``value`` as a float, or PrivacyError unless it is a positive finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PrivacyError(f"{name} must be a positive finite number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise PrivacyError(f"{name} must be a positive finite number, got {value!r}")
    return number
