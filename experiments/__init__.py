"""Frozen records of measurements behind decisions (see experiments/README.md); run as modules from the
repository root: ``python -m experiments.<name>``."""
