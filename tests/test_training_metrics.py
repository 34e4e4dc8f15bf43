"""Dice golden cases, region definitions and the documented empty-class convention."""

import json
import math

import numpy as np
import pytest

from task.learning.metrics import DICE_KEYS, DiceAccumulator, dice_scores


def _case():
    t = np.zeros((1, 4, 4, 4), np.int64)
    t[0, 0] = 1          # 16 voxels oedema
    t[0, 1, :2] = 2      # 8 voxels core
    t[0, 2, :1] = 3      # 4 voxels enhancing
    return t


def test_perfect_prediction_scores_one():
    t = _case()
    assert dice_scores(t, t) == {k: 1.0 for k in DICE_KEYS}


def test_disjoint_prediction_scores_zero():
    t = np.zeros((1, 4, 4, 4), np.int64)
    t[0, 0] = 1
    t[0, 1] = 2
    t[0, 2] = 3
    p = np.zeros_like(t)
    p[0, 3, 0] = 1
    p[0, 3, 1] = 2
    p[0, 3, 2] = 3
    d = dice_scores(p, t)
    assert d["1"] == d["2"] == d["3"] == d["mean"] == 0.0
    assert d["WT"] == d["TC"] == d["ET"] == 0.0


def test_hand_computed_partial_overlap():
    t = _case()
    p = t.copy()
    p[0, 0, :2] = 0          # miss 8 of 16 oedema voxels: Dice_1 = 2*8/(8+16) = 2/3
    p[0, 3, :1] = 3          # 4 extra enhancing voxels: Dice_3 = 2*4/(8+4) = 2/3
    d = dice_scores(p, t)
    assert d["1"] == pytest.approx(2 / 3)
    assert d["2"] == pytest.approx(1.0)
    assert d["3"] == pytest.approx(2 / 3)
    assert d["mean"] == pytest.approx((2 / 3 + 1 + 2 / 3) / 3)
    # WT: truth 28 voxels, pred 28-8+4 = 24, overlap 20 -> 40/52
    assert d["WT"] == pytest.approx(40 / 52)
    # TC = {2,3}: truth 12, pred 16, overlap 12 -> 24/28
    assert d["TC"] == pytest.approx(24 / 28)
    assert d["ET"] == pytest.approx(2 / 3)


def test_empty_class_convention():
    # case 0: class 3 empty in truth and prediction -> excluded; case 1: class 3 present and perfect
    t = _case().repeat(2, axis=0)
    t[0][t[0] == 3] = 2
    d = dice_scores(t, t)
    assert d["3"] == 1.0          # only case 1 counts (excluded, not scored 1 or 0)
    p = t.copy()
    p[0, 3, 3, 3] = 3             # a false positive on empty truth scores 0 for that case
    assert dice_scores(p, t)["3"] == pytest.approx(0.5)


def test_class_empty_everywhere_is_none_and_json_has_no_nan():
    t = _case()
    t[t == 3] = 0
    d = dice_scores(t, t)
    assert d["3"] is None and d["ET"] is None
    assert d["mean"] == 1.0       # mean of the classes that are not None
    text = json.dumps(d, allow_nan=False)   # would raise on NaN
    assert "null" in text
    empty = dice_scores(np.zeros((2, 4, 4, 4), int), np.zeros((2, 4, 4, 4), int))
    assert all(v is None for v in empty.values())


def test_accumulator_equals_one_shot():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 4, (5, 6, 6, 6))
    p = np.where(rng.random(t.shape) < 0.7, t, rng.integers(0, 4, t.shape))
    acc = DiceAccumulator()
    acc.add(p[:2], t[:2]).add(p[2:], t[2:])
    one = dice_scores(p, t)
    many = acc.aggregate()
    assert all(math.isclose(one[k], many[k]) for k in DICE_KEYS)
    acc.reset()
    assert acc.aggregate()["mean"] is None


def test_float_predictions_are_rejected():
    with pytest.raises(ValueError, match="argmax"):
        dice_scores(np.zeros((1, 2, 2, 2), np.float32), np.zeros((1, 2, 2, 2), np.int64))


def test_case_means_are_each_cases_mean_over_its_valid_classes():
    from task.learning.metrics import DiceAccumulator

    truth = np.zeros((3, 4, 4, 4), np.int64)
    pred = np.zeros_like(truth)
    truth[0, :2], pred[0, :2] = 1, 1                 # case 0: class 1 perfect; 2, 3 empty in both -> excluded
    truth[1, :2], pred[1, :1] = 1, 1                 # case 1: class 1 Dice 2*32/(64+32) = 2/3
    truth[1, 3], pred[1, 3] = 3, 2                   # class 2 predicted where none is: 0; class 3 missed: 0
    acc = DiceAccumulator().add(pred[:2], truth[:2]).add(pred[2:], truth[2:])   # case 2: all empty
    means = acc.case_means()
    assert means[0] == pytest.approx(1.0) and means[1] == pytest.approx((2 / 3 + 0 + 0) / 3) and means[2] is None


def test_region_masks_are_torchs_isin_and_dice_matches_counting():
    """The regions' masks are built by equality tests instead of ``torch.isin`` (which sorts): the same masks,
    and the Dice of the MONAI path still equals the one from voxel counts; a region's presence in the truth is
    read off its classes' presence, as ``isin`` would find it."""
    import torch

    from task.learning.metrics import REGIONS, _member_of, per_case_dice, per_case_dice_counted, truth_presence

    rng = np.random.default_rng(3)
    labels = torch.as_tensor(rng.integers(0, 5, size=(3, 6, 6, 6)))   # 4: a code outside every region
    for members in REGIONS.values():
        assert torch.equal(_member_of(labels, members), torch.isin(labels, torch.tensor(members)))
    pred, true = rng.integers(0, 4, size=(2, 2, 8, 8, 8))
    for mine, counted in zip(per_case_dice(pred, true), per_case_dice_counted(pred, true)):
        np.testing.assert_allclose(mine, counted, rtol=1e-6)
    sparse = labels.numpy() * (rng.random(labels.shape) < 0.02)        # some cases miss some classes
    flat = sparse.reshape(len(sparse), -1)
    expected = [(flat == c).any(axis=1) for c in (1, 2, 3)] + [np.isin(flat, r).any(axis=1) for r in REGIONS.values()]
    assert np.array_equal(truth_presence(sparse), np.stack(expected, axis=1))
