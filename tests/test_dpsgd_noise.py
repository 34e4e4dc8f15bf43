"""DP-SGD noise off the training step's critical path: the secure sampler's transform against a reference, the
noise's distribution, one flat buffer per step drawn a step ahead in a fixed order, reproducible runs that repeat
bit for bit and secure ones that never do."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from privacy.mechanisms import NoiseSource, SecureNoiseGenerator, box_muller
from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining, StepNoise


def _words(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 2 ** 64, count, dtype=np.uint64),
            rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32))


def test_box_muller_matches_a_double_precision_reference():
    radius_words, angle_words = _words(0, 4096)
    # the extremes: the largest radius (k = 0: u = 2^-53) and angles at 0 and just under 2 pi
    radius_words[:3] = np.array([0, 2 ** 64 - 1, 2 ** 11], dtype=np.uint64)
    angle_words[:3] = np.array([0, 2 ** 32 - 1, 2 ** 22], dtype=np.uint32)
    first, second = box_muller(radius_words, angle_words)
    for i in range(len(first)):
        radius = math.sqrt(-2.0 * math.log(((int(radius_words[i]) >> 11) + 1) * 2.0 ** -53))
        angle = 2.0 * math.pi * (int(angle_words[i]) + 0.5) / 2 ** 32
        assert first[i] == pytest.approx(radius * math.cos(angle), abs=4e-15 * max(1.0, radius))
        assert second[i] == pytest.approx(radius * math.sin(angle), abs=4e-15 * max(1.0, radius))
    # the tails reach beyond the 8.3 standard deviations of the inverse-CDF sampler it replaced
    assert abs(first[0]) == pytest.approx(math.sqrt(106 * math.log(2)) * abs(math.cos(math.pi / 2 ** 31)))


def test_box_muller_gives_independent_standard_normals():
    """Deterministic words (a seeded stream), so the test cannot flake: both outputs N(0, 1), uncorrelated."""
    first, second = box_muller(*_words(1, 200_000))
    for z in (first, second, np.concatenate([first, second])):
        assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.01
    assert abs(np.corrcoef(first ** 2, second ** 2)[0, 1]) < 0.01     # Box-Muller's pair is independent, not
    #                                                                   only uncorrelated


def test_secure_normals_have_the_right_distribution():
    z = SecureNoiseGenerator().standard_normal((100_000,))
    assert z.dtype == np.float64 and np.isfinite(z).all()
    assert abs(z.mean()) < 0.02 and z.std() == pytest.approx(1.0, abs=0.02)
    assert np.mean(np.abs(z) > 1.959964) == pytest.approx(0.05, abs=0.005)
    buffer = SecureNoiseGenerator().fill_standard_normal(np.full(300_001, np.nan, dtype=np.float32))
    assert np.isfinite(buffer).all() and buffer.std() == pytest.approx(1.0, abs=0.02)   # odd sizes, chunks


def test_a_reproducible_stream_fills_what_it_would_draw():
    stream = NoiseSource.reproducible(5).generator("fill")
    filled = stream.fill_standard_normal(np.empty(600_000, dtype=np.float32))
    expected = NoiseSource.reproducible(5).generator("fill").standard_normal((600_000,)).astype(np.float32)
    np.testing.assert_array_equal(filled, expected)


def test_step_noise_draws_each_step_in_order_and_no_more_than_the_epoch():
    size, steps = 1000, 4
    noise = StepNoise(NoiseSource.reproducible(2).generator("epoch-0").spawn(), steps=steps, size=size,
                      device="cpu")
    taken = torch.cat([noise.take() for _ in range(steps)]).numpy()
    reference = NoiseSource.reproducible(2).generator("epoch-0").spawn().standard_normal((steps * size,))
    np.testing.assert_array_equal(taken, reference.astype(np.float32))
    with pytest.raises(RuntimeError, match="more noisy steps"):
        noise.take()
    noise.close()


def test_secure_step_noise_split_between_threads_fills_every_slice():
    noise = StepNoise(NoiseSource().generator("e"), steps=2, size=400_003, device="cpu", workers=3)
    assert noise.workers == 3
    for _ in range(2):
        flat = noise.take().numpy()
        for part in np.array_split(flat, 3):
            assert np.isfinite(part).all() and part.std() == pytest.approx(1.0, abs=0.03)
    noise.close()
    seeded = StepNoise(NoiseSource.reproducible(0).generator("e"), steps=1, size=10, device="cpu", workers=3)
    assert seeded.workers == 1     # a seeded stream is drawn by one thread, in order
    seeded.close()


def _train(noise: NoiseSource, epochs: int = 2) -> list[torch.Tensor]:
    """Two DP-SGD epochs of a small linear model through DPSession (Poisson batches, empty ones included)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    dp = DPConfig(mode="fixed", epsilon=1e6, delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0,
                  grad_sample_mode="hooks")
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=0.1), PrivateTraining(dp, noise=noise),
                        n=6, batch_size=2, epochs=epochs)
    x, y = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)), torch.arange(6) % 3
    for epoch in range(epochs):
        assert session.begin_epoch(epoch)
        for batch in session.batches():
            if len(batch) == 0:
                session.noise_only_step()
                continue
            session.optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(session.model(x[batch]), y[batch]).backward()
            session.optimizer.step()
        assert session.step_noise.taken == session.steps    # every step took exactly one buffer
    session.end_epoch()
    return [p.detach().clone() for p in model.parameters()]


