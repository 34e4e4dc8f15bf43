"""BraTS folders as distributed: the one layouts table, detection, the same phantoms in three
layouts giving the same arrays, `data inspect` errors naming case and file, and FeTS partition files."""

from __future__ import annotations

import json
import os
import shutil

import nibabel as nib
import numpy as np
import pytest

from sim.cli import main
from task.data.errors import DataError
from task.errors import UserError

LAYOUTS = ("msd", "brats2021", "brats2023")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same 6 small phantoms written in each layout by `fedpate data phantoms --layout`."""
    root = tmp_path_factory.mktemp("layouts")
    for layout in LAYOUTS:
        assert main(["data", "phantoms", "--cases", "6", "--institutions", "2", "--resolution", "6", "--seed", "3",
                     "--layout", layout, "--out", str(root / layout), "--no-progress"]) == 0
    return root


def _copy(layouts, layout, tmp_path):
    target = tmp_path / layout
    shutil.copytree(layouts / layout, target)
    return target


# ------------------------------------------------------------------------------------------ the table
def test_the_table_maps_each_release_to_our_classes_and_back():
    from task.data.layouts import from_ours, to_ours

    ours = np.array([0, 1, 2, 3])                   # background, oedema, necrotic/non-enhancing core, enhancing
    assert from_ours(ours, "msd").tolist() == [0, 1, 2, 3]
    assert from_ours(ours, "brats2021").tolist() == [0, 2, 1, 4]   # ED 2, NCR/NET 1, ET 4
    assert from_ours(ours, "brats2023").tolist() == [0, 2, 1, 3]   # ED 2, NCR 1, ET 3
    for layout in LAYOUTS:
        assert to_ours(from_ours(ours, layout), layout).tolist() == ours.tolist()


def test_unknown_label_codes_are_one_line_errors_with_a_hint():
    from task.data.layouts import to_ours

    with pytest.raises(DataError, match=r"seg.nii.gz: label values \[4\] unknown to the brats2023 layout.*brats2021"):
        to_ours(np.array([0, 1, 4]), "brats2023", "seg.nii.gz")


def test_layouts_are_detected_and_a_mixed_folder_is_refused(layouts, tmp_path):
    from task.data.layouts import detect_layout

    assert [detect_layout(layouts / name).name for name in LAYOUTS] == list(LAYOUTS)
    mixed = _copy(layouts, "brats2021", tmp_path)
    shutil.copytree(layouts / "brats2023" / "BRATS_001", mixed / "OTHER")
    (mixed / "OTHER").rename(mixed / "BRATS_900")
    for f in (mixed / "BRATS_900").iterdir():
        f.rename(f.with_name(f.name.replace("BRATS_001", "BRATS_900")))
    with pytest.raises(DataError, match="two BraTS namings"):
        detect_layout(mixed)
    with pytest.raises(DataError, match="no dataset.json and no BraTS case folders"):
        detect_layout(_empty(tmp_path))


def _empty(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_brats_timepoints_are_one_patient():
    from task.data.msd import patient_id

    assert patient_id("BraTS-GLI-00000-000") == patient_id("BraTS-GLI-00000-001") == "GLI-00000"
    assert patient_id("BraTS-GLI-00000-000") != patient_id("BraTS-MEN-00000-000")
    assert patient_id("BraTS2021_00000") == "BraTS2021_00000"      # one scan per subject: itself
    assert patient_id("FeTS2022_00000") == "FeTS2022_00000"


# ------------------------------------------------------------------------------- the same phantoms, 3 ways
def test_phantoms_in_every_layout_are_the_same_cases(layouts):
    from task.data.msd import load_case
    from task.data.reader import read_dataset

    datasets = [read_dataset(layouts / name) for name in LAYOUTS]
    assert [d.layout for d in datasets] == list(LAYOUTS)
    assert len({tuple(c.case_id for c in d.training) for d in datasets}) == 1
    assert len({tuple(c.institution for c in d.training) for d in datasets}) == 1   # sites survive the layout
    assert all(len(d.test) == 0 for d in datasets)
    for cases in zip(*(d.training for d in datasets)):
        loaded = [load_case(c) for c in cases]
        for image, label, affine in loaded[1:]:
            assert np.array_equal(image, loaded[0][0]) and np.array_equal(label, loaded[0][1])
            assert np.allclose(affine, loaded[0][2])
    # ...while the files on disk carry each release's own codes: enhancing is 4 in 2021, 3 in 2023
    seg21 = np.asarray(nib.load(layouts / "brats2021" / "BRATS_001" / "BRATS_001_seg.nii.gz").dataobj)
    seg23 = np.asarray(nib.load(layouts / "brats2023" / "BRATS_001" / "BRATS_001-seg.nii.gz").dataobj)
    msd = np.asarray(nib.load(layouts / "msd" / "labelsTr" / "BRATS_001.nii.gz").dataobj)
    assert set(np.unique(seg21)) <= {0, 1, 2, 4} and 4 in seg21
    assert np.array_equal(seg21 == 4, msd == 3) and np.array_equal(seg23 == 2, msd == 1)
    assert np.array_equal(seg23 == 1, msd == 2)


def test_prepared_arrays_are_identical_across_layouts(layouts, tmp_path):
    from task.data.preprocess import PreprocessConfig, prepare_dataset

    prepared = [prepare_dataset(layouts / name, tmp_path / name, PreprocessConfig(grid=(8, 8, 8)), progress=False)
                for name in LAYOUTS]
    for other in prepared[1:]:
        assert other.case_ids == prepared[0].case_ids
        assert np.array_equal(other.images(), prepared[0].images())
        assert np.array_equal(other.labels(), prepared[0].labels())
        assert [other.institution(c) for c in other.case_ids] == [prepared[0].institution(c)
                                                                for c in prepared[0].case_ids]
        assert other.source == prepared[0].source       # phantoms, described alike (model cards)
    # the BraTS cache is keyed on its files: touching one re-prepares instead of reusing stale arrays
    key = prepared[2].manifest["source_fingerprint"]
    copy = _copy(layouts, "brats2023", tmp_path / "touched")         # copytree keeps modification times
    same = prepare_dataset(copy, tmp_path / "copy-prep", PreprocessConfig(grid=(8, 8, 8)), progress=False)
    assert same.manifest["source_fingerprint"] == key
    os.utime(copy / "BRATS_002" / "BRATS_002-seg.nii.gz", ns=(1, 1))
    again = prepare_dataset(copy, tmp_path / "touched-prep", PreprocessConfig(grid=(8, 8, 8)), progress=False)
    assert again.manifest["source_fingerprint"] != key


def test_a_complete_brats_phantom_folder_is_returned_and_other_settings_refused(layouts, tmp_path):
    from task.data.phantoms import PhantomSpec, generate_phantoms

    folder = _copy(layouts, "brats2023", tmp_path)
    spec = PhantomSpec(cases=6, institutions=2, seed=3, resolution_mm=6)
    assert generate_phantoms(folder, spec, progress=False, layout="brats2023") == folder
    with pytest.raises(DataError, match="--test-cases=2: a BraTS training folder holds labelled cases only"):
        generate_phantoms(tmp_path / "new", PhantomSpec(cases=6, institutions=2, seed=3, test_cases=2),
                          layout="brats2021")
    with pytest.raises(DataError, match="other settings"):
        generate_phantoms(folder, PhantomSpec(cases=7, institutions=2, seed=3, resolution_mm=6), progress=False,
                          layout="brats2023")


# ------------------------------------------------------------------------------------------ inspect
def _inspect(folder, capsys, *extra):
    status = main(["data", "inspect", str(folder), *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip()


def test_inspect_summarises_a_brats_folder(layouts, capsys):
    status, out, err = _inspect(layouts / "brats2021", capsys)
    assert status == 0, err
    assert "layout:     brats2021" in out and "4 ET" in out
    assert "6 labelled, 0 without seg" in out and "institutions: site0 (3), site1 (3)" in out
    assert "warning" not in out                                    # phantoms are skull-stripped


def _break(kind, folder):
    case = folder / "BRATS_002"
    if kind == "missing modality":
        (case / "BRATS_002-t1c.nii.gz").unlink()
        return "BRATS_002-t1c.nii.gz", "missing T1-Gd file of case BRATS_002"
    img = nib.load(case / "BRATS_002-t2w.nii.gz")
    data = np.asarray(img.dataobj)
    if kind == "other affine":
        affine = img.affine.copy()
        affine[0, 3] += 5.0
        nib.save(nib.Nifti1Image(data, affine), case / "BRATS_002-t2w.nii.gz")
        return "BRATS_002-t2w.nii.gz", "affine differs from"
    if kind == "other grid":
        nib.save(nib.Nifti1Image(data[:-1], img.affine), case / "BRATS_002-t2w.nii.gz")
        return "BRATS_002-t2w.nii.gz", "expected every modality of BRATS_002 on one grid"
    if kind == "unknown label":
        seg = case / "BRATS_002-seg.nii.gz"
        labels = np.asarray(nib.load(seg).dataobj).copy()
        labels[labels == 3] = 4                                    # a 2021 code in a 2023 folder
        nib.save(nib.Nifti1Image(labels, img.affine), seg)
        return "BRATS_002-seg.nii.gz", "label values [4] unknown to the brats2023 layout"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing modality", "other affine", "other grid", "unknown label"])
def test_inspect_errors_are_one_line_naming_case_and_file(layouts, tmp_path, capsys, kind):
    folder = _copy(layouts, "brats2023", tmp_path)
    name, message = _break(kind, folder)
    status, _, err = _inspect(folder, capsys)
    assert status == 2
    assert len(err.splitlines()) == 1 and name in err and message in err, err


def test_a_case_without_seg_is_refused_where_labels_are_needed(layouts, tmp_path, capsys):
    folder = _copy(layouts, "brats2021", tmp_path)
    (folder / "BRATS_004" / "BRATS_004_seg.nii.gz").unlink()
    status, out, _ = _inspect(folder, capsys)                       # inspect: allowed, counted
    assert status == 0 and "5 labelled, 1 without seg" in out
    assert main(["data", "prepare", str(folder), "--grid", "8", "--out", str(tmp_path / "p"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "BRATS_004_seg.nii.gz: missing label map of case BRATS_004" in err, err


def test_a_volume_that_is_not_skull_stripped_is_a_warning(layouts, tmp_path, capsys):
    folder = _copy(layouts, "brats2023", tmp_path)
    path = folder / "BRATS_003" / "BRATS_003-t1n.nii.gz"
    img = nib.load(path)
    data = np.asarray(img.dataobj).copy()
    data[data == 0] = 7                                             # a scalp-and-air background
    nib.save(nib.Nifti1Image(data, img.affine), path)
    status, out, _ = _inspect(folder, capsys)
    assert status == 0
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "BRATS_003-t1n.nii.gz" in warnings[0] and "skull-stripped" in warnings[0]


# ------------------------------------------------------------------------------------- partition files
def _write_csv(path, rows, header="Partition_ID,Subject_ID"):
    path.write_text(header + "\n" + "".join(f"{p},{s}\n" for p, s in rows))
    return path


@pytest.mark.parametrize("content, message", [
    ("Partition,Subject\n1,BRATS_001\n", "lacks Partition_ID, Subject_ID"),
    ("Partition_ID,Subject_ID\n", "no subjects"),
    ("Partition_ID,Subject_ID\n1,BRATS_001\n2,BRATS_001\n", "is in partitions 1 and 2"),
    ("Partition_ID,Subject_ID\n1,\n", "empty Partition_ID or Subject_ID"),
    ("Partition_ID,Subject_ID\n1,BRATS_999\n", "not in the data folder, e.g. 'BRATS_999'"),
])
def test_bad_partition_files_are_one_line_errors_naming_the_file(tmp_path, content, message):
    from task.data.fets import assign_partitions

    path = tmp_path / "parts.csv"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as caught:
        assign_partitions(path, ["BRATS_001", "BRATS_002"], lambda c: c, None)
    assert "parts.csv" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError, match="file not found"):
        assign_partitions(tmp_path / "nope.csv", ["BRATS_001"], lambda c: c, None)


def test_partitions_become_hospitals_largest_first_and_public_sets_come_from_them(tmp_path):
    """Three partitions (20, 14, 4 patients; timepoints of one patient listed once by patient id): --hospitals 2
    keeps the two largest; test and public patients are held out from each of them, none from the third."""
    from task.data.fets import assign_partitions
    from task.data.msd import patient_id
    from task.data.partitions import SplitPlan, make_split

    cases = [f"BraTS-GLI-{i:05d}-000" for i in range(38)] + ["BraTS-GLI-00000-001"]   # patient 0 twice
    sizes = {"A": range(0, 20), "B": range(20, 34), "C": range(34, 38)}
    rows = [("C" if i in sizes["C"] else "B" if i in sizes["B"] else "A", f"GLI-{i:05d}") for i in range(38)]
    path = _write_csv(tmp_path / "partitioning_1.csv", rows[::-1])          # file order is not size order
    institutions, info = assign_partitions(path, cases, patient_id, 2)
    assert info["hospital_partitions"] == {"partition-A": 20, "partition-B": 14}
    assert info["left_out_partitions"] == 1 and info["left_out_patients"] == 4
    assert institutions["BraTS-GLI-00000-001"] == institutions["BraTS-GLI-00000-000"] == "partition-A"
    split = make_split(institutions, SplitPlan(2, 2, "institution", 4, 2, 2, 4, seed=0), patients=patient_id)
    hospital_sites = {h: {institutions[c] for c in split.hospital_cases(h)} for h in split.hospitals}
    assert sorted(map(tuple, hospital_sites.values())) == [("partition-A",), ("partition-B",)]
    held_out = split.test + split.public_query + split.public_reference + split.public_validation
    assert {institutions[c] for c in held_out} == {"partition-A", "partition-B"}
    assert not any(c in held_out or c in split.private_cases() for c in cases if c not in institutions)
    assert set(split.patients_of(split.test)).isdisjoint(split.patients_of(split.private_cases()))
    everyone = assign_partitions(path, cases, patient_id, None)[1]
    assert len(everyone["hospital_partitions"]) == 3
    with pytest.raises(UserError, match="--hospitals=4: .* has only 3 partition"):
        assign_partitions(path, cases, patient_id, 4)


def test_a_patient_split_over_two_partitions_is_refused(tmp_path):
    from task.data.fets import assign_partitions
    from task.data.msd import patient_id

    path = _write_csv(tmp_path / "p.csv", [("1", "BraTS-GLI-00001-000"), ("2", "BraTS-GLI-00001-001")])
    with pytest.raises(UserError, match="patient 'GLI-00001' has scans in partitions"):
        assign_partitions(path, ["BraTS-GLI-00001-000", "BraTS-GLI-00001-001"], patient_id, None)


def test_the_world_section_states_where_public_and_test_patients_come_from(layouts, tmp_path, monkeypatch):
    """build_world with --partition-file on a BraTS folder: one hospital per partition, and the report's World
    section says the rule; the same world without the file splits by the folder's own institutions."""
    from task.settings.presets import get_preset
    from sim.report import world_section
    from task.world import build_world, describe_world

    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    folder = layouts / "brats2023"
    path = _write_csv(tmp_path / "fets.csv", [("7", f"BRATS_00{i}") for i in (1, 2, 3, 4)] +
                      [("9", f"BRATS_00{i}") for i in (5, 6)])
    preset = get_preset("tiny", hospitals=2, teachers_per_hospital=1)
    preset = preset.with_changes(federation=dict(n_query=1), world=dict(n_reference=1, n_validation=0, n_test=1),
                                 grid=(8, 8, 8))
    prepared, split = build_world(preset, folder, seed=0, progress=False, partition_file=str(path))
    world = describe_world(prepared, split)
    assert world["layout"] == "brats2023"
    assert world["partition_file"]["hospital_partitions"] == {"partition-7": 4, "partition-9": 2}
    assert sorted(i for h in world["hospitals"].values() for i in h["institutions"]) == ["partition-7", "partition-9"]
    text = "\n".join(world_section(world))
    assert "held out from each hospital proportionally" in text and "fets.csv" in text
    assert "partition-7 (4)" in text and "data layout: brats2023" in text
    with pytest.raises(UserError, match="--partition-file: needs --data"):
        build_world(preset, None, partition_file=str(path))


