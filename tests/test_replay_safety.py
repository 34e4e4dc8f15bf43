"""A hospital cannot be talked into spending twice: the same request sent twice gets the
identical earlier answer and no second noise draw; anything else is a new, charged release. Also: requests are
validated before they are charged, and the server cannot shrink the sensitivity by declaring a huge K."""

from types import SimpleNamespace

import numpy as np
import pytest

from clients.fedavg import local_dpsgd_round, plan_noise_multiplier
from clients.hospital import Hospital, HospitalSettings
from privacy.errors import BudgetExceeded
from privacy.ledger import Ledger
from task.codecs import PCACompressor
from task import codecs
from task.errors import UserError
from task.learning.networks import build_unet
from server.pate import teacher_training
from task.settings.presets import get_preset

PRESET = get_preset("tiny")
GRID = (16, 16, 16)


def _prepared(n=4):
    rng = np.random.default_rng(0)
    images = rng.normal(size=(n, 4, *GRID)).astype(np.float32)
    labels = rng.integers(0, 4, size=(n, *GRID)).astype(np.int64)
    index = {f"p{i}": i for i in range(n)}
    return SimpleNamespace(images=lambda ids: images[[index[i] for i in ids]],
                           labels=lambda ids: labels[[index[i] for i in ids]], grid=GRID)


def _weights():
    return {k: v.numpy().copy() for k, v in build_unet(PRESET.unet).state_dict().items()}


@pytest.fixture
def cheap_sigma(monkeypatch):
    import privacy.calibration as calibration

    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *a, **k: 2.0)  # skip the PLD search
    plan_noise_multiplier.cache_clear()
    yield
    plan_noise_multiplier.cache_clear()


def test_the_same_dpfedavg_round_twice_gets_the_identical_update_and_one_charge(tmp_path, cheap_sigma):
    hospital = Hospital("h0", _prepared(), [["p0", "p1"], ["p2", "p3"]], PRESET, tmp_path / "h0",
                        HospitalSettings(lifetime_epsilon=1000.0, delta=1e-3))
    weights = _weights()
    config = {"round": 0, "rounds": 4, "epsilon": 500.0, "delta": 1e-3, "run_tag": "r1", "learning_rate": 3e-3,
              "max_grad_norm": 4.0, "batch_size": 2, "per_layer": True}
    first, metrics = local_dpsgd_round(hospital, weights, config)
    charged = len(Ledger.load(hospital.privacy_ledger))
    assert charged >= 1
    again, metrics_again = local_dpsgd_round(hospital, weights, config)      # a genuine retry
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert metrics_again == metrics
    assert len(Ledger.load(hospital.privacy_ledger)) == charged               # no second release

    # the same round name with other weights (a replay the server dressed up) is trained again: charged again
    moved = {name: value + 0.01 if value.dtype.kind == "f" else value for name, value in weights.items()}
    replayed, _ = local_dpsgd_round(hospital, moved, config)
    assert len(Ledger.load(hospital.privacy_ledger)) == 2 * charged
    assert any(not np.array_equal(first[n], replayed[n]) for n in first)


def test_retraining_local_dp_teachers_is_charged_again(tmp_path):
    hospital = Hospital("h0", _prepared(), [["p0", "p1"], ["p2", "p3"]], PRESET, tmp_path / "h0",
                        HospitalSettings(lifetime_epsilon=1000.0, delta=1e-3))
    local_dp = {"mode": "fixed", "noise_multiplier": 2.0, "epsilon": 1000.0, "delta": 1e-3, "max_grad_norm": 1.0}
    recipe = {**teacher_training(PRESET).to_config(), "teacher_epochs": 1}   # the server's whole recipe
    first = hospital.train_teachers({**recipe, "seed": 0, "local_dp": local_dp})
    ledger_path = hospital.workdir / "ledger.jsonl"
    charged = len(Ledger.load(ledger_path))
    assert charged == 2 and first["local_epsilon"] > 0
    # the metrics name the relation the epochs were charged under (DPConfig's default: replace-one)
    from privacy.events import event_from_dict
    charged_under = {event_from_dict(record["event"]).relation for record in Ledger.load(ledger_path).records()}
    assert charged_under == {first["local_relation"]} == {"replace-one"}
    # the identical request reuses the trained teachers: nothing new is released
    assert hospital.train_teachers({**recipe, "seed": 0, "local_dp": local_dp}).get("reused")
    assert len(Ledger.load(ledger_path)) == charged
    # another seed trains the teachers again from the same patients: a second release, charged
    second = hospital.train_teachers({**recipe, "seed": 1, "local_dp": local_dp})
    assert len(Ledger.load(ledger_path)) == 2 * charged
    assert second["local_epsilon"] > first["local_epsilon"]


