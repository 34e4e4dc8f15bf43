"""Shared test configuration.

Tests run on 2 CPU cores next to other work: keep torch on one thread so test timings are stable and
parallel helpers do not oversubscribe the machine.
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the privacy tests do not need torch
    pass
