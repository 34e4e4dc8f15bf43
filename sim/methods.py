"""The methods fedpate runs, named once (SPEC section 10: ``results.json``'s ``method``).

Segmentation: the PATE variants and DP-FedAvg are federated (hospitals are Flower ClientApps); the
centralised baselines train on the pooled private data; ``public-only`` is the student trained on public
data alone, the baseline PATE must beat (SPEC section 11), and ``public-selftrain`` the public model adapted
to the public unlabelled query scans by pseudo-labelling (issue 28: a floor that uses all public data).
Each method's role in a comparison is data (:data:`METHOD_ROLES`), so reports and runners ask for a role,
never for a name. The classification seed systems have their own
list, :data:`CLASSIFICATION_METHODS` (``fedpate compare --task``). Pure Python, so the command line imports
it for its help without paying for torch.
"""

from __future__ import annotations

PATE_METHODS = ("pate-ae", "pate-pca", "pate-anchored", "pate-naive")
FEDERATED_METHODS = PATE_METHODS + ("dp-fedavg",)
#: ``fedpate central --method`` name -> the method it writes
CENTRAL_METHODS = {"nonprivate": "nonprivate-central", "dp-sgd": "dp-sgd-central"}
#: public floors: no hospital involved, nothing charged. The first is the floor headroom is measured from
#: (the report also states headroom against every other floor, issue 28)
FLOOR_METHODS = ("public-only", "public-selftrain")
#: the non-private pooled model: the simulation's yardstick, never a release
CEILING_METHODS = ("nonprivate-central",)
SEGMENTATION_METHODS = FEDERATED_METHODS + ("dp-sgd-central",) + CEILING_METHODS + FLOOR_METHODS
#: the methods whose releases are charged to the hospitals' patients (privacy-accounted)
PRIVATE_METHODS = FEDERATED_METHODS + ("dp-sgd-central",)
#: every segmentation method's role in a comparison: "private" (charged to the hospitals' ledgers),
#: "floor" (public data only: what a private method must beat) or "ceiling" (pooled, no privacy)
METHOD_ROLES = {**{m: "private" for m in PRIVATE_METHODS}, **{m: "ceiling" for m in CEILING_METHODS},
                **{m: "floor" for m in FLOOR_METHODS}}
#: the classification seed systems (sim/classification/)
CLASSIFICATION_METHODS = ("dp-mac", "adlm", "ilm", "pate-gnmax", "dp-sgd", "dp-sgd-scheduled", "nonprivate")
