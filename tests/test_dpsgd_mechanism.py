"""DP-SGD mechanism: per-sample clipping vs a manual loop, injected noise std, empty Poisson batches."""

import numpy as np
import pytest
import torch

from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining
from task.learning.networks import build_unet
from task.learning.training import per_sample_loss


def _session(model, optimizer, n=3, batch=3, clip=0.01, per_layer=True, mode="hooks", sigma=1.0):
    dp = DPConfig(mode="fixed", epsilon=1e6, delta=1e-5, noise_multiplier=sigma, max_grad_norm=clip,
                  per_layer=per_layer, grad_sample_mode=mode)
    session = DPSession(model, optimizer, PrivateTraining(dp), n=n, batch_size=batch, epochs=1)
    assert session.begin_epoch(0)   # charge first: the noise stream opens only after the charge
    return session


def _manual_clipped_sum(model, x, y, clip, per_layer):
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        per_sample_loss(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if per_layer:
            grads = [g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in grads]
        else:
            norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
            grads = [g * min(1.0, clip / (norm + 1e-6)) for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("per_layer", [True, False])
def test_per_sample_clipping_matches_manual_loop(mode, per_layer):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 8, 8)
    y = torch.randint(0, 4, (3, 8, 8, 8))
    model = build_unet("tiny")
    reference = build_unet("tiny")
    reference.load_state_dict(model.state_dict())
    clip = 0.05
    expected = _manual_clipped_sum(reference, x, y, clip, per_layer)
    session = _session(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=clip, per_layer=per_layer, mode=mode)
    session.optimizer.noise_multiplier = 0.0
    session.optimizer.zero_grad()
    per_sample_loss(session.model(x), y).mean().backward()
    session.optimizer.pre_step()
    got = [p.grad for p in model.parameters()]
    for g, e in zip(got, expected):
        # the optimizer divides the clipped sum by the expected batch size (3)
        assert torch.allclose(g * 3, e, atol=1e-6, rtol=1e-4)


class _Zero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 32)


@pytest.mark.parametrize("per_layer", [True, False])
def test_zero_gradient_noise_std(per_layer):
    """Opacus convention: noise std sigma*C_total on the clipped SUM, then /expected batch size."""
    torch.manual_seed(0)
    model = _Zero()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sigma, clip, batch, n = 2.0, 4.0, 4, 16
    session = _session(model, torch.optim.SGD(model.parameters(), lr=1.0), n=n, batch=batch, clip=clip,
                       per_layer=per_layer, sigma=sigma)
    assert session.expected_batch_size == batch
    x = torch.randn(batch, 64)
    out = session.model.a(x)
    loss = (0.0 * (out.sum(dim=1) + session.model.b(out).sum(dim=1))).mean()   # zero gradients
    loss.backward()
    session.optimizer.step()
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    c_total = clip * (4 ** 0.5 if per_layer else 1.0)   # 4 parameter tensors clipped at C each
    expected = sigma * c_total / batch
    assert session.total_clip == pytest.approx(c_total)
    # about 6.2k coordinates: relative standard error of the std ~ 0.9 %
    assert np.std(values) == pytest.approx(expected, rel=0.05)
    assert abs(np.mean(values)) < 4 * expected / np.sqrt(values.size)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_empty_poisson_batch_is_a_safe_noise_only_step(mode):
    torch.manual_seed(0)
    model = build_unet("tiny")
    before = [p.detach().clone() for p in model.parameters()]
    session = _session(model, torch.optim.SGD(model.parameters(), lr=1.0), n=4, batch=2, clip=1.0, mode=mode)
    session.noise_only_step()
    after = [p.detach().clone() for p in model.parameters()]
    assert all(torch.isfinite(a).all() for a in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))     # noise was added
    # the next (non-empty) step works and is finite
    x = torch.randn(2, 4, 8, 8, 8)
    y = torch.randint(0, 4, (2, 8, 8, 8))
    session.optimizer.zero_grad()
    per_sample_loss(session.model(x), y).mean().backward()
    session.optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_poisson_batches_can_be_empty_and_training_survives():
    from privacy.mechanisms import NoiseSource
    from task.learning.dpsgd import poisson_batches

    sizes = [len(b) for b in poisson_batches(2, 0.5, 200, NoiseSource().generator("test"))]
    assert 0 in sizes and max(sizes) == 2 and len(sizes) == 200
    assert abs(np.mean(sizes) - 1.0) < 0.2


def test_noise_is_refused_before_the_epoch_is_charged():
    """No stream exists until begin_epoch has charged the ledger: drawing noise or batches first fails."""
    model = _Zero()
    dp = DPConfig(mode="fixed", epsilon=1e6, delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=1.0), PrivateTraining(dp), n=4, batch_size=2,
                        epochs=1)
    with pytest.raises(RuntimeError):
        session.batches()
    with pytest.raises(RuntimeError):
        session.noise_only_step()     # add_noise finds no stream
    assert len(session.ledger) == 0


def test_secure_noise_differs_between_identical_sessions():
    """Default noise is unpredictable: two sessions with the same seed and data draw different noise."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        model = _Zero()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        session = _session(model, torch.optim.SGD(model.parameters(), lr=1.0), n=4, batch=2, clip=1.0)
        session.noise_only_step()
        draws.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(draws[0], draws[1])