class _FixedTeachers(Hospital):
    def __init__(self, tmp_path, max_teachers=None, lifetime=50.0):
        super().__init__("h0", prepared=None, partitions=[["a"], ["b"]], preset=PRESET, workdir=tmp_path / "h0",
                         settings=HospitalSettings(lifetime_epsilon=lifetime, delta=1e-3, max_teachers=max_teachers))
        self.runs = 0

    def load_teachers(self, config=None):   # fixed answers: nothing on disk to load
        pass

    def teacher_probs(self, k, scans, config=None):
        self.runs += 1
        rng = np.random.default_rng(self.runs)    # a new answer every run: a repeat must not recompute
        return codecs.normalise_probabilities(rng.random((len(scans), 4, 8, 8, 8)).astype(np.float32))


def _codec():
    rng = np.random.default_rng(0)
    maps = codecs.one_hot(rng.integers(0, 4, size=(12, 8, 8, 8)), 4)
    return PCACompressor(3, "clip", clip=1.0).fit(maps).state()


def test_the_same_query_batch_twice_gets_the_identical_answer_and_one_charge(tmp_path):
    hospital, codec = _FixedTeachers(tmp_path), _codec()
    scans = np.zeros((2, 4, 8, 8, 8), np.float32)
    query = {"release_ids": ["q-0", "q-1"], "sigma": 0.5, "teachers": 4}
    rows, _ = hospital.answer_query(scans, codec, query)
    runs = hospital.runs
    again, _ = hospital.answer_query(scans, codec, query)
    np.testing.assert_array_equal(rows, again)
    assert hospital.runs == runs and len(Ledger.load(hospital.privacy_ledger)) == 2
    # the same release ids with another sigma (or scans, or codec) are a new release: charged again
    hospital.answer_query(scans, codec, {**query, "sigma": 0.6})
    assert len(Ledger.load(hospital.privacy_ledger)) == 4


def test_a_query_that_cannot_be_encoded_is_refused_before_it_is_charged(tmp_path):
    hospital, codec = _FixedTeachers(tmp_path), _codec()
    query = {"release_ids": ["q-0", "q-1"], "sigma": 0.5, "teachers": 4}
    with pytest.raises(codecs.CodecRefused, match="grid"):        # scans on another grid than the codec's
        hospital.answer_query(np.zeros((2, 4, 6, 6, 6), np.float32), codec, query)
    anchored = {"kind": np.array("anchored"), "classes": np.array(4), "grid": np.array([8, 8, 8]),
                "latent_dim": np.array(codecs.anchored_latent_dim(4, (0, 2))), "shells": np.array([0, 2]),
                "clip": np.array(1.0)}
    with pytest.raises(codecs.CodecRefused, match="anchor"):      # an anchored codec without its anchor
        hospital.answer_query(np.zeros((2, 4, 8, 8, 8), np.float32), anchored, query)
    assert hospital.runs == 0 and not hospital.privacy_ledger.exists()


def test_the_hospital_bounds_the_k_a_server_declares(tmp_path):
    hospital, codec = _FixedTeachers(tmp_path, max_teachers=8), _codec()
    scans = np.zeros((1, 4, 8, 8, 8), np.float32)
    with pytest.raises(UserError, match="max-teachers"):
        hospital.answer_query(scans, codec, {"release_ids": ["q"], "sigma": 0.5, "teachers": 10**9})
    assert not hospital.privacy_ledger.exists()
    hospital.answer_query(scans, codec, {"release_ids": ["q"], "sigma": 0.5, "teachers": 8})
    assert Ledger.load(hospital.privacy_ledger).records()[0]["event"]["sensitivity"] == pytest.approx(2 / 8)


def test_a_deployed_node_needs_its_own_budget_and_consortium_size(tmp_path):
    from clients.node import hospital_for

    base = {"hospital-id": "h0", "data-dir": str(tmp_path / "data"), "workdir": str(tmp_path / "w")}
    for missing in ("epsilon-budget", "max-teachers"):
        node = {**base, "epsilon-budget": 8.0, "max-teachers": 16}
        del node[missing]
        with pytest.raises(UserError, match=missing):
            hospital_for(node, {"preset": "tiny"})


