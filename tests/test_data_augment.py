"""Augmentation: seedable, keeps labels aligned and valid, keeps the background zero, preserves types."""

from __future__ import annotations

import numpy as np
import torch

from task.data.augment import training_augmentation


def _pair(seed=0):
    rng = np.random.default_rng(seed)
    image = np.zeros((4, 16, 16, 16), np.float32)
    image[:, 3:13, 2:14, 4:12] = rng.normal(size=(4, 10, 12, 8))
    label = np.zeros((16, 16, 16), np.int64)
    label[5:10, 5:10, 5:10] = 1
    label[6:9, 6:9, 6:9] = 2
    label[7, 7, 7] = 3
    return image, label


def test_seedable_and_varied():
    image, label = _pair()
    aug = training_augmentation(seed=7)
    first = [aug(image, label) for _ in range(4)]
    aug.set_random_state(7)
    second = [aug(image, label) for _ in range(4)]
    for (a, la), (b, lb) in zip(first, second):
        assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert any(not np.array_equal(a, image) for a, _ in first)


def test_labels_follow_the_image_and_background_stays_zero():
    image, label = _pair()
    image[0][label > 0] = 10.0            # a bright marker where the tumour is
    aug = training_augmentation(seed=1, intensity=False)
    for _ in range(6):
        out, out_label = aug(image, label)
        assert out.dtype == np.float32 and out_label.dtype == np.int64 and out_label.shape == label.shape
        assert set(np.unique(out_label)) <= {0, 1, 2, 3}
        assert out[0][out_label > 0].mean() > 5.0      # the marker moved with the labels
    aug = training_augmentation(seed=2)
    for _ in range(6):
        out, _ = aug(image, label)
        brain_before = (image != 0).any(axis=0).sum()
        background = ~(out != 0).any(axis=0)
        assert abs(int((~background).sum()) - int(brain_before)) < 0.1 * brain_before


def test_soft_targets_stay_distributions_and_dicts_and_tensors_work():
    image, label = _pair()
    probs = torch.softmax(torch.randn(4, 16, 16, 16), dim=0)
    aug = training_augmentation(seed=3)
    out, out_probs = aug(torch.from_numpy(image), probs)
    assert type(out) is torch.Tensor and type(out_probs) is torch.Tensor
    assert torch.allclose(out_probs.sum(0), torch.ones(16, 16, 16), atol=1e-4) and out_probs.min() >= 0
    result = aug({"image": image, "label": label, "case": "x"})
    assert result["image"].shape == image.shape and result["label"].shape == label.shape and result["case"] == "x"


def test_integer_labels_are_the_first_most_probable_class_of_the_soft_path():
    """An integer label map comes out as the argmax (first maximum, as ``argmax(dim=0)`` gives it) of the same
    augmentation applied to its one-hot map: the class-last argmax changes no label, ties included."""
    image, label = _pair()
    one_hot = np.eye(4, dtype=np.float32)[label].transpose(3, 0, 1, 2)
    hard, soft = training_augmentation(seed=5), training_augmentation(seed=5)
    for _ in range(4):
        _, out_label = hard(image, label)
        _, out_soft = soft(image, one_hot)
        assert np.array_equal(out_label, torch.as_tensor(out_soft).argmax(dim=0).numpy())


def test_metadata_off_changes_no_bit_and_the_flag_is_restored():
    """The augmentation runs MONAI without MetaTensor bookkeeping (for speed): the same bits as with it, and MONAI's
    global tracking flag is as the caller left it."""
    from monai.data import get_track_meta, set_track_meta

    image, label = _pair(3)
    assert get_track_meta()
    fast = training_augmentation(seed=5)
    tracked = training_augmentation(seed=5)
    for _ in range(6):
        a, la = fast(image, label)
        assert get_track_meta()
        b, lb = tracked._apply_plain(image, label)     # MONAI with its MetaTensors, as before
        assert np.array_equal(a, b) and np.array_equal(la, lb)
    set_track_meta(False)
    try:
        fast(image, label)
        assert not get_track_meta()
    finally:
        set_track_meta(True)
