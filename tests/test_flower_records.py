"""The wire format shared by the ClientApp and the ServerApp round-trips exactly."""

import numpy as np
import pytest

from task.wire.flower_wire import arrays_digest, make_content, read_content


def test_arrays_configs_and_scalars_round_trip():
    arrays = {
        "basis": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32),
        "kind": np.array("pca"),
        "clip": np.array(1.5),
        "grid": np.array([16, 16, 16]),
    }
    config = {"preset": "tiny", "nested": {"a": [1, 2]}, "none": None, "flag": True}
    restored_config, restored = read_content(make_content(config, codec=arrays))
    assert restored_config == config
    assert set(restored["codec"]) == set(arrays)
    for name, value in arrays.items():
        assert restored["codec"][name].shape == value.shape, name
        assert restored["codec"][name].dtype == value.dtype or value.dtype.kind == "U", name
        assert np.array_equal(restored["codec"][name], value), name
    assert arrays_digest(restored["codec"]) == arrays_digest(arrays)


def test_digest_changes_with_content():
    a = {"w": np.zeros(4, np.float32)}
    b = {"w": np.zeros(4, np.float32)}
    b["w"][2] = 1e-7
    assert arrays_digest(a) != arrays_digest(b)


def test_config_rejects_objects_that_cannot_travel():
    with pytest.raises(TypeError, match="ConfigRecord"):
        make_content({"bad": object()})
