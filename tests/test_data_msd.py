"""The MSD Task01 reader: a valid folder loads; every kind of corruption gives a one-line DataError naming the file."""

from __future__ import annotations

import gzip
import json

import nibabel as nib
import numpy as np
import pytest

from task.data.errors import DataError
from task.data.msd import load_case, read_msd, validate_dataset
from task.errors import UserError

SHAPE = (10, 12, 9)
AFFINE = np.diag([2.0, 2.0, 2.0, 1.0])


def _save(path, data, affine=AFFINE):
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))


def _save_singular(path, data):
    """nibabel refuses to build an image from a singular affine; write the sform into the header directly."""
    header = nib.Nifti1Header()
    header.set_data_dtype(data.dtype)
    header.set_sform(np.diag([2.0, 0.0, 2.0, 1.0]), code=1)
    header.set_qform(None, code=0)
    image = nib.Nifti1Image(data, None, header=header)
    path.write_bytes(gzip.compress(image.to_bytes()))


def _image(seed=0):
    rng = np.random.default_rng(seed)
    image = np.zeros(SHAPE + (4,), np.float32)
    image[2:8, 3:9, 2:7] = rng.uniform(50, 100, (6, 6, 5, 4))
    return image


def _label():
    label = np.zeros(SHAPE, np.uint8)
    label[4:6, 5:7, 3:5] = 1
    label[5, 6, 4] = 2
    label[4, 5, 3] = 3
    return label


def make_msd(root, cases=2, names=None, patients=None):
    """A small valid MSD folder; ``names`` replace BRATS_001..., ``patients`` (case -> id) adds 'patient' keys."""
    entries = []
    for i, case in enumerate(names or [f"BRATS_{i:03d}" for i in range(1, cases + 1)], start=1):
        name = f"{case}.nii.gz"
        _save(root / "imagesTr" / name, _image(i))
        _save(root / "labelsTr" / name, _label())
        entries.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        if patients and case in patients:
            entries[-1]["patient"] = patients[case]
    _save(root / "imagesTs" / "BRATS_485.nii.gz", _image(99))
    meta = {"name": "BrainTumour", "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
            "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
            "training": entries, "test": ["./imagesTs/BRATS_485.nii.gz"]}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _meta(root):
    return json.loads((root / "dataset.json").read_text())


def _write_meta(root, meta):
    (root / "dataset.json").write_text(json.dumps(meta))


IMG = "imagesTr/BRATS_001.nii.gz"
LAB = "labelsTr/BRATS_001.nii.gz"


def _edit_meta(change):
    def mutate(root):
        meta = _meta(root)
        change(meta)
        _write_meta(root, meta)
    return mutate


CORRUPTIONS = {
    "missing dataset.json": (lambda r: (r / "dataset.json").unlink(), "dataset.json", "missing"),
    "invalid JSON": (lambda r: (r / "dataset.json").write_text('{"training": [,]}'), "dataset.json", "invalid JSON"),
    "missing keys": (_edit_meta(lambda m: m.pop("labels")), "dataset.json", "'labels'"),
    "wrong modality map": (_edit_meta(lambda m: m.update(modality={"0": "FLAIR"})), "dataset.json", "modality"),
    "empty training list": (_edit_meta(lambda m: m.update(training=[])), "dataset.json", "non-empty"),
    "duplicate case ids": (_edit_meta(lambda m: m["training"].append(dict(m["training"][0]))), "dataset.json",
                           "duplicate"),
    "missing image file": (lambda r: (r / IMG).unlink(), IMG, "missing image"),
    "missing label file": (lambda r: (r / LAB).unlink(), LAB, "missing label"),
    "not gzip": (lambda r: (r / IMG).write_bytes(nib.Nifti1Image(_image(), AFFINE).to_bytes()), IMG, "not a gzip"),
    "truncated gzip": (lambda r: (r / IMG).write_bytes((r / IMG).read_bytes()[:200]), IMG, "gzip"),
    "corrupted gzip stream": (lambda r: (r / IMG).write_bytes((r / IMG).read_bytes()[:20] + b"\x00" * 500), IMG,
                              "gzip"),
    "not NIfTI": (lambda r: (r / IMG).write_bytes(gzip.compress(b"hello, this is not an image" * 40)), IMG,
                  "not a NIfTI"),
    "3D image": (lambda r: _save(r / IMG, _image()[..., 0]), IMG, "4D"),
    "wrong channel count": (lambda r: _save(r / IMG, _image()[..., :3]), IMG, "channels"),
    "image/label shape mismatch": (lambda r: _save(r / LAB, _label()[:-1]), LAB, "shape"),
    "image/label affine mismatch": (lambda r: _save(r / LAB, _label(), np.diag([1.0, 2.0, 2.0, 1.0])), LAB, "affine"),
    "label values outside 0-3": (lambda r: _save(r / LAB, np.where(_label() == 3, 5, _label()).astype(np.uint8)),
                                 LAB, "outside 0..3"),
    "negative label values": (lambda r: _save(r / LAB, np.where(_label() == 3, -1, _label().astype(np.int16))),
                              LAB, "outside 0..3"),
    "non-integer label values": (lambda r: _save(r / LAB, _label().astype(np.float32) * 0.5), LAB, "non-integer"),
    "NaN voxels": (lambda r: _save(r / IMG, np.where(_image() > 90, np.nan, _image()).astype(np.float32)), IMG,
                   "non-finite"),
    "inf voxels": (lambda r: _save(r / IMG, np.where(_image() > 90, np.inf, _image()).astype(np.float32)), IMG,
                   "non-finite"),
    "empty brain": (lambda r: _save(r / IMG, np.zeros(SHAPE + (4,), np.float32)), IMG, "empty brain"),
    "non-invertible affine": (lambda r: _save_singular(r / IMG, _image()), IMG,
                              "not invertible"),
    "4D label map": (lambda r: _save(r / LAB, np.stack([_label()] * 2, -1)), LAB, "3D label"),
    "empty patient id": (_edit_meta(lambda m: m["training"][1].update(patient="  ")), "dataset.json",
                         "training[1] (BRATS_002) has 'patient'"),
    "non-string patient id": (_edit_meta(lambda m: m["training"][0].update(patient=["a"])), "dataset.json",
                              "non-empty patient id"),
}


