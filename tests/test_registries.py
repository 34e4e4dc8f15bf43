"""A method and a codec are added through the registries alone -- this test registers a toy codec
kind (the hospital side and its server compressor, one record), a toy PATE method naming it and a toy public floor
with its own cell runner, without editing a product module, and runs them through ``fedpate compare --preset tiny``
and the report."""

import json

import numpy as np
import pytest

from privacy import sensitivity as sens
from task.codecs import Compressor, make_compressor
from task import codecs
from sim.cli import main
from task.settings.methods import Method, method, names, register_method, unregister_method
from sim.runners.cells import register_cell_runner, run_floor, run_public_only, unregister_cell_runner


# --------------------------------------------------------------------------------- the toy codec: hospitals
def _verify(state, classes, grid, latent, scans_shape):
    if latent != classes - 1:
        raise codecs.CodecRefused("toy codec: one number per tumour class")
    return 1.0


def _sensitivity(state, teachers):
    return float(sens.unit_ball_bound(teachers))   # rows clipped to the unit ball: 2/K


def _encoder(state, device=None):
    # each tumour class's mean probability over the volume, clipped to the unit ball
    return lambda probs: codecs.clip_rows(probs[:, 1:].reshape(len(probs), probs.shape[1] - 1, -1).mean(axis=2), 1.0)


# --------------------------------------------------------------------------------- the toy codec: server
class ToyCompressor(Compressor):
    name = "toy-means"

    def fit(self, public_onehot):
        maps = self._check_fit_input(public_onehot)
        self.latent_dim = self.classes - 1
        self.mean_map = maps.mean(axis=0)
        return self

    def state(self):
        return self._base_state("toy-means")

    def sensitivity(self, teachers):
        return float(sens.unit_ball_bound(teachers))

    def decode(self, z):
        return np.repeat(self.mean_map[None], len(np.asarray(z).reshape(-1, self.latent_dim)), axis=0)


def toy_compressor(settings, *, seed, checkpoint, progress, device=None, **options):
    return ToyCompressor()


TOY_KIND = codecs.CodecKind("toy-means", _verify, _sensitivity, _encoder, codecs.zero_rows, compressor=toy_compressor)


@pytest.fixture
def toy_registered():
    codecs.register_codec(TOY_KIND)
    register_method(Method("pate-toy", "toy-pate", "private", federated=True, protocol="pate", per_epsilon=True,
                           sweeps_k=True, starts_from_public=True, codec="toy-means",
                           description="PATE through the toy codec"))
    register_method(Method("toy-floor", "toy-floor", "floor", runner="toy-floor"))
    register_cell_runner("toy-floor", run_floor(lambda run: _toy_floor(run)))
    yield
    unregister_cell_runner("toy-floor")
    unregister_method("toy-floor")
    unregister_method("pate-toy")
    codecs.unregister_codec("toy-means")


def _toy_floor(run):
    """A floor written by the public-only runner, relabelled: the report must take it from its record."""
    written = run_public_only(run)
    results = json.loads((run.out / "results.json").read_text())
    (run.out / "results.json").write_text(json.dumps({**results, "method": "toy-floor"}))
    return written


def test_registering_a_method_and_a_codec_reaches_every_layer(toy_registered):
    assert "pate-toy" in names(protocol="pate") and "toy-means" in codecs.codec_kinds()
    assert "toy-means" in codecs.CodecPolicy().allowed()           # hospitals accept a registered kind
    assert method("pate-toy").private and method("toy-floor").role == "floor"
    assert isinstance(make_compressor("pate-toy"), ToyCompressor)   # the method's codec kind's compressor
    state = ToyCompressor().fit(codecs.one_hot(np.random.default_rng(0).integers(0, 4, (3, 4, 4, 4)))).state()
    verified = codecs.verify_codec(state)
    assert codecs.codec_sensitivity(verified, 8) == pytest.approx(0.25)
    rows = codecs.make_encoder(verified)(np.full((2, 4, 4, 4, 4), 0.25, np.float32))
    assert rows.shape == (2, 3) and np.allclose(rows, 0.25)



def test_the_secure_variant_and_every_protocol_and_runner_come_from_the_records():
    """Whether PATE goes through the secure sum is the method record's ``secure_sum`` (a registered secure PATE
    method is secure without another table to edit); the built-in records name their protocol or cell runner by
    the registry's enums, and every one of those has its function registered."""
    from server.pate_secure import is_secure
    from server.protocols import PROTOCOLS
    from sim.runners.cells import cell_runner
    from task.settings.methods import Protocol, Runner, methods

    register_method(Method("pate-toy-secure", "toy-pate", "private", federated=True, protocol="pate",
                           per_epsilon=True, secure_sum=True, codec="anchored"))
    try:
        assert is_secure("pate-toy-secure")
    finally:
        unregister_method("pate-toy-secure")
    assert is_secure("pate-anchored-secure") and not is_secure("pate-anchored")
    assert not is_secure("dp-fedavg-secure")   # secure, but not a PATE query phase
    for record in methods():
        named = record.protocol if record.federated else record.runner
        assert isinstance(named, Protocol if record.federated else Runner), record.name
        assert PROTOCOLS.get(named) if record.federated else cell_runner(named)

@pytest.mark.slow
def test_a_toy_method_and_codec_run_through_compare_and_the_report(toy_registered, tmp_path, monkeypatch,
                                                                   tiny_phantoms):
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "tiny", "--epsilons", "8", "--methods", "pate-toy,public-only,toy-floor",
                 "--engine", "inprocess", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    cell = json.loads((out / "pate-toy" / "eps-8" / "results.json").read_text())
    assert cell["method"] == "pate-toy" and 0 < cell["epsilon"] <= 8.0
    assert cell["compressor"]["name"] == "toy-means"
    # the hospitals charged their own ledgers with the sensitivity of the toy kind, 2/K
    ledgers = list((out / "hospital-ledgers").glob("*.jsonl"))
    events = [json.loads(line)["event"] for path in ledgers for line in path.read_text().splitlines()]
    assert events and all(e["sensitivity"] == pytest.approx(2 / cell["teachers"]) for e in events)
    report = (out / "report.md").read_text()
    assert "| pate-toy |" in report and "toy-floor" in report
    # the toy floor is a floor: headroom is stated against it too, and it is charged nothing
    assert (out / "toy-floor" / "ledger.jsonl").read_text() == ""
