"""Splits: disjoint, covering, non-empty teachers, stratified public sets, deterministic, JSON round trip;
grouped by patient, and unchanged for one scan per patient."""

from __future__ import annotations

import hashlib
import json

import pytest

from task.data.partitions import (SCHEMES, Split, SplitPlan, check_patients_disjoint, make_split,
                                  split_into_teachers)
from task.errors import UserError


def _world(n=120, institutions=4):
    return {f"BRATS_{i:03d}": f"site{i % institutions}" for i in range(n)}


def _check(split, cases, teachers_per_hospital):
    public = [split.public_query, split.public_reference if not split.reference_is_query else [],
              split.public_validation, split.test]
    everything = split.private_cases() + [c for part in public for c in part]
    assert len(everything) == len(set(everything)), "a case is in two places"
    assert set(everything) == set(cases), "cases lost"
    for parts in split.hospitals.values():
        assert len(parts) == teachers_per_hospital and all(parts)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_schemes_partition_every_case(scheme):
    world = _world()
    split = make_split(world, SplitPlan(hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                                        n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=1))
    _check(split, world, 3)
    assert len(split.public_query) == 10 and len(split.test) == 12 and len(split.public_validation) == 4
    assert split.teachers == 12 and len(split.teacher_ids()) == 12
    again = make_split(world, SplitPlan(hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                                        n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=1))
    assert again.to_dict() == split.to_dict()
    other = make_split(world, SplitPlan(hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                                        n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=2))
    assert other.to_dict() != split.to_dict()


def test_institution_scheme_gives_each_hospital_its_sites_and_public_sets_are_stratified():
    world = _world(120, 4)
    split = make_split(world, SplitPlan(hospitals=2, teachers_per_hospital=2, scheme="institution", n_query=8,
                                        n_reference=8, n_validation=4, n_test=12, seed=0))
    for h, name in enumerate(sorted(split.hospitals)):
        assert {world[c] for c in split.hospital_cases(name)} == {f"site{h}", f"site{h + 2}"}
    assert sorted(world[c] for c in split.test) == sorted([f"site{k}" for k in range(4)] * 3)
    assert sorted(world[c] for c in split.public_query) == sorted([f"site{k}" for k in range(4)] * 2)
    more_hospitals = make_split(world, SplitPlan(hospitals=8, teachers_per_hospital=2, scheme="institution", n_query=0,
                                                 n_reference=0, n_validation=0, n_test=0, seed=0))
    assert all(len({world[c] for c in more_hospitals.hospital_cases(h)}) == 1 for h in more_hospitals.hospitals)


def test_dirichlet_is_size_skewed_but_keeps_a_case_per_teacher():
    world = _world(200, 1)
    split = make_split(world, SplitPlan(hospitals=5, teachers_per_hospital=2, scheme="dirichlet", n_query=0,
                                        n_reference=0, n_validation=0, n_test=0, seed=3, alpha=0.3))
    sizes = sorted(len(split.hospital_cases(h)) for h in split.hospitals)
    assert sizes[0] >= 2 and sizes[-1] > 2 * sizes[0]
    _check(split, world, 2)


def test_paper_split_reference_is_query_and_json_round_trip(tmp_path):
    world = {f"BRATS_{i:03d}": None for i in range(484)}
    split = make_split(world, SplitPlan(hospitals=8, teachers_per_hospital=1, scheme="paper", n_query=80,
                                        n_reference=0, n_validation=0, n_test=84, seed=0))
    assert split.reference_is_query and split.public_reference == split.public_query
    assert sorted(len(split.hospital_cases(h)) for h in split.hospitals) == [40] * 8     # 320 over K = 8
    path = split.to_json(tmp_path / "split.json")
    loaded = Split.from_json(path)
    assert loaded == split and '"reference_is_query": true' in path.read_text()


def test_errors_name_the_parameter():
    world = _world(30, 2)
    with pytest.raises(UserError, match="teachers-per-hospital"):
        make_split(world, SplitPlan(hospitals=2, teachers_per_hospital=20, scheme="iid", n_query=0, n_reference=0,
                                    n_validation=0, n_test=0, seed=0))
    with pytest.raises(UserError, match="n_query"):
        make_split(world, SplitPlan(hospitals=2, teachers_per_hospital=1, scheme="iid", n_query=40, n_reference=0,
                                    n_validation=0, n_test=0, seed=0))
    with pytest.raises(UserError, match="--split"):
        make_split(world, SplitPlan(2, 1, "random", 0, 0, 0, 0, 0))
    with pytest.raises(UserError, match="institution"):
        make_split({f"c{i}": None for i in range(20)}, SplitPlan(2, 1, "institution", 0, 0, 0, 0, 0))
    with pytest.raises(UserError, match="teachers-per-hospital"):
        split_into_teachers(["a", "b"], 3)
    with pytest.raises(UserError, match="split.json"):
        Split.from_json("/nonexistent/split.json")


