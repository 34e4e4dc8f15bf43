"""The simulated world (docs/decisions/world.md): public labelled data from another centre, hospitals and test from the
population the model is for; nobody's patients shared; one seed, one world."""

import json

import numpy as np
import pytest

from task.data.partitions import PUBLIC_SOURCE, SplitPlan, make_split
from task.data.preprocess import combine_prepared
from task.errors import UserError
from task.settings.presets import get_preset
from task.world import PUBLIC_PHANTOM_SEED, PUBLIC_PREFIX, build_world, describe_world


@pytest.fixture(scope="module")
def world_cache(tmp_path_factory, tiny_phantoms):
    """A cache holding the session's tiny population (linked, not regenerated); the other centre is generated."""
    root = tmp_path_factory.mktemp("world-cache")
    (root / "phantoms").mkdir()
    (root / "phantoms" / tiny_phantoms.name).symlink_to(tiny_phantoms)
    with pytest.MonkeyPatch.context() as env:   # module scope: the function-scoped monkeypatch cannot
        env.setenv("FEDPATE_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def tiny_world(world_cache):
    return build_world(get_preset("tiny"), seed=0, progress=False)


def test_public_and_test_sets_hold_no_hospital_patient(tiny_world):
    prepared, split = tiny_world
    private = set()
    for hospital in split.hospitals:
        private |= split.patients_of(split.hospital_cases(hospital))
    assert private
    for name in ("public_reference", "public_validation", "public_query", "test"):
        held = split.patients_of(getattr(split, name))
        assert held and not held & private, name
    assert not split.patients_of(split.test) & split.patients_of(
        split.public_reference + split.public_validation + split.public_query)


def test_ids_of_the_two_phantom_folders_do_not_collide(tiny_world):
    prepared, split = tiny_world
    ids = prepared.case_ids
    assert len(set(ids)) == len(ids)
    # both folders name a case BRATS_001: the other centre's is qualified, and is a different subject
    assert "BRATS_001" in ids and PUBLIC_PREFIX + "BRATS_001" in ids
    assert prepared.patient("BRATS_001") != prepared.patient(PUBLIC_PREFIX + "BRATS_001")
    assert not np.array_equal(prepared.images(["BRATS_001"]), prepared.images([PUBLIC_PREFIX + "BRATS_001"]))


def test_public_labelled_sets_come_from_the_other_centre(tiny_world):
    prepared, split = tiny_world
    preset = get_preset("tiny").world
    labelled = split.public_reference + split.public_validation
    assert len(split.public_reference) == preset.n_reference and len(split.public_validation) == preset.n_validation
    assert {prepared.source_of(c) for c in labelled} == {PUBLIC_SOURCE}
    assert all(c.startswith(PUBLIC_PREFIX) for c in labelled)
    population = split.public_query + split.test + split.private_cases()
    assert PUBLIC_SOURCE not in {prepared.source_of(c) for c in population}
    # the other centre is another distribution: its own generator seed and lesion regime
    other = describe_world(prepared, split)["sources"][PUBLIC_SOURCE]
    assert other["seed"] == PUBLIC_PHANTOM_SEED and other["shift"] == preset.public_shift != "none"
    assert describe_world(prepared, split)["sets"]["public_reference"]["source"] == PUBLIC_SOURCE


def test_world_is_deterministic(tiny_world):
    prepared, split = tiny_world
    again_prepared, again = build_world(get_preset("tiny"), seed=0, progress=False)
    assert again.to_dict() == split.to_dict()
    assert again_prepared.case_ids == prepared.case_ids
    other = build_world(get_preset("tiny"), seed=1, progress=False)[1]
    assert other.to_dict() != split.to_dict()


def test_describe_world_counts_patients_per_hospital(tiny_world, world_cache):
    prepared, split = tiny_world
    # the dataset's source goes into model cards: both collections named, no folder of this machine
    assert [p["name"] for p in prepared.source["parts"]] == ["hospitals-population", PUBLIC_SOURCE]
    assert str(world_cache) not in json.dumps(prepared.source)
    described = json.loads(json.dumps(describe_world(prepared, split)))   # what the report reads
    assert described["two_sources"] is True
    assert {h: v["patients"] for h, v in described["hospitals"].items()} == {
        h: len(split.patients_of(split.hospital_cases(h))) for h in split.hospitals}
    assert described["sets"]["test"]["patients"] == get_preset("tiny").world.n_test


def _two_source_cases(population=40, public=10):
    world = {f"BRATS_{i:03d}": f"site{i % 2}" for i in range(population)}
    world.update({f"{PUBLIC_PREFIX}BRATS_{i:03d}": f"{PUBLIC_PREFIX}site{i % 2}" for i in range(public)})
    return world, [c for c in world if c.startswith(PUBLIC_PREFIX)]


@pytest.mark.parametrize("scheme", ["institution", "iid", "dirichlet"])
def test_make_split_draws_labelled_public_sets_from_the_pool_only(scheme):
    world, pool = _two_source_cases()
    split = make_split(world, SplitPlan(2, 2, scheme, n_query=6, n_reference=6, n_validation=3, n_test=8, seed=3,
                                        public_pool=pool))
    assert set(split.public_reference + split.public_validation) <= set(pool)
    assert not set(split.public_query + split.test + split.private_cases()) & set(pool)
    # the population's cases are all used; the pool's undrawn case stays unused (never private)
    assert len(split.public_query + split.test + split.private_cases()) == 40


def test_make_split_refuses_a_too_small_public_pool():
    world, pool = _two_source_cases(public=5)
    with pytest.raises(UserError, match="public labelled patients"):
        make_split(world, SplitPlan(2, 2, "iid", n_query=6, n_reference=4, n_validation=2, n_test=8, seed=0,
                                    public_pool=pool))
    with pytest.raises(UserError, match="not in the dataset"):
        make_split(world, SplitPlan(2, 2, "iid", n_query=6, n_reference=1, n_validation=0, n_test=8, seed=0,
                                    public_pool=["nobody"]))


def test_combine_prepared_refuses_colliding_ids(tiny_prepared, tmp_path):
    with pytest.raises(Exception, match="distinct id prefix"):
        combine_prepared([("a", "", tiny_prepared), ("b", "", tiny_prepared)], tmp_path / "combined")


def test_report_opens_with_the_world_and_its_headroom(tiny_world, tmp_path):
    from sim.report import WORLD_FILE, write_report

    prepared, split = tiny_world
    (tmp_path / WORLD_FILE).write_text(json.dumps(describe_world(prepared, split)))
    for method, per_case in (("public-only", [0.3, 0.4, 0.5, 0.2]), ("nonprivate-central", [0.7, 0.6, 0.9, 0.6])):
        (tmp_path / method).mkdir()
        (tmp_path / method / "results.json").write_text(json.dumps({
            "method": method, "dice": {"mean": float(np.mean(per_case))}, "dice_per_case": per_case,
            "epsilon": None, "delta": None}))
    text = write_report(tmp_path, "t").read_text()
    world = text.split("## World", 1)[1]
    assert text.index("## World") < text.index("| method")
    assert "other-centre: phantoms, generator seed 1001" in world.replace("**", "")
    assert "shift regime 'lesions'" in world
    assert "public_reference: 8 patients from other-centre" in world
    assert "test: 6 patients from hospitals-population" in world
    for hospital in split.hospitals:
        assert f"{hospital} {len(split.patients_of(split.hospital_cases(hospital)))} (" in world
    assert "headroom: nonprivate-central minus public-only mean Dice +0.350 ± 0.050 (paired over 4" in world


def test_combined_shift_names_move_each_named_factor():
    from task.data.errors import DataError
    from task.data.phantoms import make_case, shift_parts

    assert shift_parts("scanner+lesions") == {"scanner", "lesions"}
    for bad in ("scanner+scanner", "scanner+nothing", "all+lesions"):
        with pytest.raises(DataError, match="--shift"):
            shift_parts(bad)
    base, lesions, both = (make_case(5, 1, 2, 4.0, s) for s in ("none", "lesions", "scanner+lesions"))
    # the lesions moved (a smaller primary plus satellites) and so did the scanner
    assert not np.array_equal(both.label, base.label) and not np.array_equal(lesions.label, base.label)
    assert not np.array_equal(both.image, lesions.image) and both.info["shift"] == "scanner+lesions"
