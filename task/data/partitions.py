"""Who holds which patient: hospitals, their teacher partitions, and the server's public sets.

Order of drawing (deterministic per seed): the test set, then the public query set (the student's
unlabelled inputs), the public reference set (labels for fitting the PCA basis / autoencoder) and the
public validation set are drawn first, each stratified over institutions; the remaining cases are private
and go to hospitals by ``scheme``; each hospital's cases are then split into ``teachers_per_hospital``
disjoint, non-empty teacher partitions (a patient influences exactly one teacher; docs/PRIVACY.md).

Everything is drawn in patients (:func:`task.data.msd.patient_id`), not scans: all scans of a patient go to
one party -- one public set, the test set, or one teacher of one hospital -- and the sizes (``n_query``,
``n_test``, ..., hospital shares, the one-per-teacher minimum) count patients, so a set holds at least that
many scans. A patient's institution is that of its first scan (sorted case ids). Patients are ordered by
their first case id, so data with one scan per patient is split exactly as before patients were grouped.

Two sources (``public_pool``): when the public labelled data come from another centre than the
hospitals' population, the reference and validation sets are drawn from those cases only (stratified over
their institutions), and the test set, the query set and the hospitals from the population only; pool cases
not drawn stay unused (never private, never test). Without a pool all sets come from one population.

Schemes:
* ``institution`` -- natural: institution j goes to hospital j mod H (when there are fewer institutions
  than hospitals, each institution's cases are shared evenly among the hospitals mapped to it, h mod M).
* ``iid`` -- shuffled and dealt evenly.
* ``dirichlet`` -- size-skewed: hospital shares ~ Dirichlet(alpha), every hospital keeps at least one case
  per teacher.
* ``paper`` -- Fay et al. Sec. 5: private cases spread evenly over all K = H x T teachers; with
  ``n_reference == 0`` the public reference set *is* the query set's labels (the paper trained its
  autoencoder on the student partition's labels); the split records ``reference_is_query = True``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from task.data.msd import patient_id
from task.errors import UserError
from task.io import atomic_write_json
from task.options import SplitScheme, look_up_option

SCHEMES = tuple(SplitScheme)
UNKNOWN_INSTITUTION = "unknown"
#: source name (PreparedDataset.source_of) of the public labelled collection in a two-source world (task.world)
PUBLIC_SOURCE = "other-centre"


@dataclass
class Split:
    """Case ids per party. ``hospitals[h][t]`` is teacher t's partition at hospital h."""

    hospitals: dict[str, list[list[str]]]
    public_query: list[str]
    public_reference: list[str]
    public_validation: list[str]
    test: list[str]
    reference_is_query: bool = False
    scheme: str = ""
    seed: int = 0
    params: dict = field(default_factory=dict)
    patients: dict = field(default_factory=dict)   # case -> patient, only where they differ (see :meth:`patient`)

    def patient(self, case_id: str) -> str:
        """The patient of ``case_id``: a case not in :attr:`patients` is its own patient (one scan, one patient)."""
        return self.patients.get(case_id, case_id)

    def patients_of(self, case_ids: Sequence[str]) -> set[str]:
        return {self.patient(cid) for cid in case_ids}

    def party_cases(self) -> dict[str, list[str]]:
        """Case ids per party: every hospital by name, then the public sets and the test set."""
        parties = {h: self.hospital_cases(h) for h in sorted(self.hospitals)}
        parties.update(public_query=list(self.public_query), public_reference=list(self.public_reference),
                       public_validation=list(self.public_validation), test=list(self.test))
        return parties

    def party_patients(self) -> dict[str, set[str]]:
        """The patients each party holds (keys as :meth:`party_cases`): what privacy and leakage checks compare."""
        return {party: self.patients_of(ids) for party, ids in self.party_cases().items()}

    def teacher_ids(self) -> list[tuple[str, int]]:
        return [(h, t) for h in sorted(self.hospitals) for t in range(len(self.hospitals[h]))]

    def hospital_cases(self, hospital: str) -> list[str]:
        return [cid for part in self.hospitals[hospital] for cid in part]

    def private_cases(self) -> list[str]:
        return [cid for h in sorted(self.hospitals) for cid in self.hospital_cases(h)]

    @property
    def teachers(self) -> int:
        return sum(len(parts) for parts in self.hospitals.values())

    def to_dict(self) -> dict:
        return {"format": 1, "scheme": self.scheme, "seed": self.seed, "params": dict(self.params),
                "reference_is_query": bool(self.reference_is_query),
                "hospitals": {h: [list(p) for p in parts] for h, parts in self.hospitals.items()},
                "public_query": list(self.public_query), "public_reference": list(self.public_reference),
                "public_validation": list(self.public_validation), "test": list(self.test),
                "patients": dict(sorted(self.patients.items()))}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Split":
        return cls(hospitals={str(h): [list(map(str, p)) for p in parts] for h, parts in d["hospitals"].items()},
                   public_query=list(d["public_query"]), public_reference=list(d["public_reference"]),
                   public_validation=list(d["public_validation"]), test=list(d["test"]),
                   reference_is_query=bool(d.get("reference_is_query", False)), scheme=str(d.get("scheme", "")),
                   seed=int(d.get("seed", 0)), params=dict(d.get("params") or {}),
                   patients={str(c): str(p) for c, p in (d.get("patients") or {}).items()})

    def to_json(self, path: str | os.PathLike) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Split":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise UserError(f"{path}: missing split manifest; expected the JSON written by Split.to_json") from None
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise UserError(f"{path}: invalid split manifest ({type(exc).__name__}: {exc}); "
                            "expected the JSON written by Split.to_json") from None