def test_split_into_teachers_is_disjoint_and_deterministic():
    ids = [f"c{i}" for i in range(11)]
    parts = split_into_teachers(ids, 4, seed=2)
    assert sorted(c for p in parts for c in p) == sorted(ids) and all(parts)
    assert parts == split_into_teachers(list(reversed(ids)), 4, seed=2)


def test_tiny_split_fixture(tiny_prepared, tiny_split):
    _check(tiny_split, tiny_prepared.case_ids, 4)
    assert sorted(tiny_split.hospitals) == ["hospital-00", "hospital-01"]
    for h, name in enumerate(sorted(tiny_split.hospitals)):
        assert {tiny_prepared.institution(c) for c in tiny_split.hospital_cases(name)} == {f"site{h}"}


# ------------------------------------------------------------------------------------------------ patients
def _multi_scan_world(patients=70, institutions=3):
    """BraTS 2019 names: patient p has 1-3 timepoints (``BraTS19_TCIA0k_ppp_t``), so patients group by name."""
    world = {}
    for p in range(patients):
        for t in range(1, 2 + p % 3):
            world[f"BraTS19_TCIA0{p % institutions}_{p:03d}_{t}"] = f"site{p % institutions}"
    return world


def _assert_patients_together(split):
    """Every patient at exactly one party, and at one teacher of its hospital."""
    check_patients_disjoint(split)
    owner = {}
    parties = {f"{h}/{t}": part for h in split.hospitals for t, part in enumerate(split.hospitals[h])}
    parties.update(query=split.public_query, validation=split.public_validation, test=split.test)
    if not split.reference_is_query:
        parties["reference"] = split.public_reference
    for party, ids in parties.items():
        for cid in ids:
            assert owner.setdefault(split.patient(cid), party) == party, f"{cid}'s patient split across parties"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_multi_scan_patients_are_never_split_across_parties_or_teachers(scheme):
    world = _multi_scan_world()
    n_reference = 0 if scheme == "paper" else 6
    split = make_split(world, SplitPlan(hospitals=3, teachers_per_hospital=4, scheme=scheme, n_query=8,
                                        n_reference=n_reference, n_validation=3, n_test=9, seed=5))
    _check(split, world, 4)
    _assert_patients_together(split)
    parties = split.party_patients()
    # sizes count patients, so sets with multi-scan patients hold more scans than patients
    assert [len(parties[k]) for k in ("public_query", "public_validation", "test")] == [8, 3, 9]
    assert len(split.public_query) > 8 or len(split.test) > 9
    assert sum(len(parties[h]) for h in split.hospitals) == 70 - 8 - n_reference - 3 - 9
    assert split.patient("BraTS19_TCIA01_004_2") == "TCIA01_004" and split.patient("nobody") == "nobody"
    # stratification as before, now over patients: 3 sites of 70/3 patients each -> 3 test patients per site
    assert sorted(world[c] for c in split.test if c.endswith("_1")) == ["site0"] * 3 + ["site1"] * 3 + ["site2"] * 3
    assert Split.from_dict(json.loads(json.dumps(split.to_dict()))) == split


def test_explicit_patients_override_and_split_into_teachers_groups():
    ids = [f"scan{i:02d}" for i in range(12)]
    patients = {cid: f"p{i // 3}" for i, cid in enumerate(ids)}          # four patients, three scans each
    for seed in range(5):
        parts = split_into_teachers(ids, 3, seed=seed, patients=patients)
        assert sorted(c for p in parts for c in p) == ids
        assert all(len({patients[c] for c in part}) in (1, 2) and len(part) % 3 == 0 for part in parts)
        assert parts == split_into_teachers(ids, 3, seed=seed, patients=patients.get)   # a function works too
    with pytest.raises(UserError, match="teachers-per-hospital=5.*4 private patient"):
        split_into_teachers(ids, 5, patients=patients)
    with pytest.raises(UserError, match="patients: case 'scan00' has an empty patient id"):
        split_into_teachers(ids, 2, patients={"scan00": " "})
    world = {cid: "site0" for cid in ids}
    split = make_split(world, SplitPlan(2, 1, "iid", n_query=1, n_reference=0, n_validation=0, n_test=1,
                                        seed=0), patients=patients)
    assert len(split.public_query) == 3 and split.patients == patients
    _assert_patients_together(split)
    with pytest.raises(UserError, match="need 5 patients; the dataset has 4 .12 scans."):
        make_split(world, SplitPlan(3, 1, "iid", n_query=1, n_reference=0, n_validation=0, n_test=1,
                                    seed=0), patients=patients)


