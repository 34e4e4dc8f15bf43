"""The data layer: MSD Task01 reader, phantom generator, preprocessing, partitions, augmentation.

Submodules are imported on demand (``from task.data.preprocess import prepare_dataset``) so that reading a
manifest does not import torch or nilearn.
"""

from task.data.errors import DataError

__all__ = ["DataError"]