def hospital_name(index: int, count: int) -> str:
    """Zero-padded so that sorting names gives hospital order (nodes pick ``sorted(hospitals)[id]``)."""
    return f"hospital-{index:0{max(2, len(str(count - 1)))}d}"


PatientsArg = Mapping[str, str] | Callable[[str], str] | None


def _patient_map(case_ids: Sequence[str], patients: PatientsArg) -> dict[str, str]:
    """case -> patient from a mapping or a function (a PreparedDataset's ``patient``); cases a mapping does not
    name, and every case when ``patients`` is None, get :func:`task.data.msd.patient_id` of their id."""

    get = patients if callable(patients) else (patients or {}).get
    out = {}
    for cid in case_ids:
        value = get(cid)
        value = patient_id(cid) if value is None else str(value)
        if not value.strip():
            raise UserError(f"patients: case {cid!r} has an empty patient id; expected a non-empty id per patient")
        out[cid] = value
    return out


def _group_by_patient(patient_of: Mapping[str, str]) -> list[tuple[str, ...]]:
    """Each patient's case ids (sorted), patients ordered by their first case id.

    Ordering by the first case id rather than the patient id means that with one scan per patient every group
    is ``(case_id,)`` in sorted case order: the same items, in the same order, that the splits drew from
    before patients were grouped, so the same seed gives the same split.
    """
    groups: dict[str, list[str]] = {}
    for cid in sorted(patient_of):
        groups.setdefault(patient_of[cid], []).append(cid)
    return sorted(tuple(ids) for ids in groups.values())


def _cases(groups) -> list[str]:
    """Sorted case ids of patient groups."""
    return sorted(cid for group in groups for cid in group)


def split_into_teachers(case_ids: Sequence[str], teachers: int, seed: int = 0,
                        patients: PatientsArg = None) -> list[list[str]]:
    """Shuffle the patients of ``case_ids`` and cut them into ``teachers`` disjoint non-empty partitions of
    near-equal size in patients; all scans of a patient go to one teacher, so a patient influences exactly one
    teacher. ``patients``: case -> patient (a mapping, or a function such as
    ``PreparedDataset.patient``); default :func:`task.data.msd.patient_id` of each case id."""
    teachers = int(teachers)
    if teachers < 1:
        raise UserError(f"--teachers-per-hospital={teachers}: expected at least 1")
    groups = _group_by_patient(_patient_map(case_ids, patients))
    if len(groups) < teachers:
        raise UserError(f"--teachers-per-hospital={teachers}: only {len(groups)} private patient(s) "
                        f"({len(set(case_ids))} scans) to split; expected at least one patient per teacher")
    order = np.random.default_rng([int(seed), 104_729]).permutation(len(groups))
    return [[cid for i in chunk for cid in groups[i]] for chunk in np.array_split(order, teachers)]