def _assignment_digest(split) -> str:
    parts = {k: v for k, v in split.to_dict().items()
             if k in ("hospitals", "public_query", "public_reference", "public_validation", "test")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# Splits of the presets' phantom worlds (one scan per patient) recorded before splits grouped patients:
# grouping must not move a single case, so that existing results stay reproducible.
BEFORE_PATIENTS = {
    ("tiny", "institution", 2, 4, 0): "4caf0f3663c6ed56",      # the tiny preset's own split
    ("tiny", "iid", 4, 2, 1): "e5a5d630e14c4341",
    ("tiny", "dirichlet", 3, 1, 2): "a164791148385489",
    ("quick", "institution", 4, 32, 0): "e012de81905f1b18",  # the quick preset's own split
    ("quick", "iid", 8, 2, 3): "4b3eb0a6664e66d0",
    ("paper", "paper", 8, 1, 0): "7992dd50f5b6d0a8",         # the paper preset's own split
}


@pytest.mark.parametrize("key", sorted(BEFORE_PATIENTS))
def test_one_scan_per_patient_splits_are_unchanged(key):
    from task.data.phantoms import _case_name, institution_name
    from task.settings.presets import get_preset

    name, scheme, hospitals, teachers, seed = key
    preset = get_preset(name)
    if name == "quick":   # the sizes these digests were recorded at (quick's public sizes have changed since)
        preset = preset.with_changes(federation=dict(n_query=40),
                                     world=dict(n_reference=40, n_validation=10, n_test=30, phantom_cases=260,
                                                phantom_test_cases=4, institutions=4))
    sets = preset.world
    total = sets.phantom_cases + sets.phantom_test_cases
    world = {_case_name(i, total): institution_name(i % sets.institutions) for i in range(sets.phantom_cases)}
    sizes = dict(n_query=preset.federation.n_query, n_reference=0 if scheme == "paper" else sets.n_reference,
                 n_validation=sets.n_validation, n_test=sets.n_test)
    split = make_split(world, SplitPlan(hospitals, teachers, scheme, seed=seed, **sizes))
    assert _assignment_digest(split) == BEFORE_PATIENTS[key] and split.patients == {}
    # explicit patient ids that differ from the case ids, one scan each: still the same split
    renamed = make_split(world, SplitPlan(hospitals, teachers, scheme, seed=seed,
                                          **sizes), patients={c: f"patient-{c}" for c in world})
    assert _assignment_digest(renamed) == BEFORE_PATIENTS[key]
    assert renamed.party_patients()["test"] == {f"patient-{c}" for c in split.test}


def test_split_into_teachers_unchanged_for_one_scan_per_patient():
    ids = [f"BRATS_{i:03d}" for i in range(1, 49)]
    parts = split_into_teachers(ids, 7, seed=2)
    assert hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16] == "fd31b0775916e88a"   # recorded before


def test_tiny_split_fixture_is_the_recorded_split(tiny_prepared, tiny_split):
    assert all(tiny_prepared.patient(c) == c for c in tiny_prepared.case_ids)
    assert _assignment_digest(tiny_split) == BEFORE_PATIENTS[("tiny", "institution", 2, 4, 0)]
    check_patients_disjoint(tiny_split)


def test_check_patients_disjoint_names_the_patient_and_both_parties():
    base = dict(hospitals={"hospital-00": [["a1"], ["b1"]], "hospital-01": [["c1"]]}, public_query=["q1"],
                public_reference=["r1"], public_validation=[], test=["t1"])
    check_patients_disjoint(Split(**base))
    cases = {
        "hospital-00 teacher 0 and hospital-00 teacher 1": {"a1": "A", "b1": "A"},
        "hospital-00 teacher 1 and hospital-01 teacher 0": {"b1": "B", "c1": "B"},
        "in test and at hospital-01 teacher 0": {"t1": "C", "c1": "C"},
        "in public_query and at hospital-00 teacher 0": {"q1": "A", "a1": "A"},
        "in public_reference and in test": {"r1": "T", "t1": "T"},
    }
    for words, patients in cases.items():
        with pytest.raises(UserError, match=words) as info:
            check_patients_disjoint(Split(**base, patients=patients))
        assert "\n" not in str(info.value) and str(info.value).startswith("split: patient")
    check_patients_disjoint(Split(**base, patients={"q1": "Q", "r1": "Q"}))      # public sets may share
