"""What both of a hospital's secure-sum contributions check in a request before anything is charged: the
refusal they raise, and the integer grid a request declares. The PATE contribution (``clients.secure``) and the
gradient one (``clients.secure_gradients``) both import this module; neither imports the other's checks."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from privacy.distributed import IntegerGrid
from task.errors import UserError


class SecureRequestRefused(UserError):
    """A secure-sum request this hospital will not take part in (the message says why)."""


def declared_grid(who: str, noise: Mapping[str, Any]) -> IntegerGrid:
    """The integer grid a request declares (clip, granularity, dimension), checked; the hospital re-clips its
    rows to ``clip`` and computes the rounded rows' norm bound itself (``privacy.distributed``)."""
    try:
        grid = IntegerGrid(float(noise["clip"]), float(noise["granularity"]), int(noise["dimension"]))
        bound = grid.row_bound
    except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
        raise SecureRequestRefused(f"hospital {who}: the request's integer grid is invalid ({exc})") from None
    if not (np.isfinite(bound) and grid.dimension >= 1 and grid.granularity > 0):
        raise SecureRequestRefused(f"hospital {who}: the request's integer grid is invalid")
    return grid