def _cases_institutions_patients(prepared, patients: PatientsArg) -> tuple[dict[str, str], dict[str, str]]:
    """(case -> institution, case -> patient) of a PreparedDataset, a {case: institution} map or a list of ids."""
    if isinstance(prepared, Mapping):
        institution_of = {str(c): str(i) if i is not None else UNKNOWN_INSTITUTION for c, i in prepared.items()}
    elif hasattr(prepared, "case_ids"):
        get = getattr(prepared, "institution", lambda c: None)
        institution_of = {c: (get(c) or UNKNOWN_INSTITUTION) for c in prepared.case_ids}
        if patients is None:
            patients = getattr(prepared, "patient", None)
    else:
        institution_of = {str(c): UNKNOWN_INSTITUTION for c in prepared}
    return institution_of, _patient_map(list(institution_of), patients)


def _stratified_draw(rng: np.random.Generator, pool: dict[str, list], n: int) -> list:
    """Draw ``n`` patients from ``pool`` (institution -> patient groups, modified in place) proportionally per
    institution; returns the drawn groups, sorted."""
    if n <= 0:
        return []
    sizes = {k: len(v) for k, v in pool.items() if v}
    total = sum(sizes.values())
    keys = sorted(sizes)
    exact = np.array([n * sizes[k] / total for k in keys])
    take = np.floor(exact).astype(int)
    remainder = n - take.sum()
    # largest remainders first; ties broken randomly so no institution is always favoured
    order = sorted(range(len(keys)), key=lambda i: (-(exact[i] - take[i]), rng.random()))
    for i in order[:remainder]:
        take[i] += 1
    chosen = []
    for k, m in zip(keys, take):
        ids = pool[k]
        picks = set(rng.choice(len(ids), size=int(m), replace=False).tolist()) if m else set()
        chosen += [ids[i] for i in sorted(picks)]
        pool[k] = [ids[i] for i in range(len(ids)) if i not in picks]
    return sorted(chosen)


@dataclass(frozen=True)
class SplitPlan:
    """How many patients each party gets and how private patients go to hospitals; validated when built
    (one-line UserError naming the option). Sizes count patients (module docstring).

    Args:
        hospitals: the number of hospitals H (at least 1).
        teachers_per_hospital: disjoint, non-empty teacher partitions per hospital T (at least 1; every
            hospital needs at least one patient per teacher).
        scheme: how private patients go to hospitals: ``institution``, ``iid``, ``dirichlet`` or ``paper``
            (:class:`task.options.SplitScheme`, module docstring).
        n_query / n_reference / n_validation / n_test: patients in the public query, public reference, public
            validation and test sets (0 or more; with the ``paper`` scheme ``n_reference == 0`` makes the
            reference set the query set).
        seed: the draws (sets, hospital assignment, teacher partitions).
        alpha: the Dirichlet concentration of the ``dirichlet`` scheme's hospital shares (> 0).
        public_pool: the case ids of the public labelled source (another centre): the reference and validation
            sets come from these only, everything else from the other cases (None or empty = one population).
    """

    hospitals: int
    teachers_per_hospital: int
    scheme: SplitScheme
    n_query: int = 0
    n_reference: int = 0
    n_validation: int = 0
    n_test: int = 0
    seed: int = 0
    alpha: float = 0.5
    public_pool: Sequence[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", look_up_option(self.scheme, SplitScheme, "--split"))
        if self.hospitals < 1:
            raise UserError(f"--hospitals={self.hospitals}: expected at least 1")
        if self.teachers_per_hospital < 1:
            raise UserError(f"--teachers-per-hospital={self.teachers_per_hospital}: expected at least 1")
        for name in ("n_query", "n_reference", "n_validation", "n_test"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)}: expected 0 or more")
        if self.scheme is SplitScheme.DIRICHLET and not self.alpha > 0:
            raise UserError(f"--alpha={self.alpha}: expected a positive Dirichlet concentration")
        object.__setattr__(self, "public_pool", tuple(map(str, self.public_pool or ())))

    def params(self) -> dict:
        """The sizes a split records (``Split.params``)."""
        return {"hospitals": self.hospitals, "teachers_per_hospital": self.teachers_per_hospital,
                "n_query": self.n_query, "n_reference": self.n_reference, "n_validation": self.n_validation,
                "n_test": self.n_test, "alpha": self.alpha}


