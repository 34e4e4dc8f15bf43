"""Splits: disjoint, covering, non-empty teachers, stratified public sets, deterministic, JSON round trip."""

from __future__ import annotations

import pytest

from sim.data.partitions import SCHEMES, Split, make_split, split_into_teachers
from sim.errors import UserError


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
    split = make_split(world, hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                       n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=1)
    _check(split, world, 3)
    assert len(split.public_query) == 10 and len(split.test) == 12 and len(split.public_validation) == 4
    assert split.teachers == 12 and len(split.teacher_ids()) == 12
    again = make_split(world, hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                       n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=1)
    assert again.to_dict() == split.to_dict()
    other = make_split(world, hospitals=4, teachers_per_hospital=3, scheme=scheme, n_query=10,
                       n_reference=0 if scheme == "paper" else 8, n_validation=4, n_test=12, seed=2)
    assert other.to_dict() != split.to_dict()


def test_institution_scheme_gives_each_hospital_its_sites_and_public_sets_are_stratified():
    world = _world(120, 4)
    split = make_split(world, hospitals=2, teachers_per_hospital=2, scheme="institution", n_query=8,
                       n_reference=8, n_validation=4, n_test=12, seed=0)
    for h, name in enumerate(sorted(split.hospitals)):
        assert {world[c] for c in split.hospital_cases(name)} == {f"site{h}", f"site{h + 2}"}
    assert sorted(world[c] for c in split.test) == sorted([f"site{k}" for k in range(4)] * 3)
    assert sorted(world[c] for c in split.public_query) == sorted([f"site{k}" for k in range(4)] * 2)
    more_hospitals = make_split(world, hospitals=8, teachers_per_hospital=2, scheme="institution", n_query=0,
                                n_reference=0, n_validation=0, n_test=0, seed=0)
    assert all(len({world[c] for c in more_hospitals.hospital_cases(h)}) == 1 for h in more_hospitals.hospitals)


def test_dirichlet_is_size_skewed_but_keeps_a_case_per_teacher():
    world = _world(200, 1)
    split = make_split(world, hospitals=5, teachers_per_hospital=2, scheme="dirichlet", n_query=0, n_reference=0,
                       n_validation=0, n_test=0, seed=3, alpha=0.3)
    sizes = sorted(len(split.hospital_cases(h)) for h in split.hospitals)
    assert sizes[0] >= 2 and sizes[-1] > 2 * sizes[0]
    _check(split, world, 2)


def test_paper_split_reference_is_query_and_json_round_trip(tmp_path):
    world = {f"BRATS_{i:03d}": None for i in range(484)}
    split = make_split(world, hospitals=8, teachers_per_hospital=1, scheme="paper", n_query=80, n_reference=0,
                       n_validation=0, n_test=84, seed=0)
    assert split.reference_is_query and split.public_reference == split.public_query
    assert sorted(len(split.hospital_cases(h)) for h in split.hospitals) == [40] * 8     # 320 over K = 8
    path = split.to_json(tmp_path / "split.json")
    loaded = Split.from_json(path)
    assert loaded == split and '"reference_is_query": true' in path.read_text()


def test_errors_name_the_parameter():
    world = _world(30, 2)
    with pytest.raises(UserError, match="teachers-per-hospital"):
        make_split(world, hospitals=2, teachers_per_hospital=20, scheme="iid", n_query=0, n_reference=0,
                   n_validation=0, n_test=0, seed=0)
    with pytest.raises(UserError, match="n_query"):
        make_split(world, hospitals=2, teachers_per_hospital=1, scheme="iid", n_query=40, n_reference=0,
                   n_validation=0, n_test=0, seed=0)
    with pytest.raises(UserError, match="--split"):
        make_split(world, 2, 1, "random", 0, 0, 0, 0, 0)
    with pytest.raises(UserError, match="institution"):
        make_split({f"c{i}": None for i in range(20)}, 2, 1, "institution", 0, 0, 0, 0, 0)
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