def test_valid_folder_loads(tmp_path):
    root = make_msd(tmp_path / "Task01")
    dataset = validate_dataset(root)
    assert [c.case_id for c in dataset.training] == ["BRATS_001", "BRATS_002"]
    assert [c.case_id for c in dataset.test] == ["BRATS_485"] and dataset.test[0].label is None
    image, label, affine = load_case(dataset.training[0])
    assert image.shape == SHAPE + (4,) and image.dtype == np.float32
    assert label.dtype == np.uint8 and set(np.unique(label)) == {0, 1, 2, 3}
    np.testing.assert_allclose(affine, AFFINE)
    assert dataset.institutions == []


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_gives_one_line_error_naming_the_file(tmp_path, kind):
    mutate, file_part, words = CORRUPTIONS[kind]
    root = make_msd(tmp_path / "Task01")
    mutate(root)
    with pytest.raises(DataError) as info:
        validate_dataset(root)
    message = str(info.value)
    assert isinstance(info.value, UserError)
    assert "\n" not in message and len(message) < 400
    assert file_part in message, message
    assert words.lower() in message.lower(), message


def test_at_least_fifteen_corruption_kinds():
    assert len(CORRUPTIONS) >= 15


def test_inspect_cli_reports_corruption_in_one_line(tmp_path, capsys):
    from sim.cli import main

    root = make_msd(tmp_path / "Task01")
    assert main(["data", "inspect", str(root)]) == 0
    assert "2 labelled, 1 test" in capsys.readouterr().out
    CORRUPTIONS["truncated gzip"][0](root)
    assert main(["data", "inspect", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpate data: error:") and "BRATS_001.nii.gz" in err and "\n" not in err


# ------------------------------------------------------------------------------------------------ patients
@pytest.mark.parametrize("case_id, patient", [
    ("BraTS19_TCIA01_131_1", "TCIA01_131"),        # BraTS 2019: <site>_<subject>_<timepoint>
    ("BraTS19_TCIA01_131_2", "TCIA01_131"),
    ("Brats18_2013_10_1", "2013_10"),              # BraTS 2018, the 2013 challenge's cases
    ("Brats17_CBICA_AAB_1", "CBICA_AAB"),
    ("BraTS-GLI-00008-000", "GLI-00008"),          # BraTS 2023: <cohort>-<subject>-<timepoint>
    ("BraTS-GLI-00008-001", "GLI-00008"),
    ("BraTS-GLI-02060-101", "GLI-02060"),          # BraTS 2024 post-treatment timepoints
    ("BraTS-MEN-00008-000", "MEN-00008"),          # another cohort: another patient
    ("BRATS_001", "BRATS_001"),                    # MSD Task01: one volume, one patient
    ("BraTS20_Training_001", "BraTS20_Training_001"),
    ("BraTS2021_00000", "BraTS2021_00000"),
    ("case-7", "case-7"),
])
def test_patient_id_rule(case_id, patient):
    from task.data.msd import patient_id

    assert patient_id(case_id) == patient
    assert patient_id(case_id, declared="P-42") == "P-42"        # dataset.json's key wins


def test_dataset_json_patient_key_and_naming_rule(tmp_path, capsys):
    names = ["BRATS_001", "BRATS_002", "BRATS_003", "BraTS19_CBICA_AAB_1", "BraTS19_CBICA_AAB_2"]
    root = make_msd(tmp_path / "Task01", names=names, patients={"BRATS_001": "P1", "BRATS_002": "P1",
                                                                 "BRATS_003": 7})
    dataset = read_msd(root)
    assert [c.patient for c in dataset.training] == ["P1", "P1", "7", "CBICA_AAB", "CBICA_AAB"]
    assert dataset.patients == ["7", "CBICA_AAB", "P1"]
    assert dataset.test[0].patient == "BRATS_485"
    from sim.cli import main

    assert main(["data", "inspect", str(root)]) == 0
    assert "patients:   3 (5 scans; a patient's scans stay together)" in capsys.readouterr().out


def test_prepared_dataset_knows_patients_and_old_manifests_fall_back(tmp_path):
    from task.data.preprocess import PreparedDataset, PreprocessConfig, prepare_dataset

    root = make_msd(tmp_path / "Task01", names=["BRATS_001", "BRATS_002", "Brats18_2013_10_1"],
                    patients={"BRATS_001": "P1", "BRATS_002": "P1"})
    prepared = prepare_dataset(root, tmp_path / "cache", PreprocessConfig(grid=8), progress=False)
    assert prepared.manifest["patients"] == {"BRATS_001": "P1", "BRATS_002": "P1", "Brats18_2013_10_1": "2013_10"}
    assert [prepared.patient(c) for c in prepared.case_ids] == ["P1", "P1", "2013_10"]
    with pytest.raises(DataError, match="no case"):
        prepared.patient("BRATS_999")
    # a manifest written before patients were recorded: the naming rule on the case id ...
    manifest_path = tmp_path / "cache" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["patients"]
    manifest_path.write_text(json.dumps(manifest))
    old = PreparedDataset.open(tmp_path / "cache")
    assert [old.patient(c) for c in old.case_ids] == ["BRATS_001", "BRATS_002", "2013_10"]
    # ... until prepare_dataset reuses the cache: it adds what dataset.json declares (arrays untouched)
    stamp = (tmp_path / "cache" / "images.npy").stat().st_mtime_ns
    again = prepare_dataset(root, tmp_path / "cache", PreprocessConfig(grid=8), progress=False)
    assert [again.patient(c) for c in again.case_ids] == ["P1", "P1", "2013_10"]
    assert (tmp_path / "cache" / "images.npy").stat().st_mtime_ns == stamp


def test_deployed_hospital_splits_its_teachers_by_patient(tmp_path):
    """A hospital's own folder with two scans of several patients: each patient's scans at one teacher."""
    from clients.node import _deployed_hospital
    from task.settings.presets import get_preset

    names = [f"BraTS19_TCIA01_{p:03d}_{t}" for p in range(1, 5) for t in (1, 2)] + ["BRATS_010", "BRATS_011"]
    root = make_msd(tmp_path / "h0", names=names, patients={"BRATS_010": "TCIA01_001"})   # a third scan of 001
    made = {}

    def hospital(hospital_id, prepared, partitions, preset, workdir, settings):
        made.update(prepared=prepared, partitions=partitions)
        return made

    node = {"hospital-id": "h0", "data-dir": str(root), "workdir": str(tmp_path / "work"), "teachers-per-hospital": 3,
            "epsilon-budget": 8.0, "max-teachers": 12}
    _deployed_hospital(node, {"preset": "tiny"}, get_preset("tiny"), 0, hospital)
    partitions, prepared = made["partitions"], made["prepared"]
    assert sorted(c for part in partitions for c in part) == sorted(names) and len(partitions) == 3
    teacher_of = {}
    for t, part in enumerate(partitions):
        for cid in part:
            assert teacher_of.setdefault(prepared.patient(cid), t) == t, f"{cid} split from its patient"
    assert sorted(teacher_of) == ["BRATS_011", "TCIA01_001", "TCIA01_002", "TCIA01_003", "TCIA01_004"]
    assert sorted(len({prepared.patient(c) for c in part}) for part in partitions) == [1, 2, 2]   # even in patients
