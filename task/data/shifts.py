"""Names of the held-out phantom regimes (``fedpate data phantoms --shift``), docs/GENERALISATION.md.

Kept apart from :mod:`task.data.phantoms` (numpy, scipy) because the CLI builds every subcommand's help at
start-up, and ``fedpate privacy ...`` should not pay for the generator's imports.

A shift's name is one :class:`Shift` (``none`` is the training distribution, ``all`` moves every factor) or
factors joined by ``+`` (``scanner+lesions``, as another centre differs in scanners and in its patients' lesions);
:func:`shift_parts` parses it once into the factors it moves. The name itself is what dataset.json, cache folder
names and presets record.
"""

from __future__ import annotations

from enum import StrEnum

from task.data.errors import DataError


class Shift(StrEnum):
    """A held-out regime: no shift, one factor moved outside the training distribution, or all of them."""
    NONE = "none"
    SCANNER = "scanner"
    CONTRAST = "contrast"
    LESIONS = "lesions"
    SKULL = "skull"
    ALL = "all"


#: the factors a shift can move, each on its own
SHIFT_PARTS = (Shift.SCANNER, Shift.CONTRAST, Shift.LESIONS, Shift.SKULL)
SHIFTS = tuple(Shift)
SHIFT_HELP = {
    Shift.NONE: "the training distribution",
    Shift.SCANNER: "bias field, noise, blur and gamma beyond every training site's range",
    Shift.CONTRAST: "tissue intensities jittered 3x more per case and channel (orders may flip)",
    Shift.LESIONS: "a smaller primary tumour plus 1-2 satellite lesions (multifocal)",
    Shift.SKULL: "imperfect skull stripping: a patchy rim of dura/fat/bone left around the brain",
    Shift.ALL: "every shift at once",
}
#: joins the factors of a combined shift's name
COMBINE = "+"


def shift_parts(shift: str) -> frozenset[Shift]:
    """The factors a ``shift`` name moves (``"all"`` moves every one; ``"scanner+lesions"`` names several, as
    another centre differs in scanners and in its patients' lesions); raises DataError for unknown names."""
    if COMBINE in shift:
        parts = shift.split(COMBINE)
        if any(p not in SHIFT_PARTS for p in parts) or len(set(parts)) != len(parts):
            raise DataError(f"--shift={shift}: expected distinct factors joined by '+' from "
                            f"{', '.join(SHIFT_PARTS)}")
        return frozenset(Shift(p) for p in parts)
    if shift not in SHIFTS:
        raise DataError(f"--shift={shift}: expected one of {', '.join(SHIFTS)} (or factors joined by '+')")
    whole = Shift(shift)
    if whole is Shift.ALL:
        return frozenset(SHIFT_PARTS)
    return frozenset() if whole is Shift.NONE else frozenset({whole})