# ------------------------------------------------------------------------------ CLI plumbing
def test_layout_and_partition_options_need_data(capsys):
    assert main(["compare", "--out", "/tmp/never", "--preset", "tiny", "--partition-file", "x.csv"]) == 2
    assert "--partition-file: needs --data" in capsys.readouterr().err


def test_run_settings_carry_layout_and_partition_file_through_flower_config():
    from task.settings.runconfig import RunSettings

    settings = RunSettings(data="/d", layout="brats2021", partition_file="/p.csv")
    again = RunSettings.from_run_config(settings.to_run_config())
    assert (again.layout, again.partition_file) == ("brats2021", "/p.csv")
    assert RunSettings.from_run_config(RunSettings().to_run_config()).layout is None


# ------------------------------------------------------------------------------ end to end (slow)
@pytest.mark.slow
def test_compare_gives_the_same_results_on_the_same_phantoms_in_every_layout(tmp_path, monkeypatch):
    """The same phantoms in every layout: `data phantoms --layout L` + `compare --preset tiny --data X
    --reproducible-noise` give the same Dice (and the same spent epsilon) for msd, brats2023 and brats2021 (2-8 min on
    2 busy cores)."""
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    results = {}
    for layout in ("msd", "brats2023", "brats2021"):
        data = tmp_path / layout
        assert main(["data", "phantoms", "--cases", "48", "--institutions", "2", "--resolution", "4", "--seed", "0",
                     "--layout", layout, "--out", str(data), "--no-progress"]) == 0
        out = tmp_path / f"run-{layout}"
        assert main(["compare", "--preset", "tiny", "--data", str(data), "--reproducible-noise", "--seed", "0",
                     "--methods", "public-only,pate-anchored", "--epsilons", "8", "--out", str(out),
                     "--no-progress"]) == 0
        cells = {cell: json.loads((out / cell / "results.json").read_text())
                 for cell in ("public-only", "pate-anchored/eps-8")}
        results[layout] = {cell: (r["dice"], r["epsilon"]) for cell, r in cells.items()}
        world = json.loads((out / "world.json").read_text())
        assert world["layout"] == layout
    assert results["brats2023"] == results["msd"] and results["brats2021"] == results["msd"]
    assert results["msd"]["pate-anchored/eps-8"][0]["WT"] > 0      # a real segmentation, not an empty one
