"""Simulation-only diagnostics at a hospital: one pass of its teachers over the test scans serves both the
un-noised diagnostic query and the probability ensemble, and is remembered for the same teachers, scans and
codec (the demo's PATE cells at epsilon 1 and 8 ask both of the same teachers); nothing is charged, and a
deployed hospital refuses both."""

import numpy as np
import pytest

from clients.hospital import Hospital, HospitalSettings
from task.codecs import PCACompressor
from task import codecs
from task.errors import UserError
from task.settings.presets import get_preset

PRESET = get_preset("tiny")


class _CountingTeachers(Hospital):
    """Two teachers with fixed, distinct answers; ``runs`` counts teacher forward passes."""

    def __init__(self, tmp_path, deployed=False):
        super().__init__("h0", prepared=None, partitions=[["a"], ["b"], ["c"]], preset=PRESET,
                         workdir=tmp_path / "h0",
                         settings=HospitalSettings(lifetime_epsilon=10.0, delta=1e-3, deployed=deployed))
        self.runs = 0

    def teacher_probs(self, k, scans, config=None):
        self.runs += 1
        rng = np.random.default_rng(100 + k + int(np.asarray(scans).sum()))
        return codecs.normalise_probabilities(rng.random((len(scans), 4, 8, 8, 8)).astype(np.float32))


def _codec(components=3):
    maps = codecs.one_hot(np.random.default_rng(0).integers(0, 4, size=(12, 8, 8, 8)), 4)
    return PCACompressor(components, "clip", clip=1.0).fit(maps).state()


def test_one_teacher_pass_serves_the_diagnostic_query_and_the_probability_ensemble(tmp_path):
    hospital, codec = _CountingTeachers(tmp_path), _codec()
    scans = np.zeros((2, 4, 8, 8, 8), np.float32)
    rows, notes = hospital.answer_query(scans, codec, {"diagnostic": True})
    assert hospital.runs == 3 and notes == {"fallback_teachers": 0}
    expected_rows = np.stack([codecs.encode(codecs.verify_codec(codec), hospital.teacher_probs(k, scans))
                              for k in range(3)])
    expected_sum = sum(hospital.teacher_probs(k, scans).astype(np.float64) for k in range(3))
    hospital.runs = 0
    np.testing.assert_allclose(rows, expected_rows, rtol=1e-6)
    np.testing.assert_allclose(hospital.ensemble_probability_sum(scans), expected_sum, rtol=1e-6)
    again, _ = hospital.answer_query(scans, codec, {"diagnostic": True})
    np.testing.assert_array_equal(again, rows)
    assert hospital.runs == 0                                  # both served from the one pass
    # another codec needs the teachers' outputs again; other scans too
    other, _ = hospital.answer_query(scans, _codec(2), {"diagnostic": True})
    assert hospital.runs == 3 and other.shape[-1] == 2
    hospital.ensemble_probability_sum(scans + 1.0)
    assert hospital.runs == 6
    assert not hospital.privacy_ledger.exists()               # diagnostics are never charged (nor released)


def test_retrained_teachers_are_run_again(tmp_path):
    hospital = _CountingTeachers(tmp_path)
    scans = np.zeros((1, 4, 8, 8, 8), np.float32)
    hospital.ensemble_probability_sum(scans)
    hospital._diagnostics.clear()          # what train_teachers does when it trains (not when it reuses)
    hospital.ensemble_probability_sum(scans)
    assert hospital.runs == 6


def test_a_deployed_hospital_refuses_both_diagnostics(tmp_path):
    hospital = _CountingTeachers(tmp_path, deployed=True)
    scans = np.zeros((1, 4, 8, 8, 8), np.float32)
    with pytest.raises(UserError, match="simulation only"):
        hospital.ensemble_probability_sum(scans)
    with pytest.raises(UserError, match="simulation only"):
        hospital.answer_query(scans, _codec(), {"diagnostic": True})
    assert hospital.runs == 0


def _record_training(hospital, fingerprint):
    record = hospital.workdir / "teachers" / "training.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text('{"fingerprint": "%s"}' % fingerprint)


def test_a_later_cell_in_another_process_reads_the_pass_from_the_hospitals_disk(tmp_path):
    import os
    import stat

    first, codec = _CountingTeachers(tmp_path), _codec()
    _record_training(first, "trained-once")
    scans = np.zeros((2, 4, 8, 8, 8), np.float32)
    rows, notes = first.answer_query(scans, codec, {"diagnostic": True})
    total = first.ensemble_probability_sum(scans)
    assert first.runs == 3
    later = _CountingTeachers(tmp_path)                        # the same hospital folder, a new process's object
    again, again_notes = later.answer_query(scans, codec, {"diagnostic": True})
    np.testing.assert_array_equal(again, rows)
    np.testing.assert_array_equal(later.ensemble_probability_sum(scans), total)
    assert later.runs == 0 and again_notes == notes
    kept = list((tmp_path / "h0" / "diagnostics").iterdir())
    assert kept and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in kept)   # teachers' un-noised outputs
    _record_training(later, "trained-again")                   # retrained teachers are run again
    later._diagnostics.clear()
    later.answer_query(scans, codec, {"diagnostic": True})
    assert later.runs == 3
    assert not later.privacy_ledger.exists()