Groups = list[tuple[str, ...]]


def make_split(prepared, plan: SplitPlan, patients: PatientsArg = None) -> Split:
    """Partition the patients of ``prepared`` (a PreparedDataset, a {case: institution} map or a list of ids)
    as ``plan`` says: the test and public sets first, then the hospitals, then each hospital's teachers.

    Sizes count patients and every patient's scans stay together (module docstring).

    Args:
        prepared: the cases to split: a PreparedDataset, a {case: institution} map or a list of case ids.
        plan: the parties' sizes, the scheme and the seed (:class:`SplitPlan`).
        patients: case -> patient, overriding the dataset's own (default: ``prepared.patient``, else
            :func:`task.data.msd.patient_id`).
    """
    institution_of, patient_of = _cases_institutions_patients(prepared, patients)
    groups, public_groups = _separate_public_source(_group_by_patient(patient_of), patient_of, plan)
    _check_enough_patients(plan, len(groups), len(public_groups), len(patient_of))
    rng = np.random.default_rng([int(plan.seed), 15_485_863])
    pool = _by_institution(groups, institution_of)
    labelled = _by_institution(public_groups, institution_of) if plan.public_pool else pool
    test = _stratified_draw(rng, pool, plan.n_test)
    query = _stratified_draw(rng, pool, plan.n_query)
    reference = _stratified_draw(rng, labelled, plan.n_reference)
    validation = _stratified_draw(rng, labelled, plan.n_validation)
    reference_is_query = plan.scheme is SplitScheme.PAPER and plan.n_reference == 0
    if reference_is_query:
        reference = list(query)
    private = {k: sorted(v) for k, v in pool.items() if v}
    split_hospitals = _ASSIGN_HOSPITALS[plan.scheme](rng, private, plan, patient_of)
    split = Split(split_hospitals, _cases(query), _cases(reference), _cases(validation), _cases(test),
                  reference_is_query, str(plan.scheme), int(plan.seed),
                  {**plan.params(), **({"public_pool": len(public_groups)} if plan.public_pool else {})},
                  patients={c: p for c, p in patient_of.items() if p != c})
    check_patients_disjoint(split)
    return split


def _separate_public_source(groups: Groups, patient_of: Mapping[str, str], plan: SplitPlan) -> tuple[Groups, Groups]:
    """(the population's patient groups, the public source's): a patient's scans must all be in one source."""
    external = set(plan.public_pool)
    if external - set(patient_of):
        raise UserError(f"public_pool: {len(external - set(patient_of))} case(s) not in the dataset, e.g. "
                        f"{sorted(external - set(patient_of))[0]!r}; expected case ids of the dataset")
    public_groups = [g for g in groups if g[0] in external]
    if any(set(g) - external for g in public_groups) or any(set(g) & external for g in groups
                                                              if g[0] not in external):
        raise UserError("public_pool: a patient has scans inside and outside the public source; expected each "
                        "patient's scans in one source")
    return [g for g in groups if g[0] not in external], public_groups


def _check_enough_patients(plan: SplitPlan, total: int, public_source: int, scans: int) -> None:
    """Refuse a plan that needs more patients than the population (``total``) or the public source holds."""
    external = bool(plan.public_pool)
    labelled_public = plan.n_reference + plan.n_validation
    if external and labelled_public > public_source:
        raise UserError(f"n_reference + n_validation = {labelled_public} public labelled patients need that many "
                        f"in the public source; it has {public_source}")
    public = plan.n_query + plan.n_test + (0 if external else labelled_public)
    needed = public + plan.hospitals * plan.teachers_per_hospital
    if needed > total:
        what = "n_query + n_test" if external else "n_query + n_reference + n_validation + n_test"
        raise UserError(f"--hospitals={plan.hospitals} x --teachers-per-hospital={plan.teachers_per_hospital} (one "
                        f"patient per teacher) plus {what} = {public} public patients need {needed} patients; the "
                        f"{'population' if external else 'dataset'} has {total} ({scans} scans)")


