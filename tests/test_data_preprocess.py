"""Preprocessing: normalisation inside the brain, the exact inverse mapping for `predict`, the prepared cache."""

from __future__ import annotations

import numpy as np
import pytest

from task.data.msd import load_case, read_msd
from task.data.preprocess import (PreparedDataset, PreprocessConfig, PreprocessRecord, invert_label, invert_probs,
                                 prepare_dataset, preprocess_case)


def _dice(a, b):
    return 2 * np.logical_and(a, b).sum() / max(a.sum() + b.sum(), 1)


def test_normalisation_inside_the_brain_only():
    rng = np.random.default_rng(0)
    image = np.zeros((20, 22, 18, 4), np.float32)
    image[5:15, 4:18, 3:15] = rng.uniform(100, 300, (10, 14, 12, 4))
    out, label, record = preprocess_case(image, None, np.eye(4), PreprocessConfig(grid=(10, 14, 12), margin_voxels=0))
    assert out.shape == (4, 10, 14, 12) and label is None
    assert record.bbox_lo == (5, 4, 3) and record.bbox_hi == (15, 18, 15)
    assert np.allclose(out.mean(axis=(1, 2, 3)), 0, atol=1e-4) and np.allclose(out.std(axis=(1, 2, 3)), 1, atol=1e-3)
    out2, _, record2 = preprocess_case(image, None, np.eye(4), PreprocessConfig(grid=(8, 8, 8), margin_voxels=2))
    assert (out2[:, 0] == 0).all() or record2.bbox_lo[0] == 3    # margin is background


def test_round_trip_of_labels_at_the_tiny_grid(tiny_phantoms, tiny_prepared):
    dataset = read_msd(tiny_phantoms)
    whole, per_class = [], {1: [], 2: [], 3: []}
    for case in dataset.training[:8]:
        image, label, affine = load_case(case)
        grid_image, grid_label, record = preprocess_case(image, label, affine, tiny_prepared.config)
        assert np.array_equal(grid_label, tiny_prepared.labels([case.case_id])[0])
        back = invert_label(grid_label, record)
        assert back.shape == label.shape and back.dtype == np.uint8
        np.testing.assert_allclose(record.affine_array, affine)
        whole.append(_dice(back > 0, label > 0))
        for k in per_class:
            per_class[k].append(_dice(back == k, label == k))
        probs = np.eye(4, dtype=np.float32)[grid_label].transpose(3, 0, 1, 2)
        back_probs = invert_probs(probs, record)
        assert back_probs.shape == (4,) + label.shape
        assert np.allclose(back_probs.sum(axis=0), 1, atol=1e-5)
        assert _dice(back_probs.argmax(0) > 0, label > 0) > 0.75
    assert np.mean(whole) > 0.8 and min(whole) > 0.7, whole
    assert np.mean(per_class[1]) > 0.6


def test_record_json_round_trip_and_grid_affine():
    record = PreprocessRecord(original_shape=(40, 40, 30), affine=tuple(map(tuple, np.diag([2.0, 2, 2, 1]))),
                              bbox_lo=(4, 2, 0), bbox_hi=(36, 34, 30), grid=(16, 16, 15))
    assert PreprocessRecord.from_dict(record.to_dict()) == record
    # grid voxel centres land inside the crop box, spaced crop/grid apart
    ga = record.grid_affine()
    assert np.allclose(np.diag(ga)[:3], [4.0, 4.0, 4.0])
    assert np.allclose(ga[:3, 3], 2.0 * np.array([4.5, 2.5, 0.5]))


def test_prepared_dataset_arrays_manifest_and_reuse(tiny_phantoms, tiny_prepared):
    ids = tiny_prepared.case_ids[:3]
    images, labels = tiny_prepared.images(ids), tiny_prepared.labels(ids)
    assert images.shape == (3, 4, 16, 16, 16) and images.dtype == np.float32
    assert labels.shape == (3, 16, 16, 16) and labels.dtype == np.int64
    assert tiny_prepared.grid == (16, 16, 16) and len(tiny_prepared) == 48
    assert tiny_prepared.institution(ids[0]) in ("site0", "site1")
    assert tiny_prepared.source == {"kind": "phantoms", "seed": 0, "generator_version": tiny_prepared.source["generator_version"]}
    reopened = PreparedDataset.open(tiny_prepared.path)
    assert np.array_equal(reopened.images(ids[::-1]), images[::-1])
    stamp = (tiny_prepared.path / "manifest.json").stat().st_mtime_ns
    again = prepare_dataset(tiny_phantoms, tiny_prepared.path, PreprocessConfig(grid=(16, 16, 16)), progress=False)
    assert (again.path / "manifest.json").stat().st_mtime_ns == stamp         # cache reused


def test_cache_is_rebuilt_for_another_config(tiny_phantoms, tmp_path):
    from task.data.errors import DataError

    small = prepare_dataset(tiny_phantoms, tmp_path / "cache", PreprocessConfig(grid=8), progress=False)
    assert small.grid == (8, 8, 8)
    other = prepare_dataset(tiny_phantoms, tmp_path / "cache", PreprocessConfig(grid=(12, 10, 8)), progress=False)
    assert other.images(other.case_ids[:1]).shape == (1, 4, 12, 10, 8)
    with pytest.raises(DataError, match="no case"):
        other.images(["BRATS_999"])
    with pytest.raises(DataError, match="manifest.json"):
        PreparedDataset.open(tmp_path / "nothing")


def test_antialiasing_averages_voxel_noise_when_downsampling_a_fine_scan():
    """A 1 mm-like scan squeezed onto a coarse grid: without smoothing, trilinear keeps the voxel noise."""
    rng = np.random.default_rng(3)
    image = np.zeros((100, 100, 100, 4), np.float32)
    inside = (slice(10, 90),) * 3
    image[inside] = 500.0 + 50.0 * rng.standard_normal((80, 80, 80, 4)).astype(np.float32)
    image[30:50, 30:50, 30:50] += 200.0                              # a bright block: structure must survive
    plain, _, _ = preprocess_case(image, None, np.eye(4), PreprocessConfig(grid=16, antialias=False))
    smooth, _, _ = preprocess_case(image, None, np.eye(4), PreprocessConfig(grid=16))
    flat = (slice(None), slice(10, 14), slice(10, 14), slice(10, 14))     # far from the block and the edge
    assert smooth[flat].std() < 0.35 * plain[flat].std()
    assert smooth[:, 5, 5, 5].mean() > smooth[flat].mean() + 1.0        # the block is still clearly brighter
    edge = smooth[:, 0, 8, 8]                                          # edge voxels are not dimmed by the background
    assert abs(edge.mean() - smooth[flat].mean()) < 0.5


def test_artefacts_without_the_antialias_key_repeat_the_old_preprocessing():
    assert PreprocessConfig.from_dict({"grid": [8, 8, 8], "margin_voxels": 2}).antialias is False
    config = PreprocessConfig(grid=8)
    assert config.antialias is True and PreprocessConfig.from_dict(config.to_dict()) == config
