"""The methods fedpate runs, named once (SPEC section 10: ``results.json``'s ``method``).

Segmentation: the PATE variants and DP-FedAvg are federated (hospitals are Flower ClientApps); the
centralised baselines train on the pooled private data; ``public-only`` is the student trained on public
data alone, the baseline PATE must beat (SPEC section 11). The classification seed systems have their own
list, :data:`CLASSIFICATION_METHODS` (``fedpate compare --task``). Pure Python, so the command line imports
it for its help without paying for torch.
"""

from __future__ import annotations

PATE_METHODS = ("pate-ae", "pate-pca", "pate-anchored", "pate-naive")
FEDERATED_METHODS = PATE_METHODS + ("dp-fedavg",)
#: ``fedpate central --method`` name -> the method it writes
CENTRAL_METHODS = {"nonprivate": "nonprivate-central", "dp-sgd": "dp-sgd-central"}
SEGMENTATION_METHODS = FEDERATED_METHODS + ("dp-sgd-central", "nonprivate-central", "public-only")
#: the methods whose releases are charged to the hospitals' patients (privacy-accounted)
PRIVATE_METHODS = FEDERATED_METHODS + ("dp-sgd-central",)
#: the classification seed systems (sim/classification/)
CLASSIFICATION_METHODS = ("dp-mac", "adlm", "ilm", "pate-gnmax", "dp-sgd", "dp-sgd-scheduled", "nonprivate")
