"""The privacy core's named options, as string enums, and the one lookup every user-facing value goes through.

Each option is a :class:`enum.StrEnum`: a member *is* its string (``Relation.REPLACE_ONE == "replace-one"``), so
ledgers, results and wire messages keep their text, while code compares against members instead of literals.
:func:`look_up_option` turns a user's value into a member, or fails with one line that names the option and lists
the choices (MONAI's ``monai.utils.look_up_option`` pattern).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from privacy.errors import PrivacyError

E = TypeVar("E", bound=StrEnum)


class Relation(StrEnum):
    """Neighbouring relation of a guarantee (``privacy.events`` module docstring)."""
    REPLACE_ONE = "replace-one"  # same size, one patient's record replaced (PATE, the default of comparisons)
    ADD_REMOVE = "add-remove"    # one patient's record added or removed (Opacus / dp_accounting convention)
    ZERO_OUT = "zero-out"        # one record's contribution zeroed (shuffled batches; Yu et al. 2019)


class Sampling(StrEnum):
    """How DP-SGD forms its batches (``privacy.schedules``: accounting must match batching)."""
    POISSON = "poisson"   # each record joins each step independently with probability q
    SHUFFLE = "shuffle"   # one random permutation per epoch cut into disjoint batches


class ScheduleFamily(StrEnum):
    """A noise-decay schedule's family (Yu et al. 2019, "Differentially Private Model Publishing for Deep
    Learning", arXiv 1904.02200, Sec. IV-A)."""
    TIME = "time"
    EXPONENTIAL = "exponential"
    STEP = "step"
    POLYNOMIAL = "polynomial"
    VALIDATION = "validation"


class Calibration(StrEnum):
    """How PATE's per-query σ is calibrated (``privacy.calibration.pate_sigma``)."""
    EXACT = "exact"   # the exact μ-GDP composition (Dong, Roth & Su 2019, arXiv 1905.02383)
    PAPER = "paper"   # Fay et al.'s eq. (15), the zCDP conversion: valid, looser


class NoiseKind(StrEnum):
    """Where a run's noise comes from (``privacy.mechanisms.NoiseSource``; the ``noise`` of results.json)."""
    SECURE = "secure"               # the operating system's CSPRNG, a fresh stream per release
    REPRODUCIBLE = "reproducible"   # seeded per release name: a simulation only, whoever knows the seed removes it


class AccountantName(StrEnum):
    """The accountants by the names ledgers and results record (``privacy.accountants.make_accountant``)."""
    GDP_EXACT = "gdp-exact"     # exact μ-GDP of Gaussian compositions
    PLD = "pld"                 # dp_accounting's privacy-loss distributions
    RDP = "rdp"                 # dp_accounting's Rényi DP
    RDP_FILTER = "rdp-filter"   # a Rényi privacy filter (adaptive compositions)
    ZCDP = "zcdp"               # zero-concentrated DP
    BASIC = "basic"             # pure-ε basic composition


def choices(options: type[StrEnum]) -> str:
    """The values of ``options``, comma-separated (for help texts and errors)."""
    return ", ".join(member.value for member in options)


def look_up_option(value, options: type[E], name: str, *, error: type[Exception] = PrivacyError) -> E:
    """``value`` as a member of ``options``, or ``error`` with one line that names ``name`` and lists the choices.

    Args:
        value: a member of ``options`` or its string.
        options: the :class:`enum.StrEnum` of the choices.
        name: the option's user-facing name (a parameter, flag or preset field), put first in the message.
        error: the exception class raised for a bad value (a ``ValueError`` subclass the caller's CLI prints as
            one line; the privacy core's own :class:`privacy.errors.PrivacyError` by default).
    """
    if isinstance(value, options):
        return value
    try:
        return options(value)
    except ValueError:
        raise error(f"{name}: unknown value {value!r}; expected one of {choices(options)}") from None


__all__ = ["AccountantName", "Calibration", "NoiseKind", "Relation", "Sampling", "ScheduleFamily", "choices", "look_up_option"]
