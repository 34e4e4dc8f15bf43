"""The one training loop: per-sample loss, hard and soft targets, init_from, checkpoint resume."""

import numpy as np
import pytest
import torch

from task.learning.compute import Compute
from task.learning.networks import build_unet
from task.learning.training import (TrainConfig, evaluate_segmentation, per_sample_loss, predict_probs,
                                    train_segmentation)


def _data(n=4, g=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4, g, g, g)).astype(np.float32)
    y = (x[:, 0] > 0.3).astype(np.int64) + (x[:, 1] > 1.0).astype(np.int64) + (x[:, 2] > 1.5).astype(np.int64)
    return x, y


def _model(seed=0):
    torch.manual_seed(seed)
    return build_unet("tiny")


def test_loss_is_per_sample():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 4, 4, 4)
    y = torch.randint(0, 4, (3, 4, 4, 4))
    joint = per_sample_loss(logits, y)
    alone = torch.cat([per_sample_loss(logits[i:i + 1], y[i:i + 1]) for i in range(3)])
    assert joint.shape == (3,)
    assert torch.allclose(joint, alone)


def test_soft_one_hot_targets_equal_hard_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 4, 4, 4)
    y = torch.randint(0, 4, (2, 4, 4, 4))
    soft = torch.nn.functional.one_hot(y, 4).movedim(-1, 1).float()
    assert torch.allclose(per_sample_loss(logits, y), per_sample_loss(logits, soft), atol=1e-5)


def test_training_reduces_loss_and_predicts_probabilities():
    x, y = _data()
    model = _model()
    result = train_segmentation(model, x, y, TrainConfig(epochs=4, batch_size=2, learning_rate=1e-2,
                                                         augment=False, compute=Compute(progress=False)))
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < losses[0]
    probs = predict_probs(model, x)
    assert probs.shape == (4, 4, 8, 8, 8) and probs.dtype == np.float32
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    assert set(evaluate_segmentation(model, x, y)) == {"1", "2", "3", "mean", "WT", "TC", "ET"}


def test_soft_targets_train():
    x, y = _data()
    soft = np.eye(4, dtype=np.float32)[y].transpose(0, 4, 1, 2, 3) * 0.9 + 0.025
    result = train_segmentation(_model(), x, soft, TrainConfig(epochs=2, batch_size=2, learning_rate=1e-2,
                                                               augment=False, compute=Compute(progress=False)))
    assert all(np.isfinite(h["loss"]) for h in result.history)


def test_init_from_starts_from_given_weights(tmp_path):
    x, y = _data()
    source = _model(seed=1)
    torch.save({"model": source.state_dict()}, tmp_path / "pre.pt")
    target = _model(seed=2)
    train_segmentation(target, x, y, TrainConfig(epochs=0, batch_size=2, learning_rate=1e-2,
                                                 init_from=tmp_path / "pre.pt",
                                                 compute=Compute(device="cpu", progress=False)))
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_continues_identically(tmp_path):
    x, y = _data()
    straight = _model()
    train_segmentation(straight, x, y, TrainConfig(epochs=3, batch_size=2, learning_rate=1e-2,
                                                   augment=False, checkpoint=tmp_path / "a.pt",
                                                   compute=Compute(device="cpu", progress=False)))
    first = _model()
    train_segmentation(first, x, y, TrainConfig(epochs=2, batch_size=2, learning_rate=1e-2,
                                                augment=False, checkpoint=tmp_path / "b.pt",
                                                compute=Compute(device="cpu", progress=False)))
    resumed = _model(seed=5)   # different init: must be overwritten by the checkpoint
    result = train_segmentation(resumed, x, y, TrainConfig(epochs=3, batch_size=2, learning_rate=1e-2,
                                                           augment=False,
                                                           checkpoint=tmp_path / "b.pt",
                                                           compute=Compute(device="cpu", progress=False)))
    assert result.resumed_from_epoch == 2 and len(result.history) == 3
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)


def test_augmentation_is_used_and_seeded():
    pytest.importorskip("task.data.augment")
    x, y = _data()

    def run(augment, seed=0):
        model = _model()
        train_segmentation(model, x, y, TrainConfig(epochs=1, batch_size=2, learning_rate=1e-2,
                                                    augment=augment, seed=seed, compute=Compute(device="cpu", progress=False)))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    with_aug = run(True)
    assert torch.equal(with_aug, run(True))            # reproducible
    assert not torch.equal(with_aug, run(False))       # and actually applied
