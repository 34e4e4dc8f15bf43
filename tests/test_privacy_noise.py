"""Where the noise comes from (docs/PRIVACY.md, "Noise"): unpredictable by default, seeded only on request, and
never shared between two releases -- in particular never between two cells of one comparison."""

import json

import numpy as np
import pytest

from privacy.errors import PrivacyError
from privacy.mechanisms import GaussianMechanism, NoiseGenerator, NoiseSource, SecureNoiseGenerator
from task.learning.compute import Compute


def test_default_source_is_secure_and_unrepeatable():
    source = NoiseSource()
    assert not source.is_reproducible
    a, b = source.generator("query-0"), source.generator("query-0")
    assert isinstance(a, SecureNoiseGenerator) and isinstance(b, SecureNoiseGenerator)
    # the same release name twice still gives fresh randomness
    assert not np.array_equal(a.standard_normal((64,)), b.standard_normal((64,)))


def test_reproducible_streams_are_named_and_independent():
    source = NoiseSource.reproducible(0)
    first = source.generator("pate-pca", "eps-1", "query-0").standard_normal((256,))
    again = source.child("pate-pca").child("eps-1").generator("query-0").standard_normal((256,))
    other_cell = source.generator("pate-pca", "eps-8", "query-0").standard_normal((256,))
    other_query = source.generator("pate-pca", "eps-1", "query-1").standard_normal((256,))
    np.testing.assert_array_equal(first, again)           # a resumed run draws what it drew before
    for other in (other_cell, other_query):
        assert not np.intersect1d(first, other).size      # no shared draw between two releases
        assert abs(np.corrcoef(first, other)[0, 1]) < 0.25
    # the old bug: PCG64(seed) for every cell made the eps-1 and eps-8 cells share their first value
    legacy = np.random.Generator(np.random.PCG64(0)).standard_normal(256)
    assert not np.intersect1d(first, legacy).size


def test_reproducible_source_needs_a_name_and_a_valid_seed():
    with pytest.raises(PrivacyError):
        NoiseSource.reproducible(0).generator()
    for seed in (-1, 1.5, True):
        with pytest.raises(PrivacyError):
            NoiseSource(seed)


def test_describe_never_reveals_the_seed():
    text = json.dumps(NoiseSource.reproducible(424242).child("cell").describe())
    assert "424242" not in text and "reproducible" in text
    assert NoiseSource().describe()["noise"] == "secure"


def test_uniforms_for_sampling_are_in_the_open_unit_interval():
    for generator in (NoiseSource().generator("s"), NoiseSource.reproducible(3).generator("s")):
        u = generator.uniform((10_000,))
        assert u.min() >= 0.0 and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.02


def _record_draws(monkeypatch):
    """Every standard-normal array any noise generator hands out, in order."""
    draws = []
    for cls in (NoiseGenerator, SecureNoiseGenerator):
        original = cls.standard_normal

        def spy(self, shape, _original=original):
            values = _original(self, shape)
            draws.append(np.asarray(values).ravel().copy())
            return values

        monkeypatch.setattr(cls, "standard_normal", spy)
    return draws


@pytest.mark.slow
def test_two_cells_of_one_comparison_never_share_a_noise_draw(tiny_prepared, tiny_split, tmp_path, monkeypatch):
    """The demo's eps=1 and eps=8 PATE cells used to draw the same noise (PCG64(seed) each): with the two
    answers the noise-free mean followed by elimination. Now each cell (and each query) has its own stream,
    even with --reproducible-noise and the same seed."""
    from task.settings.runconfig import RunSettings
    from sim.runners.simulation import simulate

    tiny_split.to_json(tmp_path / "split.json")
    (tmp_path / "world.json").write_text(json.dumps({"prepared": str(tiny_prepared.path), "preset": "tiny"}))
    settings = RunSettings(method="pate-pca", preset="tiny", seed=0, world=str(tmp_path),
                           reproducible_noise=True, compute=Compute(progress=False))
    per_cell = {}
    for epsilon in (1.0, 8.0):
        draws = _record_draws(monkeypatch)
        cell = {"method": "pate-pca", "epsilon": epsilon, "out": str(tmp_path / f"eps-{epsilon:g}"),
                "shared_dir": str(tmp_path / "_shared")}
        (result,) = simulate(settings, engine="inprocess", cells=[cell])
        assert result["seed"] is None and result["noise"] == "reproducible"   # the seed is not published
        per_cell[epsilon] = np.concatenate(draws)
        monkeypatch.undo()
    assert per_cell[1.0].size and per_cell[8.0].size
    assert not np.intersect1d(per_cell[1.0], per_cell[8.0]).size


def test_gaussian_mechanism_on_a_named_stream_matches_its_sigma():
    mechanism = GaussianMechanism(2.0, NoiseSource().generator("query-0"))
    values = mechanism(np.zeros(20_000))
    assert np.std(values) == pytest.approx(2.0, rel=0.03)


def test_deployment_refuses_seeded_noise():
    """The ServerApp refuses --reproducible-noise as soon as one hospital is a deployed node, and so do the
    deployment helpers; simulated nodes may use it."""
    from server.server_app import refuse_seeded_noise_in_deployment
    from task.errors import UserError
    from task.settings.runconfig import RunSettings
    from sim.deployment.fedpate_local import run_local_deployment

    seeded = RunSettings.from_run_config({"reproducible-noise": True})
    assert seeded.reproducible_noise and not RunSettings.from_run_config({}).reproducible_noise
    refuse_seeded_noise_in_deployment(seeded, {"h0": False, "h1": False})        # simulation: allowed
    refuse_seeded_noise_in_deployment(RunSettings(), {"h0": True})               # secure noise: fine
    with pytest.raises(UserError, match="h1"):
        refuse_seeded_noise_in_deployment(seeded, {"h0": False, "h1": True})
    with pytest.raises(UserError, match="reproducible-noise"):
        run_local_deployment(seeded, "/nonexistent-work-dir")
    with pytest.raises(UserError, match="reproducible-noise"):
        RunSettings.from_run_config({"reproducible-noise": "maybe"})


def test_deployed_hospital_refuses_seeded_local_dpsgd(tmp_path):
    """DP-FedAvg's local DP-SGD: a deployed hospital never draws seeded noise, whatever the server asks."""
    from clients.fedavg import local_dpsgd_round
    from task.errors import UserError

    class Deployed:
        hospital_id, deployed, partitions, workdir = "h0", True, [["a"]], tmp_path

    with pytest.raises(UserError, match="refuses reproducible"):
        local_dpsgd_round(_Stub(Deployed), {}, {"round": 0, "rounds": 1, "epsilon": 8.0, "delta": 1e-3,
                                                "learning_rate": 3e-3, "max_grad_norm": 4.0, "batch_size": 2,
                                                "per_layer": True, "reproducible_noise": True})


class _Stub:
    """A hospital whose data and model are never reached (the refusal comes first)."""

    def __init__(self, base):
        self.__dict__.update({k: v for k, v in vars(base).items() if not k.startswith("__")})

    @property
    def preset(self):
        from task.settings.presets import get_preset

        return get_preset("tiny")

    @property
    def prepared(self):
        import numpy as np

        class Prepared:
            def images(self, ids):
                return np.zeros((len(ids), 4, 16, 16, 16), np.float32)

            def labels(self, ids):
                return np.zeros((len(ids), 16, 16, 16), np.int64)

        return Prepared()
