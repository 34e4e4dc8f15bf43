"""The methods fedpate runs: one record per method, in one registry (``results.json``'s ``method``;
docs/PRIVACY.md, "Results").

Segmentation: the PATE variants and DP-FedAvg are federated (hospitals are Flower ClientApps); the
centralised baselines train on the pooled private data; ``public-only`` is the student trained on public
data alone, the baseline PATE must beat, and ``public-selftrain`` the public model adapted
to the public unlabelled query scans by pseudo-labelling (a floor that uses all public data).

Everything a comparison, a runner or a report needs to know about a method is a field of its :class:`Method`
record -- its family, its role (a private method, a public floor, the non-private ceiling), whether it is
federated, whether it sweeps K, whether it has one cell per ε, which protocol or cell runner runs it -- so
they loop over records and never test a method's name (``register_method`` adds one, as Opus' accountants
are registered: tests/test_registries.py adds a toy method and a toy codec this way). The functions that run a
cell live above this layer and are found by key: ``server.protocols`` (federated protocols) and
``sim.runners.cells`` (everything else). The classification seed systems have their own records,
:class:`ClassificationMethod` (``fedpate compare --task``; their trainers are found by key in
``sim.runners.classification_compare``). Pure Python, so the command line imports it for its
help without paying for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from task.options import Trainable
from task.settings.registry import Registry


class Role(StrEnum):
    """What a method's cells are to a comparison (:class:`Method`'s ``role``)."""
    PRIVATE = "private"   # its releases are charged to the hospitals' ledgers
    FLOOR = "floor"       # public data only: what a private method must beat
    CEILING = "ceiling"   # pooled, no privacy: the simulation's yardstick, never a release


class Family(StrEnum):
    """The built-in methods' families (:class:`Method`'s ``family``; a registered method may name its own)."""
    PATE = "pate"
    DP_FEDAVG = "dp-fedavg"
    DP_FEDAVG_SECURE = "dp-fedavg-secure"
    DP_SGD = "dp-sgd"
    DP_SGD_DECODER = "dp-sgd-decoder"
    NONPRIVATE = "nonprivate"
    PUBLIC_ONLY = "public-only"
    PUBLIC_SELFTRAIN = "public-selftrain"


class Protocol(StrEnum):
    """The built-in federated protocols (:class:`Method`'s ``protocol``; ``server.protocols`` runs each; a
    registered method may name its own)."""
    PATE = "pate"
    DP_FEDAVG = "dp-fedavg"
    DP_FEDAVG_SECURE = "dp-fedavg-secure"


class Runner(StrEnum):
    """The built-in cell runners of the methods that are not federated (:class:`Method`'s ``runner``;
    ``sim.runners.cells`` registers each; a registered method may name its own)."""
    POOLED = "pooled"                        # training on the pooled private patients (sim.runners.central)
    PUBLIC_ONLY = "public-only"
    PUBLIC_SELFTRAIN = "public-selftrain"


ROLES = tuple(Role)


class _Roled:
    """What every method record has: a ``name`` and a ``role`` (:class:`Role`)."""

    def _check_role(self, kind: str) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(f"{kind} {self.name}: role must be one of {', '.join(ROLES)}, "
                             f"got {self.role!r}") from None

    @property
    def private(self) -> bool:
        return self.role is Role.PRIVATE


class _Records(Registry):
    """Method records, each registered under its own ``name``."""

    def add(self, record):
        """Add a record (one per name)."""
        return self.register(record.name, record)

    def where(self, **fields) -> tuple:
        """The registered records whose fields equal ``fields`` (all of them without), in registration order."""
        return tuple(m for m in self.values() if all(getattr(m, k) == v for k, v in fields.items()))

    def names(self, **fields) -> tuple[str, ...]:
        return tuple(m.name for m in self.where(**fields))


@dataclass(frozen=True)
class Method(_Roled):
    """One segmentation method.

    ``family``: methods of one family share a protocol or runner and are compared as one kind in the report
    (its verdicts pick the best cell per family). ``role``: ``private`` (its releases are charged to the
    hospitals' ledgers), ``floor`` (public data only: what a private method must beat; the first registered
    floor is the one headroom is measured from) or ``ceiling`` (pooled, no privacy: the simulation's
    yardstick, never a release). ``federated``: runs across the hospitals through a federated ``protocol``
    (``server.protocols``); otherwise ``runner`` names its cell runner (``sim.runners.cells``).
    ``per_epsilon``: one cell per budget. ``sweeps_k``: one cell per K of a ``--teachers-per-hospital`` sweep
    (its teachers are what K counts). ``starts_from_public``: always starts from the public model (PATE's
    teachers and student), whatever ``--init`` says.
    """

    name: str
    family: str
    role: Role
    federated: bool = False
    protocol: str | None = None
    runner: str | None = None
    per_epsilon: bool = False
    sweeps_k: bool = False
    starts_from_public: bool = False
    #: releases through a secure sum with distributed discrete Gaussian noise: accounted by RDP/zCDP, not PLD, so
    #: a hospital ledger that also holds PLD-accounted releases is read by a split accountant
    #: (``privacy.accountants.SplitDeltaAccountant``) and the comparison plans its lifetime budget for that
    secure_sum: bool = False
    #: a PATE method's codec kind (``task.codecs``): its compressor is that kind's (``task.codecs.make_compressor``)
    codec: str | None = None
    description: str = ""
    #: wall seconds of one cell on the quick preset in a one-thread worker: only a hint for spreading a
    #: comparison's cells over worker processes (``sim.runners.compare.spread_over_workers``), so only the ratios
    #: matter. The demo's methods are from one fresh-clone ``fedpate demo`` with --workers 2 on a 2-core machine
    #: (2026-11-28, after the profiled speed-ups: each method's mean over its epsilon cells, PATE's epsilon-8
    #: cell without the teachers' training); PATE's other codecs take pate-anchored's (same teachers and
    #: student), pate-anchored-secure its earlier ratio to pate-anchored (370 / 330), and dp-fedavg-secure its
    #: earlier value.
    cell_seconds: float = 60.0
    #: a pooled method's trainable set and learning rate when they are not the preset's (None: the preset's
    #: ``dp_sgd`` setting); ``task.learning.networks.TRAINABLE_SETS`` names the sets
    trainable: Trainable | None = None
    learning_rate: float | None = None

    def __post_init__(self) -> None:
        self._check_role("method")
        if (self.trainable is not None or self.learning_rate is not None) and self.runner != Runner.POOLED:
            raise ValueError(f"method {self.name}: only a pooled method fixes its own trainable set or learning rate")
        if self.trainable is not None:
            object.__setattr__(self, "trainable", Trainable(self.trainable))
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"method {self.name}: learning_rate must be > 0, got {self.learning_rate}")
        if self.federated != (self.protocol is not None) or self.federated == (self.runner is not None):
            raise ValueError(f"method {self.name}: a federated method names a protocol, any other a runner")


_METHODS: _Records = _Records("method")
#: add a method record (one per name)
register_method = _METHODS.add
unregister_method = _METHODS.unregister
#: the record of a name; KeyError names the registered methods
method = _METHODS.get
#: the registered records whose fields equal the keywords given (all of them without), in registration order
methods = _METHODS.where
names = _METHODS.names


def role_of(name: str | None) -> Role | None:
    """The role of a method name (None for a name that is not registered, e.g. a classification cell)."""
    return _METHODS.get(name).role if name in _METHODS else None


def family_of(name: str | None) -> str | None:
    return _METHODS.get(name).family if name in _METHODS else None


def is_private(name: str | None) -> bool:
    """Whether ``name`` is a registered private method (its releases are charged)."""
    return role_of(name) is Role.PRIVATE


def is_ceiling(name: str | None) -> bool:
    """Whether ``name`` is a registered non-private ceiling (a yardstick, never a release)."""
    return role_of(name) is Role.CEILING


def is_pate(name: str | None) -> bool:
    """Whether ``name`` is a registered method of the PATE family."""
    return family_of(name) == Family.PATE


for _record in (
        Method("pate-ae", Family.PATE, Role.PRIVATE, federated=True, protocol=Protocol.PATE, per_epsilon=True,
               sweeps_k=True, starts_from_public=True, codec="ae",
               description="autoencoded PATE (Fay et al., Algorithm 2)", cell_seconds=266),
        Method("pate-pca", Family.PATE, Role.PRIVATE, federated=True, protocol=Protocol.PATE, per_epsilon=True,
               sweeps_k=True, starts_from_public=True, codec="pca",
               description="PCA-PATE (Fay et al., Algorithm 1)", cell_seconds=266),
        Method("pate-anchored", Family.PATE, Role.PRIVATE, federated=True, protocol=Protocol.PATE, per_epsilon=True,
               sweeps_k=True, starts_from_public=True, codec="anchored",
               description="PATE with the public-anchored residual codec (docs/PRIVACY.md, \"What limits PATE\")", cell_seconds=266),
        Method("pate-anchored-secure", Family.PATE, Role.PRIVATE, federated=True, protocol=Protocol.PATE,
               per_epsilon=True, sweeps_k=True, starts_from_public=True, secure_sum=True, codec="anchored",
               description="pate-anchored through a secure sum with distributed discrete Gaussian noise (the "
                           "aggregator sees only the noisy sum)", cell_seconds=298),
        Method("pate-naive", Family.PATE, Role.PRIVATE, federated=True, protocol=Protocol.PATE, per_epsilon=True,
               sweeps_k=True, starts_from_public=True, codec="identity",
               description="PATE on per-voxel one-hot votes", cell_seconds=266),
        Method("dp-fedavg", Family.DP_FEDAVG, Role.PRIVATE, federated=True, protocol=Protocol.DP_FEDAVG,
               per_epsilon=True, description="FedAvg of each hospital's local DP-SGD", cell_seconds=186),
        Method("dp-fedavg-secure", Family.DP_FEDAVG_SECURE, Role.PRIVATE, federated=True,
               protocol=Protocol.DP_FEDAVG_SECURE, per_epsilon=True, secure_sum=True,
               description="pooled DP-SGD's voxel head trained by full-batch gradient descent over the hospitals' "
                           "patients, each step a secure sum with distributed discrete Gaussian noise (the "
                           "aggregator sees only the noisy sum)", cell_seconds=370),
        Method("dp-sgd-central", Family.DP_SGD, Role.PRIVATE, runner=Runner.POOLED, per_epsilon=True,
               description="DP-SGD on the pooled private patients", cell_seconds=186),
        # features adapted rather than voxels re-scored: the decoder at the non-private ceiling's learning rate
        # (docs/decisions/dp-sgd-decoder.md)
        Method("dp-sgd-central-decoder", Family.DP_SGD_DECODER, Role.PRIVATE, runner=Runner.POOLED, per_epsilon=True,
               trainable=Trainable.DECODER, learning_rate=2e-3,
               description="DP-SGD on the pooled private patients, training the public model's decoder (every "
                           "up-sampling stage and the output block) instead of a voxel head", cell_seconds=186),
        Method("nonprivate-central", Family.NONPRIVATE, Role.CEILING, runner=Runner.POOLED,
               description="non-private training on the pooled private patients", cell_seconds=118),
        Method("public-only", Family.PUBLIC_ONLY, Role.FLOOR, runner=Runner.PUBLIC_ONLY,
               description="the student trained on the public labelled data alone", cell_seconds=1),
        Method("public-selftrain", Family.PUBLIC_SELFTRAIN, Role.FLOOR, runner=Runner.PUBLIC_SELFTRAIN,
               description="the public model self-trained on the public unlabelled query scans",
               cell_seconds=77),
):
    register_method(_record)

#: the methods a fresh interpreter knows (a comparison's worker processes, ``sim.runners.compare.run_in_workers``):
#: those registered here, on import; one a script registers at run time is known to that process only
BUILTIN_METHODS = frozenset(names())

# Views kept for the command line's help and older callers; computed from the registry at import.
PATE_METHODS = names(family=Family.PATE)
FEDERATED_METHODS = names(federated=True)
#: ``fedpate central --method`` name -> the method it writes
CENTRAL_METHODS = {"nonprivate": "nonprivate-central", "dp-sgd": "dp-sgd-central"}
SEGMENTATION_METHODS = names()


# ------------------------------------------------------------------------ the classification seed systems
@dataclass(frozen=True)
class ClassificationMethod(_Roled):
    """One method of the classification comparison (``fedpate compare --task``, ``task/classification/``).

    ``runner``: the key of the function that trains one cell (``sim.runners.classification_compare``; methods
    sharing a trainer differ by key, e.g. ``adlm`` and ``ilm``). ``role`` as :class:`Method`'s: ``private``
    cells spend a budget (one cell per ε, ``per_epsilon``), the others train without noise in one ε-free cell.
    ``reference``: a row the comparison adds by itself (never one of ``--methods``' defaults): ``always``
    in every report, or whenever one of ``reference_for`` runs. ``report_note``: which note the report writes
    beside its cells. ``pure_epsilon``: its releases are pure ε-DP (Laplace), so the report's δ is 0.
    ``not_private``: the result keys no ε covers (simulation diagnostics; dotted names point into
    ``details``). ``plot_style``: (colour, line style) of an ε-free row's horizontal line in the plot.
    """

    name: str
    runner: str
    role: Role
    per_epsilon: bool = False
    reference: bool = False
    always: bool = False
    reference_for: tuple[str, ...] = ()
    report_note: str = ""
    pure_epsilon: bool = False
    not_private: tuple[str, ...] = ()
    plot_style: tuple[str, str] = ("tab:brown", "-.")
    description: str = ""

    def __post_init__(self) -> None:
        self._check_role("classification method")
        if self.per_epsilon != self.private:
            raise ValueError(f"classification method {self.name}: a private method has one cell per budget, "
                             "any other one ε-free cell")
        if (self.always or self.reference_for) and not self.reference:
            raise ValueError(f"classification method {self.name}: only a reference row is added by the comparison")


#: the classification methods' records: ``.add(record)``, ``.get(name)`` (KeyError names the registered ones),
#: ``.where(**fields)`` and ``.names(**fields)`` (the records, or their names, whose fields equal those given, in
#: registration order), ``.unregister(name)``
CLASSIFICATION: _Records = _Records("classification method")


#: DP-SGD's diagnostic that no ε covers: its empty-batch count is a function of the secret Poisson batches
_EMPTY_BATCHES = ("details.empty_batches",)

for _record in (
        ClassificationMethod("dp-mac", "dp-mac", Role.PRIVATE, per_epsilon=True, report_note="noise-multiplier",
                             description="DP-MAC (Harder, Köhler, Welling & Park 2019, arXiv 1910.06924)"),
        ClassificationMethod("adlm", "adlm", Role.PRIVATE, per_epsilon=True, report_note="laplace", pure_epsilon=True,
                             description="the Adaptive Laplace Mechanism (Phan, Wu, Hu & Dou 2017, "
                                         "arXiv 1709.05750)"),
        ClassificationMethod("ilm", "ilm", Role.PRIVATE, per_epsilon=True, report_note="laplace", pure_epsilon=True,
                             description="AdLM's identical-noise ablation (ILM, their Appendix C)"),
        ClassificationMethod("pate-gnmax", "pate-gnmax", Role.PRIVATE, per_epsilon=True, report_note="gnmax",
                             not_private=("teacher_accuracy_mean", "ensemble_accuracy",
                                          "details.teacher_accuracy_mean", "details.ensemble_accuracy",
                                          "details.records_per_teacher"),
                             description="PATE with GNMax (Papernot et al. 2018, arXiv 1802.08908); its teachers "
                                         "and their noise-free ensemble see the private records directly"),
        ClassificationMethod("dp-sgd", "dp-sgd", Role.PRIVATE, per_epsilon=True, report_note="noise-multiplier",
                             not_private=_EMPTY_BATCHES, description="DP-SGD (Abadi et al. 2016, arXiv 1607.00133)"),
        ClassificationMethod("dp-sgd-scheduled", "dp-sgd-scheduled", Role.PRIVATE, per_epsilon=True,
                             report_note="noise-multiplier", not_private=_EMPTY_BATCHES,
                             description="DP-SGD with an exponentially decaying noise schedule (Yu et al. 2019, "
                                         "arXiv 1904.02200)"),
        ClassificationMethod("nonprivate", "dp-sgd", Role.CEILING, not_private=("accuracy",), plot_style=("k", "--"),
                             description="DP-SGD's network trained without clipping or noise"),
        ClassificationMethod("public-only", "public-only", Role.FLOOR, reference=True, always=True,
                             report_note="public-only", plot_style=("tab:gray", ":"),
                             description="the non-private cell's network trained on the public labelled reference "
                                         "records alone: the floor a private method must beat"),
        ClassificationMethod("adlm-noise-free", "adlm", Role.CEILING, reference=True, reference_for=("adlm", "ilm"),
                             report_note="noise-free", not_private=("accuracy",),
                             description="AdLM's network, polynomial loss and optimiser with the mechanism "
                                         "switched off (NOT private)"),
):
    CLASSIFICATION.add(_record)

#: the classification seed systems ``--methods`` chooses from (``fedpate compare --task``); the comparison adds its
#: reference rows (``CLASSIFICATION.names(reference=True)``) itself
CLASSIFICATION_METHODS = CLASSIFICATION.names(reference=False)
