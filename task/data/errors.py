"""Errors raised by the data layer (reader, generator, preprocessing, partitions).

A :class:`DataError` is a problem with the user's data that the user can fix; ``fedpate`` prints it as one
line (``fedpate data: error: <message>``) and exits with status 2. Messages name the file and what was
expected, e.g. ``imagesTr/BRATS_001.nii.gz: expected a 4D image (x, y, z, 4 modalities), got shape (240, 240, 155)``.
"""

from __future__ import annotations

from task.errors import UserError


class DataError(UserError):
    """A data file or folder is missing, unreadable or inconsistent (one-line message naming the file)."""