def _by_institution(groups: Groups, institution_of: Mapping[str, str]) -> dict[str, Groups]:
    """Patient groups per institution (of each patient's first scan), in the groups' order."""
    pool: dict[str, Groups] = {}
    for group in groups:
        pool.setdefault(institution_of[group[0]], []).append(group)
    return pool


def _hospital_names(plan: SplitPlan) -> list[str]:
    return [hospital_name(h, plan.hospitals) for h in range(plan.hospitals)]


def _all_private(private: dict[str, Groups]) -> Groups:
    return sorted(group for held in private.values() for group in held)


def _assign_by_institution(rng, private: dict[str, Groups], plan: SplitPlan, patient_of) -> dict[str, list[list[str]]]:
    """``institution``: institution j goes to hospital j mod H; with fewer institutions than hospitals each
    institution's patients are shared evenly among the hospitals mapped to it."""
    names, hospitals = _hospital_names(plan), plan.hospitals
    holdings: dict[str, Groups] = {name: [] for name in names}
    institutions = sorted(private)
    if UNKNOWN_INSTITUTION in institutions and len(institutions) == 1 and hospitals > 1:
        raise UserError("--split=institution: the dataset does not say which institution each case comes from "
                        "(no 'institution' in dataset.json); expected --split iid or dirichlet")
    if len(institutions) >= hospitals:
        for j, inst in enumerate(institutions):
            holdings[names[j % hospitals]] += private[inst]
    else:
        for j, inst in enumerate(institutions):
            sharing = [names[h] for h in range(hospitals) if h % len(institutions) == j]
            order = rng.permutation(len(private[inst]))
            for name, chunk in zip(sharing, np.array_split(order, len(sharing))):
                holdings[name] += [private[inst][i] for i in chunk]
    return _teachers_of(holdings, plan, patient_of)


def _assign_iid(rng, private: dict[str, Groups], plan: SplitPlan, patient_of) -> dict[str, list[list[str]]]:
    """``iid``: shuffled and dealt evenly."""
    all_private = _all_private(private)
    order = rng.permutation(len(all_private))
    holdings = {name: [all_private[i] for i in chunk]
                for name, chunk in zip(_hospital_names(plan), np.array_split(order, plan.hospitals))}
    return _teachers_of(holdings, plan, patient_of)


def _assign_dirichlet(rng, private: dict[str, Groups], plan: SplitPlan, patient_of) -> dict[str, list[list[str]]]:
    """``dirichlet``: hospital shares ~ Dirichlet(alpha) on top of one patient per teacher at every hospital."""
    all_private = _all_private(private)
    order = [all_private[i] for i in rng.permutation(len(all_private))]
    minimum = plan.teachers_per_hospital
    shares = rng.dirichlet(np.full(plan.hospitals, float(plan.alpha)))
    extra = len(order) - minimum * plan.hospitals
    counts = np.full(plan.hospitals, minimum) + _apportion(extra, shares)
    holdings, start = {}, 0
    for name, count in zip(_hospital_names(plan), counts):
        holdings[name] = order[start:start + int(count)]
        start += int(count)
    return _teachers_of(holdings, plan, patient_of)


def _assign_paper(rng, private: dict[str, Groups], plan: SplitPlan, patient_of) -> dict[str, list[list[str]]]:
    """``paper`` (Fay et al. Sec. 5): even over all K = H x T teachers, hospital h holds teachers [h*T, (h+1)*T)."""
    all_private = _all_private(private)
    teachers = plan.teachers_per_hospital
    order = [all_private[i] for i in rng.permutation(len(all_private))]
    chunks = np.array_split(np.arange(len(order)), plan.hospitals * teachers)
    split_hospitals = {}
    for h, name in enumerate(_hospital_names(plan)):
        parts = chunks[h * teachers:(h + 1) * teachers]
        split_hospitals[name] = [_cases(order[i] for i in part) for part in parts]
    for name, parts in split_hospitals.items():
        if any(not p for p in parts):
            raise UserError(f"--teachers-per-hospital={teachers}: {name} would get an empty "
                            "teacher partition; expected at least one private patient per teacher")
    return split_hospitals


