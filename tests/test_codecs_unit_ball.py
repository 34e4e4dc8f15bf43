"""The unit-ball activation and the hospital-side encoders (Fay et al., Algorithms 1-2)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from task import codecs
from task.errors import UserError

finite = st.floats(min_value=-1e300, max_value=1e300, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float64, st.integers(2, 40), elements=finite))
def test_unit_ball_norm_at_most_one_numpy(o):
    z = codecs.unit_ball(o)
    assert z.shape == (len(o) - 1,)
    assert np.all(np.isfinite(z))
    assert np.linalg.norm(z) <= 1.0 + 1e-12


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(2, 40),
              elements=st.floats(min_value=-3.0000000054977558e+38, max_value=3.0000000054977558e+38, allow_nan=False, allow_infinity=False, width=32,
                        allow_subnormal=False)))
def test_unit_ball_norm_at_most_one_torch(o):
    z = codecs.unit_ball(torch.from_numpy(o.reshape(1, -1)))
    assert torch.all(torch.isfinite(z))
    assert float(z.norm()) <= 1.0 + 1e-6


def test_unit_ball_zero_direction_maps_to_origin_and_keeps_gradients_finite():
    o = np.array([[5.0, 0.0, 0.0, 0.0]])
    assert np.all(codecs.unit_ball(o) == 0.0)
    t = torch.zeros(2, 5, requires_grad=True)
    codecs.unit_ball(t).sum().backward()
    assert torch.all(torch.isfinite(t.grad))


@pytest.mark.parametrize("latent", [2, 8, 64])
def test_unit_ball_of_standard_normal_is_close_to_uniform(latent):
    """The paper's appendix check: a uniform point of the l-ball has radius r with CDF r^l, so r^l must
    look Uniform[0, 1] (sigmoid(x sqrt(8/pi)) approximates Phi to within ~0.01, hence the KS margin);
    directions must be uniform on the sphere (mean ~ 0, E[u_i^2] = 1/l)."""
    rng = np.random.default_rng(latent)
    z = codecs.unit_ball(rng.standard_normal((20000, latent + 1)))
    radius = np.linalg.norm(z, axis=1)
    statistic = stats.kstest(radius ** latent, "uniform").statistic
    assert statistic < 0.025
    direction = z / radius[:, None]
    assert np.abs(direction.mean(axis=0)).max() < 0.05
    assert np.allclose((direction ** 2).mean(axis=0), 1.0 / latent, atol=0.02)
    # and a clearly non-uniform law is detected by the same test: the radius without the 1/l power
    assert stats.kstest(radius, "uniform").statistic > 0.1


def test_clip_rows_bounds_every_row_and_leaves_short_rows_alone():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(50, 7)) * rng.uniform(0, 5, size=(50, 1))
    clipped = codecs.clip_rows(z, 2.0)
    norms = np.linalg.norm(clipped.astype(np.float64), axis=1)
    assert np.all(norms <= 2.0)
    short = np.linalg.norm(z, axis=1) < 1.9
    assert np.allclose(clipped[short], z[short], atol=1e-6)
    with pytest.raises(UserError):
        codecs.clip_rows(z, 0.0)


def _pca_state(mode, grid=(2, 2, 2), classes=4, latent=3, clip=1.0):
    rng = np.random.default_rng(1)
    d = classes * int(np.prod(grid))
    q, _ = np.linalg.qr(rng.normal(size=(d, latent)))
    return {"kind": np.array("pca"), "mode": np.array(mode), "classes": np.array(classes),
            "grid": np.array(grid), "latent_dim": np.array(latent), "components": q.T.astype(np.float32),
            "mean": np.full(d, 0.25, np.float32), "clip": np.array(clip), "row_bound": np.array(
                math.sqrt(d) if mode != "clip" else clip)}


@pytest.mark.parametrize("mode", ["paper", "public"])
def test_pca_encode_refuses_non_probabilities(mode):
    state = _pca_state(mode)
    logits = np.random.default_rng(0).normal(0, 3, size=(2, 4, 2, 2, 2)).astype(np.float32)
    with pytest.raises(UserError, match=r"\[0, 1\]"):
        codecs.encode(state, logits)
    with pytest.raises(UserError, match="NaN"):
        codecs.encode(state, np.full((1, 4, 2, 2, 2), np.nan, np.float32))
    probs = np.full((2, 4, 2, 2, 2), 0.25, np.float32)
    assert codecs.encode(state, probs).shape == (2, 3)


def test_pca_clip_mode_clips_rows_and_accepts_any_finite_input():
    state = _pca_state("clip", clip=0.5)
    big = np.random.default_rng(0).normal(0, 30, size=(5, 4, 2, 2, 2)).astype(np.float32)
    z = codecs.encode(state, big)
    assert z.dtype == np.float32 and z.shape == (5, 3)
    assert np.all(np.linalg.norm(z.astype(np.float64), axis=1) <= 0.5)


def test_encode_rejects_wrong_shape():
    with pytest.raises(UserError, match="shape"):
        codecs.encode(_pca_state("paper"), np.zeros((1, 3, 2, 2, 2), np.float32))


def test_identity_encode_is_flattened_one_hot_argmax():
    state = {"kind": np.array("identity"), "classes": np.array(4), "grid": np.array((2, 2, 2)),
             "latent_dim": np.array(32), "clip": np.array(np.nan), "row_bound": np.array(math.sqrt(8))}
    probs = np.random.default_rng(0).dirichlet(np.ones(4), size=(3, 2, 2, 2)).transpose(0, 4, 1, 2, 3)
    z = codecs.encode(state, probs.astype(np.float32))
    assert z.shape == (3, 32)
    votes = z.reshape(3, 4, 8)
    assert np.all(votes.sum(axis=1) == 1)
    assert np.array_equal(votes.argmax(axis=1), probs.reshape(3, 4, 8).argmax(axis=1))


def test_autoencoder_state_roundtrip_and_encodings_in_unit_ball():
    torch.manual_seed(0)
    net = codecs.AutoencoderNet(5, (8, 8, 8), 4)
    state = {"kind": np.array("ae"), "classes": np.array(4), "grid": np.array((8, 8, 8)),
             "latent_dim": np.array(5), "channels": np.array(net.channels), "clip": np.array(1.0),
             "row_bound": np.array(1.0), **codecs.encoder_arrays(net)}
    assert not any("decoder" in name or "expand" in name for name in state)  # decoder stays on the server
    probs = torch.softmax(torch.randn(3, 4, 8, 8, 8) * 4, dim=1).numpy()
    z = codecs.encode(state, probs, device="cpu")   # net is on the CPU: the same arithmetic, no TF32
    with torch.no_grad():
        expected = net.encode(torch.from_numpy(probs)).numpy()
    assert np.allclose(z, expected, atol=1e-6)
    assert np.all(np.linalg.norm(z.astype(np.float64), axis=1) <= 1.0)
    logits = net(torch.from_numpy(probs), noise_sigma=0.3)
    assert logits.shape == (3, 4, 8, 8, 8)
    assert net.decode(torch.from_numpy(z)).sum(dim=1).allclose(torch.ones(3, 8, 8, 8), atol=1e-5)
