"""`fedpate data phantoms|inspect|prepare|gallery` through sim.cli.main."""

from __future__ import annotations

import json

from sim.cli import main


def test_data_commands(tmp_path, capsys):
    out = tmp_path / "phantoms"
    assert main(["data", "phantoms", "--out", str(out), "--cases", "3", "--institutions", "2", "--seed", "4",
                 "--resolution", "4", "--test-cases", "1", "--no-progress"]) == 0
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["numTraining"] == 3 and meta["test"] == ["./imagesTs/BRATS_004.nii.gz"]
    assert [e["institution"] for e in meta["training"]] == ["site0", "site1", "site0"]
    assert meta["modality"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}

    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    report = capsys.readouterr().out
    assert "3 labelled, 1 test" in report and "site0 (2), site1 (1)" in report and "spacing mm: 4x4x4" in report

    assert main(["data", "prepare", str(out), "--grid", "12", "--out", str(tmp_path / "cache"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["config"]["grid"] == [12, 12, 12] and manifest["source"]["kind"] == "phantoms"

    png = tmp_path / "gallery.png"
    assert main(["data", "gallery", str(out), "--out", str(png), "--cases", "2"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpate data: error:") and "dataset.json" in err and "\n" not in err
    assert main(["data", "prepare", str(tmp_path), "--grid", "ab", "--out", str(tmp_path / "c")]) == 2
    assert "--grid=ab" in capsys.readouterr().err


def test_shifted_phantoms_from_the_cli(tmp_path, capsys):
    out = tmp_path / "shifted"
    assert main(["data", "phantoms", "--out", str(out), "--cases", "1", "--resolution", "4", "--shift", "skull",
                 "--no-progress"]) == 0
    assert "shift skull" in capsys.readouterr().out
    assert json.loads((out / "dataset.json").read_text())["phantoms"]["shift"] == "skull"
    assert main(["data", "phantoms", "--out", str(tmp_path / "bad"), "--cases", "1", "--shift", "warp"]) == 2
    assert "--shift=warp: expected one of" in capsys.readouterr().err