def _teachers_of(holdings: dict[str, Groups], plan: SplitPlan, patient_of) -> dict[str, list[list[str]]]:
    """Each hospital's patients cut into its teacher partitions (:func:`split_into_teachers`)."""
    split_hospitals = {}
    for h, name in enumerate(_hospital_names(plan)):
        held = holdings[name]
        if len(held) < plan.teachers_per_hospital:
            raise UserError(f"--teachers-per-hospital={plan.teachers_per_hospital}: {name} has only {len(held)} "
                            f"private patient(s) under --split={plan.scheme}; expected at least one per teacher")
        parts = split_into_teachers(_cases(held), plan.teachers_per_hospital, seed=plan.seed * 1000 + h,
                                    patients=patient_of)
        split_hospitals[name] = [sorted(part) for part in parts]
    return split_hospitals


#: how each scheme deals the private patients to hospitals and their teachers (module docstring)
_ASSIGN_HOSPITALS = {SplitScheme.INSTITUTION: _assign_by_institution, SplitScheme.IID: _assign_iid,
                     SplitScheme.DIRICHLET: _assign_dirichlet, SplitScheme.PAPER: _assign_paper}


def check_patients_disjoint(split: Split) -> None:
    """Raise a one-line UserError when a patient is held by two parties that must not share one.

    Why: the unit of privacy is a patient (docs/PRIVACY.md). A patient at two teachers (of one or two hospitals)
    influences two teachers and breaks the 2/K sensitivity; a hospital's patient in a public set or in the
    test set would be private and public at once (and inflate test Dice); a test patient in a public set
    would score the public model on data it learnt from. Public sets may share patients with each other
    (``reference_is_query`` makes the reference set the query set).
    """
    holder: dict[str, str] = {}
    for hospital in sorted(split.hospitals):
        for t, part in enumerate(split.hospitals[hospital]):
            for patient in sorted(split.patients_of(part)):
                if patient in holder:
                    raise UserError(f"split: patient {patient!r} is held by {holder[patient]} and {hospital} "
                                    f"teacher {t}; expected every patient at exactly one teacher")
                holder[patient] = f"{hospital} teacher {t}"
    test = split.patients_of(split.test)
    # (party, whether it must be apart from the test set)
    for party, ids, apart_from_test in (("test", split.test, False), ("public_query", split.public_query, True),
                                        ("public_reference", split.public_reference, True),
                                        ("public_validation", split.public_validation, True)):
        for patient in sorted(split.patients_of(ids)):
            if patient in holder:
                raise UserError(f"split: patient {patient!r} is in {party} and at {holder[patient]}; expected "
                                "public and test sets disjoint from every hospital's patients")
            if apart_from_test and patient in test:
                raise UserError(f"split: patient {patient!r} is in {party} and in test; expected the test set "
                                "disjoint from the public sets")


def _apportion(n: int, shares: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``n`` proportional to ``shares`` (largest remainders)."""
    exact = n * shares / shares.sum()
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts))[: n - counts.sum()]:
        counts[i] += 1
    return counts


def split_for_preset(prepared, preset, seed: int = 0, **overrides) -> Split:
    """The preset's split (``overrides`` replace any :class:`SplitPlan` field, or ``patients``); the public
    labelled sets come from the dataset's :data:`PUBLIC_SOURCE` cases when it has any (a two-source world,
    task.world.build_world)."""
    pool = prepared.cases_from(PUBLIC_SOURCE) if hasattr(prepared, "cases_from") else []
    args = dict(hospitals=preset.hospitals, teachers_per_hospital=preset.teachers_per_hospital,
                scheme=preset.world.split_scheme, n_query=preset.federation.n_query,
                n_reference=preset.world.n_reference, n_validation=preset.world.n_validation,
                n_test=preset.world.n_test, seed=seed, public_pool=pool or None)
    args.update({k: v for k, v in overrides.items() if v is not None})
    patients = args.pop("patients", None)
    return make_split(prepared, SplitPlan(**args), patients=patients)
