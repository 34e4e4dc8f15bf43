"""`fedpate privacy calibrate|spent` through sim.cli.main, and once as a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from privacy.events import GaussianEvent, SampledGaussianEvent
from privacy.ledger import Ledger
from sim.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_calibrate_json_golden(capsys):
    status = main(["privacy", "calibrate", "--epsilon", "8", "--delta", "1e-3", "--queries", "80",
                   "--teachers", "8", "--compressor", "ae", "--json"])
    assert status == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sensitivity"] == 0.25 and out["relation"] == "replace-one"
    assert out["sigma_exact"] == pytest.approx(1.0733, abs=1e-4)
    assert out["sigma_paper"] == pytest.approx(1.2826, abs=1e-4)
    assert out["ratio_paper_over_exact"] == pytest.approx(1.195, abs=1e-3)
    assert out["epsilon_exact_sigma_gdp"] <= 8.0
    assert out["epsilon_exact_sigma_rdp"] > 8.0  # RDP is looser than the exact composition
    assert out["epsilon_exact_sigma_pld"] == pytest.approx(8.0, abs=2e-3)


def test_calibrate_text_and_compressors(capsys):
    assert main(["privacy", "calibrate", "--compressor", "pca", "--dim", "400", "--no-pld"]) == 0
    text = capsys.readouterr().out
    assert "sigma exact" in text and "sigma paper" in text and "replace-one" in text and "2.5" in text
    assert main(["privacy", "calibrate", "--compressor", "clip", "--clip", "2", "--teachers", "16", "--json",
                 "--no-pld"]) == 0
    assert json.loads(capsys.readouterr().out)["sensitivity"] == 0.25
    assert main(["privacy", "calibrate", "--compressor", "naive", "--voxels", "8", "--teachers", "4", "--json",
                 "--no-pld"]) == 0
    assert json.loads(capsys.readouterr().out)["sensitivity"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, words", [
    (["--compressor", "pca"], "--dim"),
    (["--compressor", "clip"], "--clip"),
    (["--compressor", "naive"], "--voxels"),
    (["--epsilon", "-1"], "epsilon"),
    (["--delta", "2"], "delta"),
    (["--teachers", "0"], "teachers"),
])
def test_calibrate_errors_are_one_line(capsys, argv, words):
    try:
        status = main(["privacy", "calibrate", "--no-pld", *argv])
    except SystemExit as stopped:   # refused by the parser (a value no option takes)
        status = stopped.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedpate privacy") and "error:" in err and words in err and "\n" not in err


def test_spent(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for query in range(80):
        ledger.record(["hospital-1", "hospital-2"], GaussianEvent(0.25, 1.0733434), f"q{query}")
    ledger.record(["hospital-3"], SampledGaussianEvent(0.01, 1.0, 1000), "sgd")
    assert main(["privacy", "spent", str(path), "--delta", "1e-3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("hospital-1") and "epsilon=8.0000" in lines[0] and "gdp-exact" in lines[0]
    assert "releases=80" in lines[0] and "relation=replace-one" in lines[0]
    assert "accountant=pld" in lines[2] and "add-remove" in lines[2]
    assert main(["privacy", "spent", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["digest"] == ledger.digest() and len(data["owners"]) == 3


def test_spent_errors(tmp_path, capsys):
    assert main(["privacy", "spent", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "mixed.jsonl"
    ledger = Ledger(path)
    ledger.record(["h"], GaussianEvent(0.25, 1.0), "a")
    ledger.record(["h"], SampledGaussianEvent(0.01, 1.0, 10), "b")
    assert main(["privacy", "spent", str(path)]) == 2
    assert "relation" in capsys.readouterr().err
    assert main(["privacy", "spent", str(path), "--relation", "add-remove"]) == 0
    assert "releases=1" in capsys.readouterr().out


def test_cli_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "sim.cli", "privacy", "calibrate", "--epsilon", "1", "--delta", "1e-3",
         "--queries", "80", "--teachers", "8", "--compressor", "ae", "--json", "--no-pld"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ratio_paper_over_exact"] == pytest.approx(1.49, abs=0.01)


def test_spent_warns_of_a_torn_last_line_and_leaves_the_file_as_found(tmp_path, capsys):
    """A ledger whose last line is cut short (a copy that stopped half-way, or a kill mid-write): the complete
    records are accounted, a one-line warning says the ε is a lower bound until the file is repaired, and reading
    it changes nothing in it (the evidence stays)."""
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    for query in range(2):
        ledger.record(["h0"], GaussianEvent(0.25, 1.0), f"q{query}")
    whole = path.read_bytes()
    torn = whole + whole.splitlines(keepends=True)[0][:40]
    path.write_bytes(torn)
    assert main(["privacy", "spent", str(path)]) == 0
    captured = capsys.readouterr()
    warning = captured.err.strip().splitlines()
    assert len(warning) == 1 and "warning" in warning[0] and "40 bytes" in warning[0] and "lower bound" in warning[0]
    assert "releases=2" in captured.out
    assert path.read_bytes() == torn
    assert main(["privacy", "spent", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torn_tail_bytes"] == 40 and data["epsilon_is_lower_bound"] is True
    path.write_bytes(whole)
    assert main(["privacy", "spent", str(path)]) == 0 and capsys.readouterr().err == ""