def test_reproducible_dpsgd_runs_repeat_bit_for_bit_and_secure_ones_never():
    first, again = _train(NoiseSource.reproducible(3)), _train(NoiseSource.reproducible(3))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other_seed = _train(NoiseSource.reproducible(4))
    assert not all(torch.equal(a, b) for a, b in zip(first, other_seed))
    secure = [_train(NoiseSource()) for _ in range(2)]
    assert not all(torch.equal(a, b) for a, b in zip(*secure))


def test_noise_std_is_read_at_the_step():
    """The std comes from the optimizer at the step (sigma x C_total), so a changed multiplier takes effect."""
    model = torch.nn.Linear(200, 100, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    dp = DPConfig(mode="fixed", epsilon=1e6, delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=1.0), PrivateTraining(dp), n=4, batch_size=4,
                        epochs=1)
    assert session.begin_epoch(0)
    session.optimizer.noise_multiplier = 3.0
    session.noise_only_step()
    # noise std sigma x C on the clipped sum, divided by the expected batch size (4)
    assert model.weight.detach().std().item() == pytest.approx(3.0 / 4, rel=0.05)


def test_a_spawned_stream_is_independent_and_leaves_its_parent_alone():
    parent = NoiseSource.reproducible(9).generator("epoch-0")
    child = parent.spawn()
    untouched = NoiseSource.reproducible(9).generator("epoch-0")
    np.testing.assert_array_equal(parent.uniform((100,)), untouched.uniform((100,)))   # no draw from the parent
    again = NoiseSource.reproducible(9).generator("epoch-0").spawn()
    first = child.standard_normal((1000,))
    np.testing.assert_array_equal(first, again.standard_normal((1000,)))              # reproducible
    assert not np.intersect1d(first, untouched.standard_normal((1000,))).size
    assert not np.intersect1d(first, NoiseSource.reproducible(9).generator("epoch-1").spawn().standard_normal(
        (1000,))).size
    assert isinstance(NoiseSource().generator("e").spawn(), SecureNoiseGenerator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_noise_on_a_gpu_is_pinned_and_copied_once():
    noise = StepNoise(NoiseSource.reproducible(2).generator("epoch-0").spawn(), steps=2, size=1000, device="cuda")
    assert noise.pinned
    taken = [noise.take() for _ in range(2)]
    assert all(t.device.type == "cuda" for t in taken)
    reference = NoiseSource.reproducible(2).generator("epoch-0").spawn().standard_normal((2000,)).astype(np.float32)
    np.testing.assert_array_equal(torch.cat(taken).cpu().numpy(), reference)   # the same draws on every device
    noise.close()