def test_a_refused_batch_records_nothing(tmp_path):
    hospital, codec = _FixedTeachers(tmp_path, lifetime=1.0), _codec()
    with pytest.raises(BudgetExceeded):
        hospital.answer_query(np.zeros((3, 4, 8, 8, 8), np.float32), codec,
                              {"release_ids": ["a", "b", "c"], "sigma": 0.05, "teachers": 4})
    assert hospital.runs == 0 and not hospital.privacy_ledger.exists()


# ------------------------------------------------------------------------------------ request keys
def test_requests_that_differ_never_share_a_key():
    from clients.replay import request_key

    # under a NUL-joined encoding, the name of B's one array spells out A's first array and the header of its
    # second: both made one byte stream
    a = {"p": np.array([0], np.uint8), "q": np.array([5], np.uint8)}
    b = {"p\x00|u1\x00(1,)\x00\x00\x00q": np.array([5], np.uint8)}
    assert request_key("round", a) != request_key("round", b)
    # values that JSON with default=str writes as another value's text
    for left, right in ((b"ab", "b'ab'"), (np.float32(1.5), "1.5"), (None, "None"), (1, "1")):
        assert request_key("round", None, {"x": left}) != request_key("round", None, {"x": right})
    assert request_key("round", None, {1: "a"}) != request_key("round", None, {"1": "a"})
    # where a field ends is part of the key: moving bytes between kind, names and values changes it
    assert request_key("ab", None, {}) != request_key("a", None, {"b": None})
    assert request_key("k", {"ab": np.zeros(1)}) != request_key("k", {"a": np.zeros(1)}, {"b": 0.0})


def test_a_retry_keeps_its_key_whatever_container_it_came_in():
    from clients.replay import request_key

    arrays = {"w": np.arange(4, dtype=np.float32)}
    assert request_key("k", arrays, {"plan": [1, 2], "sigma": 0.5}) == \
        request_key("k", {"w": np.arange(4, dtype=np.float32).copy()}, {"sigma": np.float64(0.5), "plan": (1, 2)})
    with pytest.raises(UserError, match="object"):
        request_key("k", None, {"x": object()})


def test_an_answer_kept_before_the_key_encoding_changed_still_answers_its_retry(tmp_path):
    from clients.replay import legacy_request_key

    request = ({"scans": np.arange(6, dtype=np.float32).reshape(2, 3), "codec.kind": np.array("pca")},
               {"release_ids": ["q-0", "q-1"], "sigma": 0.5, "teachers": 4, "teachers_trained": ""})
    # the digest the earlier encoding gave this request (computed with it): answers on disk are filed under it
    assert legacy_request_key("query", *request) == "542c330c64f46d61bbdbbef353ff0642f541650445b53cae1232dc7d6507953a"
    # where the earlier encoding was ambiguous it is not consulted
    assert legacy_request_key("query", {"a\x00b": np.zeros(1)}) is None
    assert legacy_request_key("query", None, {"x": b"ab"}) is None
    assert legacy_request_key("query", None, {"x": (1, 2)}) is None
    # a DP-FedAvg round as the server sends it is inside the unambiguous part: its earlier answer is found
    round_config = {"round": 0, "rounds": 4, "epsilon": 8.0, "delta": 1e-3, "run_tag": "r1-e8-0a1b2c3d",
                    "reproducible_noise": False, "plan": '[{"batch_size": 2, "epochs": 4}]', "ema_decay": None}
    assert legacy_request_key("dp-fedavg-round", {f"w.{n}": v for n, v in _weights().items()}, round_config)

    hospital, codec = _FixedTeachers(tmp_path), _codec()
    scans = np.zeros((2, 4, 8, 8, 8), np.float32)
    query = {"release_ids": ["q-0", "q-1"], "sigma": 0.5, "teachers": 4}
    rows, _ = hospital.answer_query(scans, codec, query)
    book = hospital.answers
    (kept,) = sorted(book.directory.glob("*.npz"))
    # file the answer the way the earlier version did, as a hospital upgraded mid-run finds it
    legacy = legacy_request_key("query", {"scans": scans, **{f"codec.{n}": v for n, v in codecs.verify_codec(
        codec, hospital.codec_policy, scans_shape=scans.shape).items()}},
        {**query, "teachers_trained": ""})
    kept.rename(book.directory / f"{legacy}.npz")
    kept.with_suffix(".json").rename(book.directory / f"{legacy}.json")
    runs, charged = hospital.runs, len(Ledger.load(hospital.privacy_ledger))
    again, _ = hospital.answer_query(scans, codec, query)
    np.testing.assert_array_equal(rows, again)
    assert hospital.runs == runs and len(Ledger.load(hospital.privacy_ledger)) == charged
